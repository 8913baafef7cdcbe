#!/usr/bin/env bash
# Where each unit's AdamW update runs, measured on one GPU machine: host, GPU-streamed and the cost model's
# choice side by side in one call (docs/benchmarks.md, "Update placement"). Usage, from the repository root
# with the wheels of bench/gpu_env.sh carried:
#   bash bench/update_placement.sh OUT_DIR checks   # GPU tests of the streamed update + Gemma 3's blocks (~3 min)
#   bash bench/update_placement.sh OUT_DIR 8b       # llama3.1-8b --gpu-memory 24: host, gpu, auto (~8 min)
#   bash bench/update_placement.sh OUT_DIR 3b       # llama3.2-3b --gpu-memory 12: auto against plain PyTorch
#   bash bench/update_placement.sh OUT_DIR 14b      # qwen2.5-14b --gpu-memory 24, RAM only: int8 host, bf16 auto
# Each bench run writes OUT_DIR/<name>.json (slide bench's JSON: tok/s, bounds, measured against predicted).
set -uo pipefail
out=${1:?usage: bench/update_placement.sh OUT_DIR checks|8b|3b|14b}
stage=${2:?usage: bench/update_placement.sh OUT_DIR checks|8b|3b|14b}
mkdir -p "$out"
source bench/gpu_env.sh
run() { local name=$1; shift; echo "== $name: $*"; timeout 590 "$@" > "$out/$name.log" 2>&1; echo "   rc=$?"; tail -4 "$out/$name.log"; }
bench() { local name=$1; shift; run "$name" python3 bench/e2e.py --batch-size 16 --seq-len 1024 --json "$out/$name.json" "$@"; }

case $stage in
  checks)
    run gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_engine_gpu.py tests/core/test_split_master_gpu.py
    run gemma3_blocks python3 bench/diagnose_blocks.py --model gemma3-12b --layers 8 --no-sync --steps 2
    ;;
  8b)
    for placement in host gpu auto; do
      bench "8b_24g_$placement" --model llama3.1-8b --gpu-memory 24 --steps 6 --warmup 2 --update-placement "$placement"
    done
    ;;
  3b)
    bench 3b_12g_auto --model llama3.2-3b --gpu-memory 12 --steps 8 --update-placement auto --compare plain
    ;;
  14b)
    bench 14b_24g_int8_host --model qwen2.5-14b --gpu-memory 24 --resident-gib 0 --optimizer-state int8 --steps 4 \
      --warmup 1 --update-placement host
    bench 14b_24g_bf16_auto --model qwen2.5-14b --gpu-memory 24 --optimizer-state bf16 --master split --steps 4 \
      --warmup 1 --update-placement auto
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text()); s = r.get("slide", r)
    print(f.stem, "tok/s", s.get("tokens_per_s"), "plain", r.get("plain", {}).get("tokens_per_s"),
          "bound", s.get("binding_limit"), "streamed", len(s.get("streamed_units") or []),
          "measured/predicted", (s.get("measured_against_predicted") or {}).get("step"))
PY
