#!/usr/bin/env bash
# What a resumable checkpoint costs a run: the same `slide train` twice, checkpointing in the foreground and
# with --save-async (written from a host copy while training goes on).
#   bench/checkpoint_cost.sh OUT_DIR [MODEL] [GPU_MEMORY] [-- MORE TRAIN ARGS]
#   e.g. bench/checkpoint_cost.sh OUT llama3.2-3b 12                       # a GPU machine
#        bench/checkpoint_cost.sh OUT /tmp/mid-llama - -- --device cpu --seq-len 128 --batch-size 2
#        (the CPU: a model directory from bench/cpu_model.py; GPU_MEMORY "-" passes no --gpu-memory)
# Each run trains 9 steps and saves at steps 3 and 6 (and the final 9), keeping one checkpoint and deleting the
# old one first, so the disk holds one checkpoint at a time. Prints and writes to OUT_DIR/checkpoint_cost.json
# each run's wall time, step times, how long each save held training up (the run's "training paused" lines,
# with the part spent waiting for the previous background write) and the pause `slide plan` prices for it
# (the run's "each checkpoint save pauses training" line, slide_hf/planner/save_cost.py).
set -uo pipefail
out=${1:?usage: bench/checkpoint_cost.sh OUT_DIR [MODEL] [GPU_MEMORY] [-- MORE TRAIN ARGS]}
shift
model=llama3.2-3b gpu=12
if [ $# -gt 0 ] && [ "$1" != "--" ]; then model=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then gpu=$1; shift; fi
[ "${1:-}" = "--" ] && shift
more=("$@")
budget=()
[ "$gpu" != "-" ] && budget=(--gpu-memory "$gpu")
scratch=${SCRATCH:-/tmp/slide-checkpoint-cost}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for mode in foreground async; do
  rm -rf "$scratch"
  extra=()
  [ "$mode" = async ] && extra=(--save-async)
  began=$(date +%s.%N)
  timeout 900 "$python" -m slide_hf train --model "$model" "${budget[@]}" --seq-len 1024 --batch-size 8 \
    --steps 9 --save-every 3 --keep-checkpoints 1 --save-delete-first --output "$scratch" "${extra[@]}" "${more[@]}" \
    > "$out/$mode.log" 2>&1
  rc=$?
  ended=$(date +%s.%N)
  cp "$scratch/metrics.jsonl" "$out/$mode.metrics.jsonl" 2>/dev/null
  "$python" - "$mode" "$rc" "$began" "$ended" "$out" <<'PY'
import json, pathlib, re, sys
mode, rc, began, ended, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), pathlib.Path(sys.argv[5])
metrics = out / f"{mode}.metrics.jsonl"
steps = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.exists() else []
times = [round(r["step_time_s"], 3) for r in steps if "step_time_s" in r]
log = (out / f"{mode}.log").read_text()
pauses = [
    {"step": int(m[0]), "paused_s": float(m[1]), "waited_s": float(m[2] or 0)}
    for m in re.findall(r"checkpoint of step (\d+) .*?training paused ([\d.e+-]+) s(?: \(([\d.e+-]+) s of it)?", log)
]
planned = re.search(r"each checkpoint save pauses training ([\d.e+-]+) s", log)
row = {"mode": mode, "rc": rc, "wall_s": round(ended - began, 1), "step_times_s": times,
       "checkpoints_written": len(re.findall(r"checkpoint written to \S+", log)), "pauses": pauses,
       "planned_pause_s": float(planned[1]) if planned else None,
       "measured_against_planned": [l for l in log.splitlines() if "measured against planned" in l][-1:]}
print(json.dumps(row))
with open(out / "checkpoint_cost.json", "a") as f:
    f.write(json.dumps(row) + "\n")
PY
  tail -3 "$out/$mode.log"
done
df -h "$(dirname "$scratch")" | tail -1
