"""What a traced step stood still for: each wait of the main thread for a unit's parameters longer than
``--min-ms``, with the work that ran on the host optimizer and on the copy streams during it.

    python -m slide_hf bench ... --trace OUT/trace
    python bench/trace_waits.py OUT/trace/trace.json [--min-ms 20]

Reads the Chrome trace `slide bench --trace` writes (tracks: GPU compute, h2d, d2h, CPU update, main
thread waits; milliseconds from the first traced step's start). Prints, per long wait, the spans of the
other tracks that overlap it, merged per unit and phase: which updates the host optimizer worked on while
the step waited, when the waited unit's own gradient, update and load ran before it, and what else the
host optimizer updated from the start of the waited unit's update on. Why: a step longer than its
busiest resource is a wait somewhere, and the order of the work inside that wait says whose it is.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def long_waits(events: list[dict[str, Any]], min_ms: float, before_ms: float = 1000.0) -> list[str]:
    """The report's lines for the trace ``events`` (Chrome's ``traceEvents``): per wait of ``min_ms`` or
    more, the spans of the other tracks that overlap it, and the waited unit's own spans (its gradient, its
    update, its load) that ended up to ``before_ms`` before the wait did."""
    tracks = {event["tid"]: event["args"]["name"] for event in events if event.get("ph") == "M"}
    spans = [
        (tracks.get(event["tid"], str(event["tid"])), event["name"], event.get("cat", ""),
         event["ts"] / 1e3, (event["ts"] + event["dur"]) / 1e3)
        for event in events if event.get("ph") == "X"
    ]  # fmt: skip
    lines = []
    for track, unit, _, start, end in sorted(spans, key=lambda span: span[3]):
        if track != "main thread waits" or end - start < min_ms:
            continue
        lines.append(f"wait for {unit}: {end - start:.1f} ms, from {start:.1f} to {end:.1f} ms")
        own = [
            s for s in spans if s[1] == unit and s[0] != "main thread waits" and end - before_ms <= s[4] and s[3] < end
        ]
        updates_from = min((s[3] for s in own if s[0] == "CPU update"), default=start)
        during: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [float("inf"), 0.0, 0.0, 0.0])
        for other_track, other_unit, phase, lo, hi in spans:
            if other_track == "main thread waits" or lo >= end:
                continue
            overlaps = hi > start
            leads_up = other_unit == unit and hi >= end - before_ms
            # the host optimizer's other work while the waited unit's update was under way
            shares_the_optimizer = other_track == "CPU update" and hi > updates_from
            if not (overlaps or leads_up or shares_the_optimizer):
                continue
            merged = during[(other_track, other_unit, phase)]
            merged[0], merged[1] = min(merged[0], lo), max(merged[1], hi)
            merged[2] += max(0.0, min(hi, end) - max(lo, start))
            merged[3] += hi - lo
        for (other_track, other_unit, phase), (lo, hi, inside, busy) in sorted(during.items(), key=lambda x: x[1][0]):
            mark = " <- the waited unit" if other_unit == unit else ""
            lines.append(
                f"  {other_track:<12} {phase:<10} {other_unit:<12} {lo:9.1f} .. {hi:9.1f} ms, busy {busy:.1f} ms"
                f" ({inside:.1f} ms inside the wait){mark}"
            )
    return lines or [f"no wait of {min_ms} ms or more"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="trace.json from slide bench --trace")
    parser.add_argument("--min-ms", type=float, default=20.0, help="the shortest wait reported (default 20)")
    parser.add_argument(
        "--before-ms", type=float, default=1000.0, help="how far back the waited unit's own spans are shown"
    )
    args = parser.parse_args()
    try:
        events = json.loads(args.trace.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"trace_waits: {args.trace} is not a trace slide bench --trace wrote ({error!r})") from None
    print("\n".join(long_waits(events, args.min_ms, args.before_ms)))


if __name__ == "__main__":
    main()
