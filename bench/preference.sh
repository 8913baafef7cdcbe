#!/usr/bin/env bash
# DPO against SFT on the same tokens, on one GPU: a synthetic pair file (bench/preference.py data), then
# `slide train --objective dpo` and `slide train` (SFT) on each pair's two sequences, same rows, batch and
# steps. Usage, from the repository root, with bench/gpu_env.sh sourced first:
#   bash bench/preference.sh OUT_DIR [--budget-s S] [--model M] [--gpu-memory G] [--steps N] [--dry-run] [-- ARGS]
# --budget-s: no run starts after that many seconds, and each is cut at the budget's end (default 560).
# --model (default llama3.1-8b: a preset, random weights, the bundled byte tokenizer), --gpu-memory (24).
# --steps: training steps of each run (default 6); the pair file holds several times more pairs, all of
#   which DPO's reference pass reads.
# --dry-run: the same on the CPU with tiny-llama and short rows (what the tests run); peaks unchecked.
# ARGS after --: more `slide train` options for both runs (e.g. -- --optimizer-state int8).
# Disk: `slide train` always writes a final checkpoint and the exported model; for llama3.1-8b that is about
# 90 GiB + 15 GiB (46 + 15 with --optimizer-state int8), refused in one line at the start where the disk of
# OUT_DIR has less. Each run's checkpoints/ and model/ are removed once it ends (the table reads only
# metrics.jsonl and train.log), so the second run finds the disk the first had.
# Writes OUT_DIR/pairs.jsonl, sft.jsonl, dpo/ and sft/ (the runs, each with metrics.jsonl and train.log,
# its console output in dpo.log and sft.log), then OUT_DIR/preference.md (printed) and preference.json:
# finite losses, DPO policy tok/s against SFT's (target >= 0.9), the reference pass's tok/s against the
# forward-only FLOP bound at the bf16 matmul rate measured at the start (target >= 0.9), GPU and host
# peaks against the run's plan (+3 %, +5 %).
set -uo pipefail
out=${1:?usage: bench/preference.sh OUT_DIR [--budget-s S] [--model M] [--gpu-memory G] [--dry-run]}
shift
budget=560 dry=0 model="" gpu_memory=24 steps=6 extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --budget-s) budget=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --gpu-memory) gpu_memory=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
mkdir -p "$out"
python=${PYTHON:-python3}
if [ "$dry" = 1 ]; then
  model=${model:-tiny-llama} seq_len=256 batch=2 pairs_per_step=2 reference_steps=3
  device=(--device cpu) checks=(--no-peak-checks) matmul=""
else
  # 16 rows of 1024 tokens a step (a pair a row), as the 8B benchmarks at 24 GiB; the reference pass reads
  # 16 steps' worth of pairs, so its time is seconds, not a few micro-batches.
  model=${model:-llama3.1-8b} seq_len=1024 batch=16 pairs_per_step=16 reference_steps=16
  device=(--gpu-memory "$gpu_memory") checks=()
  matmul=$("$python" bench/preference.py matmul 2> "$out/matmul.log" | tail -1)
  echo "bf16 matmul: ${matmul:-not measured} TFLOP/s"
fi
pairs=$((pairs_per_step * (steps > reference_steps ? steps : reference_steps)))
"$python" bench/preference.py data "$out" --pairs "$pairs" --seq-len "$seq_len" > /dev/null || exit 1
common=(--model "$model" "${device[@]}" --seq-len "$seq_len" --batch-size "$batch" --steps "$steps" --lr 1e-6
  --no-shuffle --overwrite --keep-checkpoints 0 "${extra[@]}")
began=$SECONDS
for run in dpo sft; do
  left=$((budget - (SECONDS - began)))
  if [ "$left" -lt 20 ]; then echo "== $run: not run (budget spent)" > "$out/$run.log"; continue; fi
  if [ "$run" = dpo ]; then data=(--data "$out/pairs.jsonl" --objective dpo); else data=(--data "$out/sft.jsonl"); fi
  echo "== $run ($left s left)"
  t0=$SECONDS
  timeout "$left" "$python" -m slide_hf train "${common[@]}" "${data[@]}" --output "$out/$run" > "$out/$run.log" 2>&1
  echo "   rc=$? in $((SECONDS - t0)) s"
  rm -rf "$out/$run/checkpoints" "$out/$run/model"
done
"$python" bench/preference.py summarize "$out" --model "$model" --seq-len "$seq_len" "${checks[@]}" \
  ${matmul:+--matmul-tflops "$matmul"}
