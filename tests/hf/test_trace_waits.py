"""bench/trace_waits.py: what a traced step stood still for, from `slide bench --trace`'s Chrome trace."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "trace_waits.py"
TRACKS = ["GPU compute", "h2d", "d2h", "CPU update", "main thread waits"]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("trace_waits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(*spans: tuple[str, str, str, float, float]) -> list[dict[str, Any]]:
    """Chrome events as `slide bench --trace` writes them: (track, unit, phase, start ms, duration ms)."""
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": t}} for i, t in enumerate(TRACKS)]
    return meta + [
        {
            "name": unit,
            "cat": phase,
            "ph": "X",
            "ts": start * 1e3,
            "dur": ms * 1e3,
            "pid": 0,
            "tid": TRACKS.index(track),
        }
        for track, unit, phase, start, ms in spans
    ]


# A step boundary: the embedding's gradient lands at 100 ms; the host optimizer updates it in two chunks with
# block.9's update between them; the next step's first load waits for the embedding from 120 to 400 ms.
BOUNDARY = _trace(
    ("GPU compute", "embedding", "backward", 90.0, 5.0),
    ("d2h", "embedding", "d2h", 95.0, 5.0),
    ("CPU update", "block.9", "update", 60.0, 55.0),  # begun before the embedding's, still running at its start
    ("CPU update", "embedding", "update", 110.0, 100.0),
    ("CPU update", "block.8", "update", 210.0, 150.0),  # in the middle of the embedding's update
    ("CPU update", "embedding", "update", 360.0, 30.0),
    ("main thread waits", "embedding", "wait", 120.0, 280.0),
    ("h2d", "embedding", "h2d", 390.0, 10.0),
    ("GPU compute", "embedding", "forward", 400.0, 1.0),
    ("CPU update", "embedding", "update", 900.0, 50.0),  # the next step's: after the wait, not in it
    ("main thread waits", "block.0", "wait", 401.0, 2.0),  # under --min-ms
)


def test_a_long_wait_shows_the_waited_units_update_and_what_the_optimizer_did_beside_it() -> None:
    lines = _script().long_waits(BOUNDARY, min_ms=20.0)
    assert lines[0] == "wait for embedding: 280.0 ms, from 120.0 to 400.0 ms"
    body = "\n".join(lines[1:])
    assert len(lines) == 7, body  # one wait (block.0's 2 ms is under the limit), six rows
    own_update = next(line for line in lines if "CPU update" in line and "embedding" in line)
    assert "110.0 ..     390.0 ms, busy 130.0 ms (120.0 ms inside the wait) <- the waited unit" in own_update
    block8 = next(line for line in lines if "block.8" in line)
    assert "210.0 ..     360.0 ms, busy 150.0 ms (150.0 ms inside the wait)" in block8 and "waited" not in block8
    assert any("block.9" in line for line in lines)  # the optimizer's work when the embedding's began
    assert any("backward" in line and "embedding" in line for line in lines)  # its gradient, before the wait
    assert "900.0" not in body  # the next step's update is not this wait's


def test_no_long_wait_is_one_line_and_the_command_line_reads_a_file(tmp_path) -> None:
    assert _script().long_waits(BOUNDARY, min_ms=1000.0) == ["no wait of 1000.0 ms or more"]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": BOUNDARY}))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--min-ms", "20"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("wait for embedding: 280.0 ms")


def test_a_truncated_trace_is_one_line(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": BOUNDARY})[:100])
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "is not a trace" in done.stderr
