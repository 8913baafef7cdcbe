"""Storage tier throughput against a ``dd`` direct-I/O baseline.

Usage::

    python bench/io.py --dir /mnt/nvme --size-gb 4 --json io.json

First ``dd`` writes ``--size-gb`` of zeros to a file in ``--dir`` with ``oflag=direct`` and reads it back
with ``iflag=direct``: that is what the device gives a single sequential stream. Then each tier stores a
buffer of random bytes (never zeros: some filesystems and devices compress or skip them) split into
``--keys`` keys, all in flight at once, and reads it back; the data is checked after the timing. The table
gives GB/s (10^9 bytes per second) and the percentage of the dd figure.

Caveats printed with the table: when the filesystem refuses O_DIRECT, dd and the tiers fall back to
buffered I/O and read back from the page cache, which measures memory, not the device. The ``pinned``
tier is a memory copy; its row is there to show the ceiling, not to compare with dd.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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

GB = 10**9
_DD_RESULT = re.compile(r"^(\d+) bytes.*copied, ([0-9.]+) s", re.MULTILINE)


@dataclass
class DdResult:
    write_gbps: float | None
    read_gbps: float | None
    direct: bool
    note: str = ""


@dataclass
class TierResult:
    tier: str
    mode: str
    put_gbps: float | None
    get_gbps: float | None
    verified: bool
    note: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def _dd(args: list[str]) -> tuple[int, float]:
    """Run dd and return (bytes, seconds) from its summary line."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "dd failed")
    match = _DD_RESULT.search(done.stderr)
    if match is None:
        raise RuntimeError(f"cannot parse dd output: {done.stderr!r}")
    return int(match.group(1)), float(match.group(2))


def dd_baseline(directory: Path, size_bytes: int, block_mb: int) -> DdResult:
    block = block_mb << 20
    count = max(1, -(-size_bytes // block))
    target = directory / f"slide-bench-dd-{uuid.uuid4().hex}"
    try:
        direct = True
        try:
            written, seconds = _dd(
                ["if=/dev/zero", f"of={target}", f"bs={block_mb}M", f"count={count}", "oflag=direct"]
            )
        except RuntimeError:
            direct = False  # e.g. a filesystem without O_DIRECT: flush explicitly so the write is real
            written, seconds = _dd(["if=/dev/zero", f"of={target}", f"bs={block_mb}M", f"count={count}", "conv=fsync"])
        flag = ["iflag=direct"] if direct else []
        read, read_seconds = _dd([f"if={target}", "of=/dev/null", f"bs={block_mb}M", *flag])
    except (OSError, RuntimeError) as error:
        return DdResult(None, None, False, note=f"dd failed: {error}")
    finally:
        target.unlink(missing_ok=True)
    note = "" if direct else "no O_DIRECT: buffered dd, reads come from the page cache"
    return DdResult(written / max(seconds, 1e-9) / GB, read / max(read_seconds, 1e-9) / GB, direct, note)


def _time_requests(issue: Callable[[], list]) -> float:
    start = time.perf_counter()
    for future in issue():
        future.result()
    return time.perf_counter() - start


def bench_tier(name: str, tier: Tier, source: torch.Tensor, keys: int, repeat: int) -> TierResult:
    """Put ``source`` as ``keys`` slices, all in flight, then get them back; the best of ``repeat`` runs.

    The first run also pays for page faults in fresh buffers, which a long training run does not.
    """
    pieces = list(source.chunk(keys))
    out = torch.empty_like(source)
    outs = list(out.chunk(keys))
    nbytes = source.numel() * source.element_size()
    put_s = get_s = float("inf")
    verified = True
    with tier:
        for _ in range(repeat):
            out.fill_(0)  # a stale right answer must not pass the check
            put_s = min(put_s, _time_requests(lambda: [tier.put(f"k{i}", p) for i, p in enumerate(pieces)]))
            get_s = min(get_s, _time_requests(lambda: [tier.get(f"k{i}", d) for i, d in enumerate(outs)]))
            verified = verified and bool(torch.equal(out, source))
        extra: dict[str, object] = {"put_s": put_s, "get_s": get_s}
        if isinstance(tier, PosixNvmeTier):
            extra["direct_io"] = tier.direct_io
            extra["io_threads"] = tier.io_threads
            extra["chunk_bytes"] = tier.chunk_bytes
    mode = getattr(tier, "mode", "direct" if extra.get("direct_io") else "buffered")
    if name == "pinned":
        mode = "memcpy"
    return TierResult(name, str(mode), nbytes / put_s / GB, nbytes / get_s / GB, verified, extra=extra)


def _percent(value: float | None, base: float | None) -> str:
    return f"{100 * value / base:.0f}%" if value is not None and base else "-"


def _gbps(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _verdict(result: TierResult) -> str:
    if result.put_gbps is None:
        return "-"
    return "yes" if result.verified else "NO"


def render(dd: DdResult, results: list[TierResult]) -> str:
    lines = [
        "| tier | mode | put GB/s | % dd write | get GB/s | % dd read | verified |",
        "|------|------|---------:|-----------:|---------:|----------:|:--------:|",
        f"| dd | {'direct' if dd.direct else 'buffered'} | {_gbps(dd.write_gbps)} | 100% | "
        f"{_gbps(dd.read_gbps)} | 100% | - |",
    ]
    for result in results:
        lines.append(
            f"| {result.tier} | {result.mode} | {_gbps(result.put_gbps)} | "
            f"{_percent(result.put_gbps, dd.write_gbps)} | {_gbps(result.get_gbps)} | "
            f"{_percent(result.get_gbps, dd.read_gbps)} | {_verdict(result)} |"
        )
    notes = [f"dd: {dd.note}"] if dd.note else []
    notes += [f"{result.tier}: {result.note}" for result in results if result.note]
    return "\n".join(lines + [""] + [f"- {note}" for note in notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="directory on the device to measure")
    parser.add_argument("--size-gb", type=float, default=1.0, help="bytes moved per test, in GiB")
    parser.add_argument("--tiers", default="nvme,pinned,gds", help="comma-separated: nvme, pinned, gds")
    parser.add_argument("--keys", type=int, default=4, help="split the buffer into this many keys in flight")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--chunk-mb", type=int, default=8)
    parser.add_argument("--dd-block-mb", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2, help="runs per tier; the best one is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    size_bytes = int(args.size_gb * (1 << 30))
    dd = dd_baseline(args.dir, size_bytes, args.dd_block_mb)

    generator = torch.Generator().manual_seed(args.seed)
    source = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8, generator=generator)
    nvme_options = {"io_threads": args.io_threads, "chunk_bytes": args.chunk_mb << 20}
    results: list[TierResult] = []
    for name in [part.strip() for part in args.tiers.split(",") if part.strip()]:
        if name == "nvme":
            results.append(bench_tier(name, PosixNvmeTier(args.dir, **nvme_options), source, args.keys, args.repeat))
        elif name == "pinned":
            alloc = (lambda n, dt: torch.empty(n, dtype=dt, pin_memory=True)) if torch.cuda.is_available() else None
            tier = PinnedRamTier(size_bytes + args.keys * 256, alloc=alloc)
            results.append(bench_tier(name, tier, source, args.keys, args.repeat))
        elif name == "gds":
            if not torch.cuda.is_available():
                results.append(TierResult(name, "-", None, None, False, note="skipped: no CUDA device"))
                continue
            device_source = source.cuda()
            torch.cuda.synchronize()
            result = bench_tier(name, GdsTier(args.dir, **nvme_options), device_source, args.keys, args.repeat)
            result.note = gds_status()
            results.append(result)
        else:
            parser.error(f"unknown tier {name!r}")

    print(f"{args.size_gb:g} GiB ({size_bytes} bytes) in {args.keys} keys on {args.dir}, best of {args.repeat}\n")
    print(render(dd, results))
    if args.json is not None:
        report = {
            "dir": str(args.dir),
            "size_bytes": size_bytes,
            "keys": args.keys,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "dd": asdict(dd),
            "tiers": [asdict(result) for result in results],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(result.verified or result.put_gbps is None for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
