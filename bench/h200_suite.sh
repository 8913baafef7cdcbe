#!/usr/bin/env bash
# The benchmark suite behind docs/benchmarks.md, on one GPU machine. Usage: bench/h200_suite.sh OUT_DIR
# Writes one JSON per run (plus the trace of one 3B step) into OUT_DIR and prints a summary.
set -uo pipefail
out=${1:?usage: bench/h200_suite.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
run() { local name=$1; shift; echo "== $name: $*"; timeout 900 "$@" > "/tmp/$name.log" 2>&1; echo "   rc=$?"; tail -3 "/tmp/$name.log"; }

run gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/core tests/hf tests/kernels
run e2e_3b_12g python3 bench/e2e.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --steps 8 \
    --gpu-memory 12 --compare plain --trace "$out" --json "$out/e2e_3b_12g.json"
run e2e_3b_12g_clip python3 bench/e2e.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --steps 8 \
    --gpu-memory 12 --max-grad-norm 1.0 --json "$out/e2e_3b_12g_clip.json"
run e2e_3b_12g_clip_never python3 bench/e2e.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --steps 8 \
    --gpu-memory 12 --max-grad-norm 1000 --json "$out/e2e_3b_12g_clip_never.json"
run e2e_3b_40g python3 bench/e2e.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --steps 6 \
    --gpu-memory 40 --json "$out/e2e_3b_40g.json"
run e2e_8b_24g python3 bench/e2e.py --model llama3.1-8b --batch-size 16 --seq-len 1024 --steps 11 --warmup 3 \
    --gpu-memory 24 --json "$out/e2e_8b_24g.json"
run e2e_14b python3 bench/e2e.py --model qwen2.5-14b --batch-size 16 --seq-len 1024 --steps 5 \
    --json "$out/e2e_14b.json"
mkdir -p /tmp/slide-io-bench
run io python3 bench/io_bench.py --dir /tmp/slide-io-bench --size-gb 1 --repeat 2 --json "$out/io.json"
python3 - "$out" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    r = json.loads(f.read_text()); s = r["slide"]
    print(f.stem, "tok/s", s["tokens_per_s"], "plain", r.get("plain", {}).get("tokens_per_s"), "ratio", r.get("ratio"),
          "bound", s["physical_bound_tokens_per_s"], s["binding_limit"], "gpu", s["gpu_peak_gib"], "plan", s["planned_gpu_peak_gib"],
          "host", s["host_peak_rss_gib"], "plan", s["planned_host_peak_gib"], "B/param", s["host_bytes_per_param"],
          "overlap", s["median_block_overlap"], "crit", s["critical_batch_size"], "resident", len(s["resident_units"]),
          "steps", s["step_times_s"], "norms", s.get("grad_norms"))
PY
