"""bench/io_bench.py: the sweep's arguments, and the keys of its JSON report on a tiny run."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(60)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "io_bench.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """bench/io_bench.py as a module, loaded from its path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("slide_bench_io", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_sweep_arguments(bench: ModuleType, tmp_path: Path) -> None:
    args = bench.parse_args(["--dir", str(tmp_path), "--sweep"])
    assert (args.sweep_threads, args.sweep_chunk_mb, args.repeat) == ([2, 4, 8, 16], [4, 8, 16, 32], 1)
    assert args.dd_block_mb == [16] and args.tiers == ["nvme", "pinned", "gds"]
    sweep = ["--sweep", "--sweep-threads", "2,4,8", "--sweep-chunk-mb", "8,16"]
    args = bench.parse_args(
        ["--dir", str(tmp_path), *sweep, "--dd-block-mb", "4,16,64", "--repeat", "2", "--tiers", "nvme"]
    )
    assert (args.sweep_threads, args.sweep_chunk_mb, args.dd_block_mb) == ([2, 4, 8], [8, 16], [4, 16, 64])
    assert (args.repeat, args.tiers) == (2, ["nvme"])
    plain = bench.parse_args(["--dir", str(tmp_path)])
    assert plain.repeat == 2 and not plain.sweep and plain.io_threads == bench.DEFAULT_IO_THREADS


@pytest.mark.parametrize(
    "bad",
    [
        ["--sweep", "--sweep-threads", "2,x"],
        ["--sweep", "--sweep-chunk-mb", "0,8"],
        ["--sweep", "--sweep-threads", ""],
        ["--sweep-threads", "2,4"],  # without --sweep
        ["--tiers", "nvme,tape"],
        ["--dd-block-mb", "-1"],
    ],
)
def test_bad_arguments_are_usage_errors(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--dir", str(tmp_path), *bad])
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


def test_tiny_sweep_report(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work_dir, report_path = tmp_path / "device", tmp_path / "sweep.json"
    work_dir.mkdir()
    argv = ["--dir", str(work_dir), "--size-gb", "0.01", "--tiers", "nvme", "--json", str(report_path)]
    argv += ["--sweep", "--sweep-threads", "1,2", "--sweep-chunk-mb", "1,2"]
    assert bench.main(argv) == 0
    assert list(work_dir.iterdir()) == []  # dd's file and the tiers' directories are gone
    report = json.loads(report_path.read_text())
    assert {"dd", "sweeps", "tiers", "size_bytes", "repeat", "elapsed_s"} <= set(report)
    assert report["repeat"] == 1 and report["tiers"] == []
    dd = report["dd"]
    assert dd["read_gbps"] > 0 and [run["block_mb"] for run in dd["runs"]] == [16]
    read_command = dd["runs"][0]["commands"][1]
    assert read_command.startswith("dd if=") and ("iflag=direct" in read_command) == dd["direct"]
    (sweep,) = report["sweeps"]
    assert (sweep["tier"], sweep["threads"], sweep["chunk_mb"]) == ("nvme", [1, 2], [1, 2])
    rows = sweep["rows"]
    assert [(row["io_threads"], row["chunk_mb"]) for row in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    keys = {"put_gbps", "get_gbps", "get_unaligned_gbps", "put_pct_dd", "get_pct_dd", "get_unaligned_pct_dd"}
    assert all(keys <= set(row) and row["verified"] for row in rows)
    assert sweep["best_get"] in rows and sweep["best_get"]["get_gbps"] == max(row["get_gbps"] for row in rows)
    assert sweep["best_put"] in rows and sweep["best_put"]["put_gbps"] == max(row["put_gbps"] for row in rows)
    again = [(row["label"], row["io_threads"], row["chunk_mb"]) for row in sweep["confirm"]]
    best = (sweep["best_get"]["io_threads"], sweep["best_get"]["chunk_mb"])
    assert again == [("best get", *best), ("default", bench.DEFAULT_IO_THREADS, bench.DEFAULT_CHUNK_BYTES >> 20)]
    printed = capsys.readouterr().out
    assert "| io threads | chunk MiB |" in printed and "best get" in printed and "best put" in printed
    assert read_command in printed and "DEFAULT_IO_THREADS =" in printed
