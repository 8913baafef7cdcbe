"""Note [Waits on one rank's work] (slide_core/distributed.py) in two real gloo processes: a rank may be far
behind at a ``slow`` barrier (rank 0 preparing data, ranks writing checkpoint shards) without failing the
run, while an ordinary collective still gives up after ``timeout_s`` with one line naming it.

This file is also the rank's program: ``python test_phase_barrier.py OUT`` with torchrun's variables set.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from slide_core.distributed import CollectiveError, ProcessGroupContext
from slide_core.testing import launch_ranks, wait_ranks

TIMEOUT_S = 2.0
BEHIND_S = 5.0  # how far rank 0 lags: more than TIMEOUT_S, far less than the phase timeout


def _rank_main(out: Path) -> None:
    group = ProcessGroupContext.from_env("cpu", timeout_s=TIMEOUT_S, phase_timeout_s=60.0)
    report: dict[str, object] = {}
    with group:
        if group.rank == 0:
            time.sleep(BEHIND_S)
        began = time.monotonic()
        group.barrier("the wait for rank 0 to prepare the data", slow=True)
        report["slow_waited_s"] = time.monotonic() - began
        if group.rank == 0:
            time.sleep(BEHIND_S)
        try:
            group.barrier("an ordinary wait")
            report["fast"] = "passed"
        except CollectiveError as error:
            report["fast"] = str(error)
    (out / f"rank{group.rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_a_slow_barrier_outwaits_the_collective_timeout(tmp_path: Path) -> None:
    procs = launch_ranks([sys.executable, __file__, str(tmp_path)], 2)
    wait_ranks(procs, 120.0)
    behind = json.loads((tmp_path / "rank1.json").read_text())
    assert behind["slow_waited_s"] >= BEHIND_S - 1.0  # it waited for rank 0, past TIMEOUT_S, and went on
    assert str(behind["fast"]).startswith("rank 1 of 2: an ordinary wait failed")
    assert str(behind["fast"]).endswith(f"did not answer within {TIMEOUT_S:.0f} s")


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
