#!/usr/bin/env bash
# Plans that learn the machine, on one GPU machine: each bench step of bench/update_placement.sh run twice in
# one call. The first run plans from `slide doctor`'s stand-alone rates (measured first) and keeps the rates
# its steps measured (slide_hf/in_step_rates.py); the second plans with them. Prints, per step and run, the
# step time, host peak and GPU peak against the plan, and each measured term (docs/benchmarks.md, "Plans that
# learn the machine"). Usage, from the repository root with the wheels of bench/gpu_env.sh carried:
#   bash bench/learned_plan.sh OUT_DIR [--budget-s S] STEP...      e.g. 3b-host 8b-host-clip 8b-auto
set -uo pipefail
out=${1:?usage: bench/learned_plan.sh OUT_DIR [--budget-s S] STEP...}
shift
budget=580
if [ "${1:-}" = "--budget-s" ]; then budget=$2; shift 2; fi
began=$SECONDS
rm -f "${XDG_CACHE_HOME:-$HOME/.cache}"/slide/in-step-rates-*.json  # the first run plans from stand-alone rates
bash bench/update_placement.sh "$out/doctor" --budget-s 120 doctor
for step in "$@"; do
  for run in first second; do
    left=$((budget - (SECONDS - began)))
    bash bench/update_placement.sh "$out/$run" --budget-s "$left" "$step"
  done
done
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| step | run | step s measured / planned | host peak GiB | GPU peak GiB | GPU compute s | host AdamW busy s |")
print("|---|---|---|---|---|---|---|")
for first in sorted((out / "first").glob("*.json")):
    for run in ("first", "second"):
        path = out / run / first.name
        if not path.exists():
            print(f"| {first.stem} | {run} | not run |  |  |  |  |")
            continue
        s = json.loads(path.read_text())
        s = s.get("slide", s)
        step = s["measured_against_predicted"]["step"]
        terms = s.get("measured_against_planned_terms", {})
        def term(name):
            t = terms.get(name)
            return f"{t['measured']:.3f} / {t['planned']:.3f} (x{t['ratio']:.2f})" if t and t.get("ratio") else ""
        print(f"| {first.stem} | {run} | {step['measured_s']:.3f} / {step['predicted_s']:.3f} (x{step['ratio']}) "
              f"| {s['host_peak_rss_gib']} / {s['planned_host_peak_gib']} | {s['gpu_peak_gib']} / {s['planned_gpu_peak_gib']} "
              f"| {term('gpu_compute_s')} | {term('host_update_busy_s')} |")
PY
