#!/usr/bin/env bash
# Where each unit's AdamW update runs, measured on one GPU machine: host, GPU-streamed and the cost model's
# choice side by side in one call (docs/benchmarks.md, "Update placement"). Usage, from the repository root
# with the wheels of bench/gpu_env.sh carried, any number of steps in the order given:
#   bash bench/update_placement.sh OUT_DIR [--budget-s S] STEP...
# Steps:
#   doctor      slide doctor: measures and caches this machine's rates (auto and the predictions read them)
#   checks      GPU tests of the streamed update and of the engine (~2 min)
#   kernel-tests    the compact-moment AdamW and split-master codec kernels, and the streamed-update tests
#   streamed-tests  only tests/core/test_streamed_gpu.py
#   engine-gpu-tests  streamed updates (clipping, accumulation, pooled sums), units moved between host and GPU, the cross-
#               entropy's row weights, the compact-moment kernels and Llama 4's routed experts: every GPU test of
#               those files (~1 min on an H100)
#   gemma3      bench/diagnose_blocks.py on Gemma 3's streamed blocks (expect every block at 12-14 ms)
#   8b-PLACEMENT[-split][-bf16|-int8][-clip]   llama3.1-8b --gpu-memory 24, update placement host|gpu|auto, with
#               --master split (else fp32), --optimizer-state bf16|int8 and --max-grad-norm 1 when named (~1 min each)
#   3b-PLACEMENT[-split][-bf16|-int8]   llama3.2-3b --gpu-memory 12, against plain PyTorch in the same run
#   14b-PLACEMENT[-split][-bf16|-int8]  qwen2.5-14b --gpu-memory 24, RAM only (--resident-gib 0 with host)
# --budget-s: no step starts after that many seconds, and each is cut at the budget's end (default 580).
# Each bench step writes OUT_DIR/<step>.json (slide bench's JSON: tok/s, bounds, measured against predicted).
set -uo pipefail
out=${1:?usage: bench/update_placement.sh OUT_DIR [--budget-s S] STEP...}
shift
budget=580
if [ "${1:-}" = "--budget-s" ]; then budget=$2; shift 2; fi
mkdir -p "$out"
source bench/gpu_env.sh
began=$SECONDS
run() {
  local name=$1; shift
  local left=$((budget - (SECONDS - began)))
  if [ "$left" -lt 20 ]; then echo "== $name: not run (budget spent)"; return; fi
  echo "== $name ($left s left): $*"
  local t0=$SECONDS
  timeout "$left" "$@" > "$out/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t0)) s"; tail -5 "$out/$name.log"
}
bench() { local name=$1; shift; run "$name" python3 bench/e2e.py --batch-size 16 --seq-len 1024 --json "$out/$name.json" "$@"; }
variant() {  # 8b-auto-split-bf16 -> the bench options of that run
  local step=$1 model placement opts=()
  IFS=- read -r model placement rest <<< "$step"
  case $model in
    8b) opts=(--model llama3.1-8b --gpu-memory 24 --steps 5 --warmup 1) ;;
    3b) opts=(--model llama3.2-3b --gpu-memory 12 --steps 8 --warmup 2 --compare plain) ;;
    14b) opts=(--model qwen2.5-14b --gpu-memory 24 --steps 4 --warmup 1)
         [ "$placement" = host ] && opts+=(--resident-gib 0) ;;
  esac
  opts+=(--update-placement "$placement")
  if [[ -$rest- == *-split-* ]]; then opts+=(--master split); else opts+=(--master fp32); fi  # auto is the default
  [[ -$rest- == *-bf16-* ]] && opts+=(--optimizer-state bf16)
  [[ -$rest- == *-int8-* ]] && opts+=(--optimizer-state int8)
  [[ -$rest- == *-clip-* ]] && opts+=(--max-grad-norm 1)
  bench "$step" "${opts[@]}"
}

for step in "$@"; do
  case $step in
    doctor) run doctor python3 -c "import sys; from slide_hf.cli.main import main; sys.exit(main(['doctor']))" ;;
    checks) run checks python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_engine_gpu.py \
              tests/core/test_split_master_gpu.py tests/core/test_streamed_gpu.py ;;
    kernel-tests) run kernel-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_compact_adamw.py tests/kernels/test_split_master_kernels.py \
                    tests/core/test_streamed_gpu.py ;;
    streamed-tests) run streamed-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_streamed_gpu.py ;;
    engine-gpu-tests) run engine-gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_streamed_gpu.py \
                        tests/core/test_engine_replacement.py tests/kernels/test_linear_cross_entropy.py \
                        tests/kernels/test_compact_adamw.py tests/core/test_compact_state.py tests/core/test_sums_pool.py \
                        tests/hf/test_llama4_moe.py ;;
    gemma3) run gemma3 python3 bench/diagnose_blocks.py --model gemma3-12b --layers 8 --no-sync --steps 2 ;;
    8b-*|3b-*|14b-*) variant "$step" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text()); s = r.get("slide", r)
    print(f.stem, json.dumps({k: s.get(k) for k in ("tokens_per_s", "binding_limit", "bound_ms", "update_placement",
          "measured_against_predicted")}), "plain", (r.get("plain") or {}).get("tokens_per_s"))
PY
