#!/usr/bin/env bash
# What a resumable checkpoint costs a run: the same `slide train` twice, checkpointing in the foreground and
# with --save-async (written from a host snapshot while training goes on), on one GPU machine.
#   bench/checkpoint_cost.sh OUT_DIR [MODEL] [GPU_MEMORY]
# Each run trains 9 steps and saves at steps 3 and 6 (and the final 9), keeping one checkpoint and deleting the
# old one first, so the disk holds one checkpoint at a time. Prints each run's wall time, its step times and
# the seconds each save held the loop (from train.log), and writes OUT_DIR/checkpoint_cost.json.
set -uo pipefail
out=${1:?usage: bench/checkpoint_cost.sh OUT_DIR [MODEL] [GPU_MEMORY]}
model=${2:-llama3.2-3b}
gpu=${3:-12}
scratch=${SCRATCH:-/tmp/slide-checkpoint-cost}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for mode in foreground async; do
  rm -rf "$scratch"
  extra=()
  [ "$mode" = async ] && extra=(--save-async)
  began=$(date +%s.%N)
  timeout 900 python3 -m slide_hf train --model "$model" --gpu-memory "$gpu" --seq-len 1024 --batch-size 8 \
    --steps 9 --save-every 3 --keep-checkpoints 1 --save-delete-first --output "$scratch" "${extra[@]}" \
    > "$out/$mode.log" 2>&1
  rc=$?
  ended=$(date +%s.%N)
  cp "$scratch/metrics.jsonl" "$out/$mode.metrics.jsonl" 2>/dev/null
  python3 - "$mode" "$rc" "$began" "$ended" "$out" "$scratch" <<'PY'
import json, pathlib, re, sys
mode, rc, began, ended, out, scratch = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), pathlib.Path(sys.argv[5]), pathlib.Path(sys.argv[6])
metrics = out / f"{mode}.metrics.jsonl"
steps = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.exists() else []
times = [round(r["step_time_s"], 3) for r in steps if "step_time_s" in r]
log = (out / f"{mode}.log").read_text()
saves = re.findall(r"checkpoint written to \S+", log)
row = {"mode": mode, "rc": rc, "wall_s": round(ended - began, 1), "step_times_s": times, "checkpoints_written": len(saves),
       "measured_against_planned": [l for l in log.splitlines() if "measured against planned" in l][-1:]}
print(json.dumps(row))
with open(out / "checkpoint_cost.json", "a") as f:
    f.write(json.dumps(row) + "\n")
PY
  tail -3 "$out/$mode.log"
done
df -h "$(dirname "$scratch")" | tail -1
