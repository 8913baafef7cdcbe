"""Where a `slide bench` step spends its time on each CUDA stream: one run under torch.profiler (GPU activity
only), then each stream's busy stretches in the last step, merged where the gaps are shorter than
``--gap-ms``, with the bytes and rate of every copy inside them.

    python bench/stream_trace.py --out DIR -- --model llama3.1-8b --layers 8 --gpu-memory 24 \\
        --update-placement gpu --master split --optimizer-state bf16 --steps 3 --warmup 1

Everything after ``--`` is `slide bench`'s arguments. Writes DIR/streams.txt (also printed) and keeps the
Chrome trace in DIR/trace.json only with ``--keep-trace`` (it is large). Why: the engine's own timeline
records the weight loads and the updates but not a streamed unit's master and state uploads and
write-backs, which are what a GPU-streamed step waits on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _stretches(events: list[dict[str, Any]], gap_us: float) -> list[dict[str, Any]]:
    """Merge one stream's events (sorted by start) into busy stretches."""
    out: list[dict[str, Any]] = []
    for event in events:
        start, end = event["ts"], event["ts"] + event["dur"]
        kind = "copy" if "memcpy" in event.get("cat", "").lower() or "Memcpy" in event["name"] else "kernel"
        nbytes = int(event.get("args", {}).get("bytes", 0) or 0)
        if out and start - out[-1]["end"] <= gap_us:
            stretch = out[-1]
            stretch["end"] = max(stretch["end"], end)
        else:
            stretch = {"start": start, "end": end, "kernels": 0, "copies": 0, "bytes": 0, "copy_us": 0.0, "names": {}}
            out.append(stretch)
        if kind == "copy":
            stretch["copies"] += 1
            stretch["bytes"] += nbytes
            stretch["copy_us"] += event["dur"]
        else:
            stretch["kernels"] += 1
            short = event["name"][:40]
            stretch["names"][short] = stretch["names"].get(short, 0.0) + event["dur"]
    return out


def summarize(trace: dict[str, Any], gap_ms: float, window_ms: float) -> str:
    gpu = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat", "").lower() in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not gpu:
        return "no GPU events recorded"
    end = max(e["ts"] + e["dur"] for e in gpu)
    begin = end - window_ms * 1000
    streams: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in gpu:
        if e["ts"] >= begin:
            streams[str(e.get("args", {}).get("stream", e.get("tid")))].append(e)
    lines = [f"window: the last {window_ms:.0f} ms of GPU activity; stretches merged across gaps < {gap_ms} ms"]
    for stream, events in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        events.sort(key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in events) / 1000
        nbytes = sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in events)
        lines.append(f"\n== stream {stream}: {len(events)} events, busy {busy:.1f} ms, {nbytes / 1e9:.2f} GB copied")
        for s in _stretches(events, gap_ms * 1000):
            rate = f" {s['bytes'] / max(s['copy_us'], 1e-9) / 1e3:.1f} GB/s" if s["copies"] else ""
            top = sorted(s["names"].items(), key=lambda kv: -kv[1])[:2]
            names = ", ".join(f"{n} {t / 1000:.1f}" for n, t in top)
            lines.append(
                f"  {(s['start'] - begin) / 1000:8.1f} +{(s['end'] - s['start']) / 1000:6.1f} ms"
                f"  kernels {s['kernels']:4d} copies {s['copies']:3d} {s['bytes'] / 1e6:8.1f} MB{rate}  {names}"
            )
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gap-ms", type=float, default=0.5)
    parser.add_argument("--window-ms", type=float, default=1500.0, help="how much of the run's end to show")
    parser.add_argument("--keep-trace", action="store_true")
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1 :]

    import torch
    from torch.profiler import ProfilerActivity, profile

    from slide_hf.cli.main import main as slide

    args.out.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rc = slide(["bench", *bench_args])
    torch.cuda.synchronize()
    path = args.out / "trace.json"
    prof.export_chrome_trace(str(path))
    text = summarize(json.loads(path.read_text()), args.gap_ms, args.window_ms)
    if not args.keep_trace:
        path.unlink()
    (args.out / "streams.txt").write_text(text + "\n")
    print(text)
    sys.exit(rc)


if __name__ == "__main__":
    main()
