#!/usr/bin/env bash
# Long sequences on one GPU: Llama-3.1-8B and Qwen3-8B at batch 1 with --gpu-memory 24, 32K, 64K and 128K tokens,
# 3 steps each (slide bench, the blocks tiled as --seq-tile auto chooses), then the longest --seq-len
# `slide plan --gpu-memory 76` allows on this host and what limits it. Usage, from the repository root, with
# bench/gpu_env.sh sourced first:
#   bash bench/long_context.sh OUT_DIR [--budget-s S] [--layers N] [--models A,B] [--seq-lens N,M] [--dry-run]
# --budget-s: no run starts after that many seconds, and each is cut at the budget's end (default 580).
# --layers N: each run keeps the first N decoder layers (a host without RAM for a whole 8B model's Adam state).
# --models, --seq-lens: other models or lengths than the defaults.
# --flags "...": more `slide bench` and `slide plan` flags for every run and plan, e.g. "--master split
#   --optimizer-state bf16" where the host's RAM does not hold fp32 Adam state beside the sliding activations.
# --dry-run: the same steps on the CPU with tiny models and short rows (what the tests run); peaks unchecked.
# Per run: OUT_DIR/run-<model>-<seq_len>.json (slide bench's JSON) and .log, and attention-<model>-<seq_len>.json
# (one layer's attention timed at that length); per model: OUT_DIR/plan-<model>.json.
# Then OUT_DIR/long_context.md (printed): finite losses, GPU peak vs plan (+3 %), host peak vs plan (+5 %),
# tok/s against the step's FLOP bound at the bf16 matmul rate measured at the start, and against the step's own
# bound: its matmuls (recompute included) at that rate and its attention as timed (bench/long_context.py).
set -uo pipefail
out=${1:?usage: bench/long_context.sh OUT_DIR [--budget-s S] [--layers N] [--dry-run]}
shift
budget=580 dry=0 layers=() given_models="" given_seqs="" flags=()
while [ $# -gt 0 ]; do
  case $1 in
    --budget-s) budget=$2; shift 2 ;;
    --layers) layers=(--layers "$2"); shift 2 ;;
    --models) given_models=$2; shift 2 ;;
    --seq-lens) given_seqs=$2; shift 2 ;;
    --flags) read -r -a flags <<< "$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
mkdir -p "$out"
python=${PYTHON:-python3}
if [ "$dry" = 1 ]; then
  models=(tiny-llama test-qwen3) seq_lens=(256 512) device=(--device cpu --seq-tile 64) planned=(--device cpu)
  matmul="" checks=(--no-peak-checks)
else
  models=(llama3.1-8b qwen3-8b-yarn) seq_lens=(32768 65536 131072) device=(--gpu-memory 24) planned=(--gpu-memory 76)
  checks=()
  matmul=$("$python" bench/long_context.py matmul 2> "$out/matmul.log" | tail -1)
  echo "bf16 matmul: ${matmul:-not measured} TFLOP/s"
fi
[ -n "$given_models" ] && IFS=, read -r -a models <<< "$given_models"
[ -n "$given_seqs" ] && IFS=, read -r -a seq_lens <<< "$given_seqs"
began=$SECONDS
for model in "${models[@]}"; do
  for seq in "${seq_lens[@]}"; do
    name="run-$model-$seq" left=$((budget - (SECONDS - began)))
    if [ "$left" -lt 20 ]; then echo "== $name: not run (budget spent)" > "$out/$name.log"; continue; fi
    echo "== $name ($left s left)"
    t0=$SECONDS
    # one layer's attention at this length, timed apart: the step's own bound (bench/long_context.py)
    timeout "$left" "$python" bench/long_context.py attention --model "$model" --seq-len "$seq" \
      > "$out/attention-$model-$seq.json" 2> "$out/attention-$model-$seq.log"
    timeout "$left" "$python" -m slide_hf bench --model "$model" "${device[@]}" "${layers[@]}" "${flags[@]}" --batch-size 1 \
      --seq-len "$seq" --steps 3 --warmup 1 --json "$out/$name.json" > "$out/$name.log" 2>&1
    echo "   rc=$? in $((SECONDS - t0)) s"
  done
  # The longest --seq-len the larger budget holds at batch 1 (rows of one sequence, as the runs' are), and
  # the plan at that length: whether this host's RAM holds it too.
  plan=("$python" -m slide_hf plan --model "$model" "${planned[@]}" "${flags[@]}" --batch-size 1 --no-packing --json)
  "${plan[@]}" --seq-len "${seq_lens[-1]}" > "$out/plan-$model.json" 2> "$out/plan-$model.log" || true
  longest=$("$python" -c "import json, sys; print(json.load(open(sys.argv[1])).get('longest_seq_len') or '')" \
    "$out/plan-$model.json" 2> /dev/null)
  if [ -n "$longest" ]; then
    "${plan[@]}" --seq-len "$longest" > "$out/plan-$model-longest.json" 2>> "$out/plan-$model.log" || true
  fi
done
models_csv=$(IFS=,; echo "${models[*]}") seqs_csv=$(IFS=,; echo "${seq_lens[*]}")
"$python" bench/long_context.py summarize "$out" --models "$models_csv" --seq-lens "$seqs_csv" "${checks[@]}" \
  ${matmul:+--matmul-tflops "$matmul"}
