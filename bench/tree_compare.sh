#!/usr/bin/env bash
# Two trees' `slide bench` side by side in one process tree, interleaved (A B B A) so that a host's drift
# does not favour either. Each tree is its five packages as wheels (pip wheel --no-deps of `git archive`).
#   bench/tree_compare.sh OUT A_WHEELS B_WHEELS -- --model llama3.2-3b --gpu-memory 12 --steps 6
# Writes OUT/<model>-<n>-<A|B>.json per run and prints tok/s, the bound and its parts per run, then each
# tree's mean.
set -uo pipefail
out=${1:?usage: bench/tree_compare.sh OUT A_WHEELS B_WHEELS -- slide bench options}
a=${2:?}; b=${3:?}; shift 3; [ "${1:-}" = "--" ] && shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for tree in A B; do
  wheels=$a; [ $tree = B ] && wheels=$b
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/site-$tree" "$wheels"/*.whl \
    || { echo "installing $wheels failed"; exit 2; }
done
model=$(printf '%s\n' "$@" | awk 'prev=="--model"{print; exit} {prev=$0}')
n=0
for tree in A B B A; do
  n=$((n + 1))
  json="$out/${model:-default}-$n-$tree.json"
  PYTHONPATH="/tmp/site-$tree" timeout 540 python3 -c 'import sys; from slide_hf.cli.main import main; sys.exit(main())' \
    bench "$@" --json "$json" > "$out/${model:-default}-$n-$tree.log" 2>&1
  echo "run $n tree $tree rc=$?"
done
python3 - "$out" "${model:-default}" <<'PY'
import json, pathlib, statistics, sys
out, model = pathlib.Path(sys.argv[1]), sys.argv[2]
means = {"A": [], "B": []}
for path in sorted(out.glob(f"{model}-*-?.json")):
    result = json.loads(path.read_text())
    s = result.get("slide", result)
    tree = path.stem[-1]
    means[tree].append(s["tokens_per_s"])
    keys = ("step_s", "binding_limit", "physical_bound_tokens_per_s", "gpu_peak_gib", "host_peak_rss_gib")
    print(path.stem, "tok/s", round(s["tokens_per_s"]), {k: s.get(k) for k in keys})
for tree, values in means.items():
    if values:
        print(f"tree {tree}: mean {statistics.mean(values):.0f} tok/s over {len(values)} runs {[round(v) for v in values]}")
if means["A"] and means["B"]:
    print(f"B / A = {statistics.mean(means['B']) / statistics.mean(means['A']):.4f}")
PY
