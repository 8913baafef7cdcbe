#!/usr/bin/env bash
# Where each unit's AdamW update runs, measured on one GPU machine: host, GPU-streamed and the cost model's
# choice side by side in one call (docs/benchmarks.md, "Update placement"). Usage, from the repository root
# with the wheels of bench/gpu_env.sh carried, any number of steps in the order given:
#   bash bench/update_placement.sh OUT_DIR [--budget-s S] STEP...
# Steps:
#   doctor      slide doctor: measures and caches this machine's rates (auto and the predictions read them)
#   checks      GPU tests of the streamed update and of the engine (~2 min)
#   gemma3      bench/diagnose_blocks.py on Gemma 3's streamed blocks (expect every block at 12-14 ms)
#   8b-host 8b-gpu 8b-auto     llama3.1-8b --gpu-memory 24 in each placement (~2 min each)
#   3b          llama3.2-3b --gpu-memory 12, auto placement, against plain PyTorch in the same run
#   14b-int8-host 14b-bf16-auto  qwen2.5-14b --gpu-memory 24, RAM only
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
b8() { bench "8b-$1" --model llama3.1-8b --gpu-memory 24 --steps 5 --warmup 1 --update-placement "$1"; }

for step in "$@"; do
  case $step in
    doctor) run doctor python3 -c "import sys; from slide_hf.cli.main import main; sys.exit(main(['doctor']))" ;;
    checks) run checks python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_engine_gpu.py \
              tests/core/test_split_master_gpu.py tests/core/test_streamed_gpu.py ;;
    gemma3) run gemma3 python3 bench/diagnose_blocks.py --model gemma3-12b --layers 8 --no-sync --steps 2 ;;
    8b-host) b8 host ;;
    8b-gpu) b8 gpu ;;
    8b-auto) b8 auto ;;
    3b) bench 3b --model llama3.2-3b --gpu-memory 12 --steps 8 --update-placement auto --compare plain ;;
    14b-int8-host) bench "$step" --model qwen2.5-14b --gpu-memory 24 --resident-gib 0 --optimizer-state int8 \
                     --steps 4 --warmup 1 --update-placement host ;;
    14b-bf16-auto) bench "$step" --model qwen2.5-14b --gpu-memory 24 --optimizer-state bf16 --master split \
                     --steps 4 --warmup 1 --update-placement auto ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text()); s = r.get("slide", r)
    print(f.stem, json.dumps({k: s.get(k) for k in ("tokens_per_s", "binding_limit", "bound_ms", "update_placement",
          "measured_against_predicted")}), "plain", (r.get("plain") or {}).get("tokens_per_s"))
PY
