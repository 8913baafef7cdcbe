"""Storage tier throughput against a ``dd`` direct-I/O baseline, and a sweep of the NVMe tier's settings.

Usage::

    python bench/io_bench.py --dir /mnt/nvme --size-gb 4 --json io.json
    python bench/io_bench.py --dir /mnt/nvme --size-gb 1 --sweep --json sweep.json
    python bench/io_bench.py --dir /mnt/nvme --size-gb 1 --sweep --sweep-threads 2,4,8 --sweep-chunk-mb 8,16

First ``dd`` writes ``--size-gb`` of zeros to a file in ``--dir`` with ``oflag=direct`` and reads it back
with ``iflag=direct``, once per ``--dd-block-mb`` block size (a comma list; the best write and the best
read are the baseline): that is what the device gives a single sequential stream. The dd commands are
printed. Then each tier stores a page-aligned buffer of random bytes (never zeros: some filesystems and
devices compress or skip them) split into ``--keys`` keys on 4 KiB boundaries, all in flight at once,
and reads it back twice: into a page-aligned buffer (the direct path of the NVMe tier) and into one
64 bytes past a page boundary, which is where ``torch.empty`` puts host tensors (the bounce path). The
data is checked after the timing. The table gives GB/s (10^9 bytes per second) and the percentage of the
dd figure.

``--sweep`` measures the ``nvme`` tier (and ``gds`` on a CUDA machine) for every io-threads x chunk-MiB
pair of ``--sweep-threads`` and ``--sweep-chunk-mb`` (default 2,4,8,16 x 4,8,16,32, one run each unless
``--repeat``) on the same data, marks the best get and the best put, measures the best get and the
current defaults once more (one run of a pair on a shared virtual disk can be 15% off), and prints the
constants to set in ``slide_io/tiers/posix_nvme.py``. For ``gds`` with kvikio, io-threads sizes kvikio's
thread pool, which moves CUDA tensors. On a 1.5 GB/s virtio disk 16 pairs of 1 GiB took about 50 s for
``nvme`` and 35 s more for ``gds``; ``--tiers nvme`` leaves gds out.

Caveats printed with the table: when the filesystem refuses O_DIRECT, dd and the tiers fall back to
buffered I/O and read back from the page cache, which measures memory, not the device. The ``pinned``
tier is a memory copy; its row is there to show the ceiling, not to compare with dd.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from slide_core import Tier
from slide_io import GdsTier, PinnedRamTier, PosixNvmeTier, gds_status
from slide_io._bytes import DIRECT_ALIGN, aligned_empty, round_up
from slide_io._kvikio import load_kvikio
from slide_io.tiers.posix_nvme import DEFAULT_CHUNK_BYTES, DEFAULT_IO_THREADS

GB = 10**9
MiB = 1 << 20
GDS_TIERS = ("gds", "gds-kvikio")
UNALIGNED_OFFSET = 64  # bytes past a page boundary: where torch.empty puts large host tensors
SWEEP_THREADS = (2, 4, 8, 16)
SWEEP_CHUNK_MB = (4, 8, 16, 32)
_DD_RESULT = re.compile(r"^(\d+) bytes.*copied, ([0-9.]+) s", re.MULTILINE)


@dataclass
class DdRun:
    block_mb: int
    write_gbps: float | None
    read_gbps: float | None
    direct: bool
    commands: list[str]


@dataclass
class DdResult:
    write_gbps: float | None
    read_gbps: float | None
    direct: bool
    note: str = ""
    runs: list[DdRun] = field(default_factory=list)


@dataclass
class TierResult:
    tier: str
    mode: str
    put_gbps: float | None
    get_gbps: float | None
    verified: bool
    note: str = ""
    get_unaligned_gbps: float | None = None
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class SweepRow:
    io_threads: int
    chunk_mb: int
    put_gbps: float
    get_gbps: float
    get_unaligned_gbps: float | None
    put_pct_dd: float | None
    get_pct_dd: float | None
    get_unaligned_pct_dd: float | None
    verified: bool
    label: str = ""  # in ``Sweep.confirm``: why the pair was measured again


@dataclass
class Sweep:
    tier: str
    mode: str
    direct_io: bool
    threads: list[int]
    chunk_mb: list[int]
    rows: list[SweepRow]
    best_get: SweepRow | None
    best_put: SweepRow | None
    confirm: list[SweepRow]
    note: str = ""


# -- dd -------------------------------------------------------------------------------------------------------


def _dd(args: list[str]) -> tuple[int, float]:
    """Run dd and return (bytes, seconds) from its summary line."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "dd failed")
    match = _DD_RESULT.search(done.stderr)
    if match is None:
        raise RuntimeError(f"cannot parse dd output: {done.stderr!r}")
    return int(match.group(1)), float(match.group(2))


def dd_run(directory: Path, size_bytes: int, block_mb: int) -> DdRun:
    """Write then read ``size_bytes`` (rounded up to whole blocks) with dd, direct I/O when possible."""
    count = max(1, -(-size_bytes // (block_mb * MiB)))
    target = directory / f"slide-bench-dd-{uuid.uuid4().hex}"
    write = ["if=/dev/zero", f"of={target}", f"bs={block_mb}M", f"count={count}"]
    try:
        direct = True
        try:
            written, seconds = _dd([*write, "oflag=direct"])
        except RuntimeError:
            direct = False  # e.g. a filesystem without O_DIRECT: flush explicitly so the write is real
            written, seconds = _dd([*write, "conv=fsync"])
        read = [f"if={target}", "of=/dev/null", f"bs={block_mb}M", *(["iflag=direct"] if direct else [])]
        got, read_seconds = _dd(read)
    finally:
        target.unlink(missing_ok=True)
    commands = [shlex.join(["dd", *write, "oflag=direct" if direct else "conv=fsync"]), shlex.join(["dd", *read])]
    return DdRun(block_mb, written / max(seconds, 1e-9) / GB, got / max(read_seconds, 1e-9) / GB, direct, commands)


def dd_baseline(directory: Path, size_bytes: int, block_mbs: list[int]) -> DdResult:
    """One dd run per block size; the best write and the best read are the baseline."""
    runs: list[DdRun] = []
    for block_mb in block_mbs:
        try:
            runs.append(dd_run(directory, size_bytes, block_mb))
        except (OSError, RuntimeError) as error:
            return DdResult(None, None, False, note=f"dd failed: {error}", runs=runs)
    direct = all(run.direct for run in runs)
    note = "" if direct else "no O_DIRECT: buffered dd, reads come from the page cache"
    write = max((run.write_gbps for run in runs if run.write_gbps is not None), default=None)
    read = max((run.read_gbps for run in runs if run.read_gbps is not None), default=None)
    return DdResult(write, read, direct, note, runs)


# -- tiers ----------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The same bytes for every tier and sweep row: a page-aligned source split into keys on 4 KiB
    boundaries, and destinations on a page boundary and ``UNALIGNED_OFFSET`` bytes past one."""

    source: torch.Tensor
    piece_bytes: int
    destinations: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.source.numel()


def make_workload(size_bytes: int, keys: int, seed: int, device: str = "cpu", unaligned: bool = True) -> Workload:
    generator = torch.Generator().manual_seed(seed)
    source = aligned_empty(size_bytes).random_(0, 256, generator=generator)
    piece_bytes = round_up(-(-size_bytes // max(1, keys)), DIRECT_ALIGN)
    if device != "cpu":
        source = source.to(device)
        return Workload(source, piece_bytes, {"aligned": torch.empty_like(source)})
    landing = aligned_empty(size_bytes + UNALIGNED_OFFSET)  # one buffer, two views: no second GiB
    destinations = {"aligned": landing[:size_bytes]}
    if unaligned:
        destinations["unaligned"] = landing[UNALIGNED_OFFSET : UNALIGNED_OFFSET + size_bytes]
    return Workload(source, piece_bytes, destinations)


def _time_requests(issue: Callable[[], list]) -> float:
    start = time.perf_counter()
    for future in issue():
        future.result()  # note: blocks until this request's I/O is done
    return time.perf_counter() - start


def bench_tier(name: str, tier: Tier, work: Workload, repeat: int) -> TierResult:
    """Put the workload's keys, all in flight, then get them back into each destination; best of ``repeat``.

    Destinations are zeroed before each get, which also pays their page faults before the clock starts.
    """
    pieces = list(work.source.split(work.piece_bytes))
    put_s = float("inf")
    get_s = dict.fromkeys(work.destinations, float("inf"))
    verified = True
    with tier:
        for _ in range(repeat):
            put_s = min(put_s, _time_requests(lambda: [tier.put(f"k{i}", p) for i, p in enumerate(pieces)]))
            for label, out in work.destinations.items():
                out.fill_(0)  # a stale right answer must not pass the check
                outs = list(out.split(work.piece_bytes))
                seconds = _time_requests(lambda outs=outs: [tier.get(f"k{i}", d) for i, d in enumerate(outs)])
                get_s[label] = min(get_s[label], seconds)
                verified = verified and bool(torch.equal(out, work.source))
        extra: dict[str, object] = {"put_s": put_s, **{f"get_{label}_s": s for label, s in get_s.items()}}
        if isinstance(tier, PosixNvmeTier):
            extra["direct_io"] = tier.direct_io
            extra["io_threads"] = tier.io_threads
            extra["chunk_bytes"] = tier.chunk_bytes
    mode = getattr(tier, "mode", "direct" if extra.get("direct_io") else "buffered")
    if name == "pinned":
        mode = "memcpy"
    unaligned = get_s.get("unaligned")
    return TierResult(
        name,
        str(mode),
        work.nbytes / put_s / GB,
        work.nbytes / get_s["aligned"] / GB,
        verified,
        get_unaligned_gbps=work.nbytes / unaligned / GB if unaligned is not None else None,
        extra=extra,
    )


def _kvikio_threads(count: int | None = None) -> int | None:
    """Resize kvikio's process-wide thread pool to ``count`` (if given); its size, or None without kvikio.

    GdsTier moves CUDA tensors on this pool, so it is what io-threads means for gds. Handles the
    ``defaults.set``/``get`` API (kvikio 25.04+) and the older ``num_threads_reset``/``get_num_threads``.
    """
    kvikio, _ = load_kvikio()
    if kvikio is None:
        return None
    defaults = importlib.import_module("kvikio.defaults")  # a submodule: `import kvikio` does not load it
    if callable(getattr(defaults, "set", None)) and callable(getattr(defaults, "get", None)):
        if count is not None:
            defaults.set("num_threads", count)
        return int(defaults.get("num_threads"))
    if count is not None:
        defaults.num_threads_reset(count)
    return int(defaults.get_num_threads())


def make_tier(name: str, directory: Path, io_threads: int, chunk_bytes: int) -> PosixNvmeTier:
    if name in GDS_TIERS:  # gds-kvikio: kvikio moves the bytes even in compat mode (Note [Compat mode ...])
        return GdsTier(directory, io_threads=io_threads, chunk_bytes=chunk_bytes, kvikio_in_compat=name != "gds")
    return PosixNvmeTier(directory, io_threads=io_threads, chunk_bytes=chunk_bytes)


def measure_row(
    name: str, directory: Path, work: Workload, io_threads: int, chunk_mb: int, repeat: int, dd: DdResult
) -> tuple[SweepRow, TierResult]:
    tier = make_tier(name, directory, io_threads, chunk_mb * MiB)
    if name in GDS_TIERS and getattr(tier, "mode", "") != "posix-fallback":
        _kvikio_threads(io_threads)
    result = bench_tier(name, tier, work, repeat)
    assert result.put_gbps is not None and result.get_gbps is not None
    row = SweepRow(
        io_threads,
        chunk_mb,
        result.put_gbps,
        result.get_gbps,
        result.get_unaligned_gbps,
        _ratio(result.put_gbps, dd.write_gbps),
        _ratio(result.get_gbps, dd.read_gbps),
        _ratio(result.get_unaligned_gbps, dd.read_gbps),
        result.verified,
    )
    return row, result


def run_sweep(
    name: str,
    directory: Path,
    work: Workload,
    threads: list[int],
    chunk_mbs: list[int],
    repeat: int,
    dd: DdResult,
) -> Sweep:
    """Every io-threads x chunk-MiB pair, then the best get and the current defaults once more.

    The second look is the noise check: on a shared virtual disk one run of a pair can be 15% off.
    """
    rows: list[SweepRow] = []
    mode, direct_io = "-", False
    gds_logger = logging.getLogger("slide_io.tiers.gds")
    level = gds_logger.level
    try:
        for io_threads in threads:
            for chunk_mb in chunk_mbs:
                row, result = measure_row(name, directory, work, io_threads, chunk_mb, repeat, dd)
                gds_logger.setLevel(logging.ERROR)  # the fallback warning once per sweep, not once per row
                mode, direct_io = result.mode, bool(result.extra.get("direct_io"))
                rows.append(row)
                print(f"  {name} io-threads {io_threads:>2} chunk {chunk_mb:>2} MiB: {_row_summary(row)}", flush=True)
        good = [row for row in rows if row.verified]
        best_get = max(good, key=lambda row: row.get_gbps, default=None)
        best_put = max(good, key=lambda row: row.put_gbps, default=None)
        confirm: list[SweepRow] = []
        targets = [("best get", best_get.io_threads, best_get.chunk_mb)] if best_get is not None else []
        targets.append(("default", DEFAULT_IO_THREADS, DEFAULT_CHUNK_BYTES // MiB))
        for label, io_threads, chunk_mb in targets:
            if any((row.io_threads, row.chunk_mb) == (io_threads, chunk_mb) for row in confirm):
                confirm[-1].label += f", {label}"
                continue
            row, _ = measure_row(name, directory, work, io_threads, chunk_mb, repeat, dd)
            row.label = label
            confirm.append(row)
            print(f"  {name} again, {label}: io-threads {io_threads} chunk {chunk_mb} MiB: {_row_summary(row)}")
    finally:
        gds_logger.setLevel(level)
    if name not in GDS_TIERS:
        note = ""
    elif mode == "posix-fallback":
        note = "no kvikio: CUDA tensors go through the POSIX path's host bounce buffers"
    elif name == "gds" and mode == "compat":
        note = (
            "compat mode: CUDA tensors take the POSIX path through pinned bounce buffers (use gds-kvikio for kvikio's)"
        )
    else:
        note = "io-threads sizes kvikio's thread pool, chunk MiB its task size"
    return Sweep(name, mode, direct_io, list(threads), list(chunk_mbs), rows, best_get, best_put, confirm, note)


# -- output ---------------------------------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> float | None:
    return 100 * value / base if value is not None and base else None


def _percent(value: float | None, base: float | None) -> str:
    ratio = _ratio(value, base)
    return f"{ratio:.0f}%" if ratio is not None else "-"


def _gbps(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _verdict(result: TierResult) -> str:
    if result.put_gbps is None:
        return "-"
    return "yes" if result.verified else "NO"


def _row_summary(row: SweepRow) -> str:
    unaligned = f", unaligned dst {_gbps(row.get_unaligned_gbps)}" if row.get_unaligned_gbps is not None else ""
    return f"put {_gbps(row.put_gbps)}, get {_gbps(row.get_gbps)}{unaligned} GB/s"


def render_dd(dd: DdResult) -> str:
    lines = [f"dd (block {run.block_mb} MiB): {command}" for run in dd.runs for command in run.commands]
    if len(dd.runs) > 1:
        lines += [
            f"dd {run.block_mb} MiB blocks: write {_gbps(run.write_gbps)} GB/s, read {_gbps(run.read_gbps)} GB/s"
            for run in dd.runs
        ]
        lines.append("the dd baseline is the best write and the best read over these block sizes")
    return "\n".join(lines)


def render(dd: DdResult, results: list[TierResult]) -> str:
    lines = [
        "| tier | mode | put GB/s | % dd write | get GB/s | % dd read | get GB/s, unaligned dst | % dd read | verified |",
        "|------|------|---------:|-----------:|---------:|----------:|------------------------:|----------:|:--------:|",
        f"| dd | {'direct' if dd.direct else 'buffered'} | {_gbps(dd.write_gbps)} | 100% | "
        f"{_gbps(dd.read_gbps)} | 100% | - | - | - |",
    ]
    for result in results:
        lines.append(
            f"| {result.tier} | {result.mode} | {_gbps(result.put_gbps)} | "
            f"{_percent(result.put_gbps, dd.write_gbps)} | {_gbps(result.get_gbps)} | "
            f"{_percent(result.get_gbps, dd.read_gbps)} | {_gbps(result.get_unaligned_gbps)} | "
            f"{_percent(result.get_unaligned_gbps, dd.read_gbps)} | {_verdict(result)} |"
        )
    notes = [f"dd: {dd.note}"] if dd.note else []
    notes += [f"{result.tier}: {result.note}" for result in results if result.note]
    notes += [
        f"{result.tier}: direct_io={result.extra['direct_io']} but dd direct={dd.direct}"
        for result in results
        if "direct_io" in result.extra and result.extra["direct_io"] != dd.direct
    ]
    return "\n".join(lines + [""] + [f"- {note}" for note in notes])


def _pct(value: float | None) -> str:
    return f"{value:.0f}%" if value is not None else "-"


def render_sweep(sweep: Sweep) -> str:
    lines = [
        f"{sweep.tier} sweep ({sweep.mode}{'; ' + sweep.note if sweep.note else ''})",
        "",
        "| io threads | chunk MiB | put GB/s | % dd write | get GB/s | % dd read | get GB/s, unaligned dst "
        "| % dd read | verified | best |",
        "|-----------:|----------:|---------:|-----------:|---------:|----------:|------------------------:"
        "|----------:|:--------:|------|",
    ]
    for row in sweep.rows:
        marks = [word for word, best in (("get", sweep.best_get), ("put", sweep.best_put)) if best is row]
        lines.append(
            f"| {row.io_threads} | {row.chunk_mb} | {_gbps(row.put_gbps)} | {_pct(row.put_pct_dd)} | "
            f"{_gbps(row.get_gbps)} | {_pct(row.get_pct_dd)} | {_gbps(row.get_unaligned_gbps)} | "
            f"{_pct(row.get_unaligned_pct_dd)} | {'yes' if row.verified else 'NO'} | "
            f"{' + '.join('best ' + mark for mark in marks)} |"
        )
    lines.append("")
    for label, best in (("get", sweep.best_get), ("put", sweep.best_put)):
        if best is not None:
            lines.append(
                f"- best {label}: io-threads {best.io_threads}, chunk {best.chunk_mb} MiB "
                f"(put {_gbps(best.put_gbps)}, get {_gbps(best.get_gbps)} GB/s)"
            )
    for row in sweep.confirm:
        lines.append(
            f"- again after the grid ({row.label}): io-threads {row.io_threads}, chunk {row.chunk_mb} MiB: "
            f"put {_gbps(row.put_gbps)}, get {_gbps(row.get_gbps)} GB/s ({_pct(row.get_pct_dd)} of dd read)"
        )
    if sweep.best_get is not None and sweep.tier == "nvme":
        lines.append(
            f"- to adopt the best get, set DEFAULT_IO_THREADS = {sweep.best_get.io_threads} and "
            f"DEFAULT_CHUNK_BYTES = {sweep.best_get.chunk_mb} << 20 in "
            "packages/slide-io/src/slide_io/tiers/posix_nvme.py"
        )
    if not sweep.direct_io and sweep.tier == "nvme":
        lines.append("- the tier ran without O_DIRECT here: reads come from the page cache")
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------------------


def _positive_ints(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]``; for argparse ``type=``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python bench/io_bench.py --dir /mnt/nvme --size-gb 1 --sweep --json sweep.json",
    )
    parser.add_argument("--dir", type=Path, required=True, help="directory on the device to measure")
    parser.add_argument("--size-gb", type=float, default=1.0, help="bytes moved per test, in GiB")
    parser.add_argument(
        "--tiers",
        default="nvme,pinned,gds",
        help="comma-separated: nvme, pinned, gds, gds-kvikio (kvikio's own path even in compat mode)",
    )
    parser.add_argument("--keys", type=int, default=4, help="split the buffer into this many keys in flight")
    parser.add_argument("--io-threads", type=int, default=DEFAULT_IO_THREADS)
    parser.add_argument("--chunk-mb", type=int, default=DEFAULT_CHUNK_BYTES // MiB)
    parser.add_argument(
        "--dd-block-mb",
        type=_positive_ints,
        default=[16],
        help="dd block size in MiB, or a comma list to sweep (the best write and read are the baseline)",
    )
    parser.add_argument("--repeat", type=int, help="runs per tier, the best is reported (default 2; 1 in a sweep)")
    parser.add_argument(
        "--unaligned-get",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also time gets into a host buffer {UNALIGNED_OFFSET} bytes past a page boundary",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    sweep = parser.add_argument_group("sweep", "io-threads x chunk-MiB for the nvme (and gds) tier")
    sweep.add_argument("--sweep", action="store_true", help="sweep the settings instead of one row per tier")
    sweep.add_argument("--sweep-threads", type=_positive_ints, help="default: 2,4,8,16")
    sweep.add_argument("--sweep-chunk-mb", type=_positive_ints, help="default: 4,8,16,32")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.sweep and (args.sweep_threads or args.sweep_chunk_mb):
        parser.error("--sweep-threads and --sweep-chunk-mb need --sweep")
    if args.repeat is None:
        args.repeat = 1 if args.sweep else 2
    if args.repeat < 1 or args.keys < 1 or args.size_gb <= 0:
        parser.error("--repeat and --keys must be at least 1 and --size-gb above 0")
    args.sweep_threads = args.sweep_threads or list(SWEEP_THREADS)
    args.sweep_chunk_mb = args.sweep_chunk_mb or list(SWEEP_CHUNK_MB)
    args.tiers = [part.strip() for part in args.tiers.split(",") if part.strip()]
    unknown = [name for name in args.tiers if name not in ("nvme", "pinned", *GDS_TIERS)]
    if unknown:
        parser.error(f"unknown tier {unknown[0]!r}")
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    return args


def _tier_rows(args: argparse.Namespace, size_bytes: int) -> list[TierResult]:
    work = make_workload(size_bytes, args.keys, args.seed, unaligned=args.unaligned_get)
    chunk_bytes = args.chunk_mb * MiB
    results: list[TierResult] = []
    for name in args.tiers:
        if name == "nvme":
            tier = make_tier(name, args.dir, args.io_threads, chunk_bytes)
            results.append(bench_tier(name, tier, work, args.repeat))
        elif name == "pinned":
            alloc = (lambda n, dt: torch.empty(n, dtype=dt, pin_memory=True)) if torch.cuda.is_available() else None
            tier = PinnedRamTier(size_bytes + args.keys * 256, alloc=alloc)
            results.append(bench_tier(name, tier, work, args.repeat))
        elif not torch.cuda.is_available():
            results.append(TierResult(name, "-", None, None, False, note="skipped: no CUDA device"))
        else:
            device_work = make_workload(size_bytes, args.keys, args.seed, device="cuda")
            torch.cuda.synchronize()
            result = bench_tier(name, make_tier(name, args.dir, args.io_threads, chunk_bytes), device_work, args.repeat)
            result.extra["kvikio_threads"] = _kvikio_threads()
            result.note = gds_status()
            results.append(result)
    return results


def _sweeps(args: argparse.Namespace, size_bytes: int, dd: DdResult) -> list[Sweep]:
    sweeps: list[Sweep] = []
    pairs = len(args.sweep_threads) * len(args.sweep_chunk_mb)
    for name in [name for name in args.tiers if name in ("nvme", *GDS_TIERS)]:
        if name in GDS_TIERS and not torch.cuda.is_available():
            print(f"{name} sweep skipped: no CUDA device")
            continue
        device = "cuda" if name in GDS_TIERS else "cpu"
        work = make_workload(size_bytes, args.keys, args.seed, device=device, unaligned=args.unaligned_get)
        print(f"{name} sweep: {pairs} settings", flush=True)
        sweeps.append(run_sweep(name, args.dir, work, args.sweep_threads, args.sweep_chunk_mb, args.repeat, dd))
    return sweeps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    size_bytes = int(args.size_gb * (1 << 30))
    dd = dd_baseline(args.dir, size_bytes, args.dd_block_mb)
    print(render_dd(dd), flush=True)

    results = [] if args.sweep else _tier_rows(args, size_bytes)
    sweeps = _sweeps(args, size_bytes, dd) if args.sweep else []
    elapsed_s = time.perf_counter() - started

    print(
        f"\n{args.size_gb:g} GiB ({size_bytes} bytes) in {args.keys} keys on {args.dir}, best of {args.repeat}; "
        f"dd write {_gbps(dd.write_gbps)} GB/s, read {_gbps(dd.read_gbps)} GB/s\n"
    )
    if results:
        print(render(dd, results))
    for sweep in sweeps:
        print(render_sweep(sweep) + "\n")
    print(f"took {elapsed_s:.1f} s")
    if args.json is not None:
        report = {
            "dir": str(args.dir),
            "size_bytes": size_bytes,
            "keys": args.keys,
            "repeat": args.repeat,
            "unaligned_offset_bytes": UNALIGNED_OFFSET if args.unaligned_get else None,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "dd": asdict(dd),
            "tiers": [asdict(result) for result in results],
            "sweeps": [asdict(sweep) for sweep in sweeps],
            "elapsed_s": elapsed_s,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    verified = all(result.verified or result.put_gbps is None for result in results)
    verified = verified and all(row.verified for sweep in sweeps for row in sweep.rows)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
