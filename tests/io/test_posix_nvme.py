"""PosixNvmeTier: files under a directory, O_DIRECT when possible, I/O threads, errors that name paths."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from slide_core import TierError, plugins
from slide_io import GdsTier, PosixNvmeTier
from slide_io._bytes import aligned_empty
from slide_io.tiers import posix_nvme

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
ODD_SIZES = [1, 4095, 4097, 1_000_003]
MakeTensor = Callable[..., torch.Tensor]  # the ``make_tensor`` fixture from conftest.py
KiB = 1 << 10
MiB = 1 << 20
READ_SIZES = [1, 4095, 4097, 8 * MiB + 3]
# Where a destination's first byte sits past a 4 KiB boundary: on it (read in place), and 64 bytes past
# it, where torch.empty puts large host tensors (staged through the bounce buffer).
OFFSETS = {"page-aligned": 0, "64-past-page": 64}


def _read(tier: PosixNvmeTier, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    assert tier.get(key, out).result(timeout=20) is out
    return out


def _landing(like: torch.Tensor, offset: int) -> torch.Tensor:
    """An empty tensor shaped like ``like`` whose first byte sits ``offset`` bytes past a 4 KiB boundary."""
    nbytes = like.numel() * like.element_size()
    return aligned_empty(nbytes + offset)[offset : offset + nbytes].view(like.dtype).view(like.shape)


def _files(tier: PosixNvmeTier) -> list[str]:
    assert tier._root is not None
    return sorted(os.listdir(tier._root))


@pytest.fixture(params=[None, False], ids=["direct-auto", "buffered"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PosixNvmeTier]:
    with PosixNvmeTier(tmp_path, io_threads=4, chunk_bytes=256 * KiB, direct=request.param) as opened:
        yield opened


def test_registered_as_nvme_plugin() -> None:
    assert plugins.load("slide.tiers", "nvme") is PosixNvmeTier


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", ODD_SIZES)
def test_round_trip(tier: PosixNvmeTier, make_tensor: MakeTensor, dtype: torch.dtype, numel: int) -> None:
    tensor = make_tensor(numel, dtype)
    assert tier.put("k", tensor).result(timeout=20) is None
    assert torch.equal(_read(tier, "k", tensor), tensor)


def test_defaults_are_the_module_constants(tmp_path: Path) -> None:
    for cls in (PosixNvmeTier, GdsTier):
        tier = cls(tmp_path)
        assert (tier.io_threads, tier.chunk_bytes) == (posix_nvme.DEFAULT_IO_THREADS, posix_nvme.DEFAULT_CHUNK_BYTES)
    assert posix_nvme.DEFAULT_CHUNK_BYTES % 4096 == 0


def test_files_are_padded_only_under_direct_io(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    tier.put("k", make_tensor(4097, torch.uint8)).result()
    (name,) = _files(tier)
    size = os.path.getsize(tier._root / name)  # type: ignore[operator]
    assert size == (8192 if tier.direct_io else 4097)


def test_empty_and_strided_tensors(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    empty = torch.empty(0, dtype=torch.bfloat16)
    tier.put("empty", empty).result()
    assert _read(tier, "empty", empty).numel() == 0
    source = make_tensor(300 * 200).view(300, 200)[:, ::2]
    tier.put("strided", source).result()
    out = torch.empty(300, 200)[:, 1::2]
    tier.get("strided", out).result(timeout=20)
    assert torch.equal(out, source)


def test_many_requests_in_flight(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    tensors = {f"k{i}": make_tensor(20_000 + 4093 * i, DTYPES[i % len(DTYPES)], seed=i) for i in range(64)}
    puts = [tier.put(key, tensor) for key, tensor in tensors.items()]
    for future in puts:
        future.result(timeout=20)
    outs = {key: torch.empty_like(tensor) for key, tensor in tensors.items()}
    gets = [tier.get(key, outs[key]) for key in tensors]
    for future in gets:
        future.result(timeout=20)
    for key, tensor in tensors.items():
        assert torch.equal(outs[key], tensor), key
    assert len(_files(tier)) == 64


def test_overwrite_with_new_size_replaces_the_file(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    first, second = make_tensor(1_000_003), make_tensor(4095, torch.int64, seed=1)
    tier.put("k", first).result()
    old_files = _files(tier)
    tier.put("k", second).result()
    assert torch.equal(_read(tier, "k", second), second)
    new_files = _files(tier)
    assert len(new_files) == 1 and new_files != old_files
    with pytest.raises(TierError, match=r"holds 4095 x torch\.int64"):
        tier.get("k", torch.empty_like(first))


def test_delete_removes_the_file(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    tier.put("a", make_tensor(10)).result()
    tier.put("b", make_tensor(10, seed=1)).result()
    tier.delete("a")
    tier.delete("never-stored")
    assert len(_files(tier)) == 1 and tier.stored_keys() == ["b"]
    with pytest.raises(TierError, match="no key 'a'"):
        tier.get("a", torch.empty(10))


def test_close_twice_removes_files_but_not_the_directory(tmp_path: Path, make_tensor: MakeTensor) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    tier = PosixNvmeTier(tmp_path).open()
    futures = [tier.put(f"k{i}", make_tensor(300_000, seed=i)) for i in range(16)]
    root = tier._root
    assert root is not None and root.parent == tmp_path
    tier.close()  # drains the in-flight puts first
    assert all(future.done() and future.exception() is None for future in futures)
    tier.close()
    assert not root.exists()
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]
    with pytest.raises(TierError, match="closed"):
        tier.put("k", torch.ones(1))


def test_capacity_is_statvfs_available(tier: PosixNvmeTier) -> None:
    stat = os.statvfs(tier.directory)
    capacity = tier.capacity_bytes()
    assert capacity is not None and abs(capacity - stat.f_bavail * stat.f_frsize) < 64 * MiB


def test_direct_io_probe_and_requirement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with PosixNvmeTier(tmp_path, direct=False) as tier:
        assert tier.direct_io is False
    monkeypatch.setattr(PosixNvmeTier, "_probe_direct", lambda self, root: False)
    with PosixNvmeTier(tmp_path) as tier:
        assert tier.direct_io is False
        tier.put("k", torch.arange(5000)).result()
        assert torch.equal(_read(tier, "k", torch.arange(5000)), torch.arange(5000))
    with pytest.raises(TierError, match="O_DIRECT was required"):
        PosixNvmeTier(tmp_path, direct=True).open()
    assert os.listdir(tmp_path) == []  # a failed open leaves nothing behind


# -- reads straight into the destination: Note [Direct reads] in posix_nvme.py -------------------------------


@pytest.mark.parametrize("offset", OFFSETS.values(), ids=OFFSETS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", READ_SIZES)
def test_round_trip_into_aligned_and_misaligned_destinations(
    tier: PosixNvmeTier, make_tensor: MakeTensor, dtype: torch.dtype, numel: int, offset: int
) -> None:
    tensor = make_tensor(numel, dtype)
    tier.put("k", tensor).result(timeout=20)
    out = _landing(tensor, offset)
    assert tier.get("k", out).result(timeout=20) is out
    assert torch.equal(out, tensor)


@pytest.fixture
def direct_tier(tmp_path: Path) -> Iterator[PosixNvmeTier]:
    with PosixNvmeTier(tmp_path, io_threads=4, chunk_bytes=256 * KiB) as opened:
        if not opened.direct_io:
            pytest.skip(f"{tmp_path} refuses O_DIRECT: every read is in place")
        yield opened


@pytest.mark.parametrize(
    ("nbytes", "copied"),
    [(8 * MiB, []), (8 * MiB + 3, [3]), (4097, [1]), (4095, [4095]), (1, [1]), (0, [])],
)
def test_aligned_destinations_copy_only_the_last_partial_block(
    direct_tier: PosixNvmeTier,
    make_tensor: MakeTensor,
    monkeypatch: pytest.MonkeyPatch,
    nbytes: int,
    copied: list[int],
) -> None:
    """Note [Direct reads]: page-aligned host memory is read in place; only the bytes of the key's last,
    partial 4 KiB block pass through the bounce buffer, and no request allocates."""
    tensor = make_tensor(nbytes, torch.uint8)
    direct_tier.put("k", tensor).result(timeout=20)
    out = _landing(tensor, 0)
    copies: list[int] = []
    real_copy = posix_nvme._copy_bytes

    def spy(dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append(dst.numel())
        real_copy(dst, src)

    def no_alloc(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a read allocated a buffer")

    monkeypatch.setattr(posix_nvme, "_copy_bytes", spy)
    monkeypatch.setattr(posix_nvme, "aligned_empty", no_alloc)
    direct_tier.get("k", out).result(timeout=20)
    assert torch.equal(out, tensor)
    assert copies == copied


def test_misaligned_destinations_are_staged_chunk_by_chunk(
    direct_tier: PosixNvmeTier, make_tensor: MakeTensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [Direct reads]: a destination off a 4 KiB boundary is read through the bounce buffers whole."""
    tensor = make_tensor(MiB + 3, torch.uint8)
    direct_tier.put("k", tensor).result(timeout=20)
    copies: list[int] = []
    real_copy = posix_nvme._copy_bytes

    def spy(dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append(dst.numel())
        real_copy(dst, src)

    monkeypatch.setattr(posix_nvme, "_copy_bytes", spy)
    out = _landing(tensor, 64)
    direct_tier.get("k", out).result(timeout=20)
    assert torch.equal(out, tensor)
    assert sorted(copies) == [3] + [256 * KiB] * 4


def test_short_reads_resume_across_iovecs(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 40  # 10240 bytes of "file"
    calls: list[tuple[list[int], int]] = []

    def preadv(fd: int, views: list[memoryview], offset: int) -> int:
        calls.append(([len(view) for view in views], offset))
        count = 0
        for view in views:
            take = min(len(view), 1000 - count, len(data) - offset - count)  # at most 1000 bytes a call
            view[:take] = data[offset + count : offset + count + take]
            count += take
        return count

    monkeypatch.setattr(posix_nvme.os, "preadv", preadv)
    body, block = bytearray(4096), bytearray(4096)
    posix_nvme._pread_into(-1, [memoryview(body), memoryview(block)], 2048, 8192)
    assert bytes(body) + bytes(block) == data[2048:]
    assert len(calls) == 9 and calls[0] == ([4096, 4096], 2048)
    assert calls[4] == ([96, 4096], 6048) and calls[5] == ([3192], 7048)
    with pytest.raises(OSError, match="file ends"):
        posix_nvme._pread_into(-1, [memoryview(bytearray(4096))], 8192, 4096)


@pytest.mark.timeout(60)
def test_many_concurrent_reads_into_mixed_destinations(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    tensors = {f"k{i}": make_tensor(1 + 40_961 * i, DTYPES[i % len(DTYPES)], seed=i) for i in range(48)}
    for future in [tier.put(key, tensor) for key, tensor in tensors.items()]:
        future.result(timeout=20)
    outs = [(key, _landing(tensor, (0, 64, 4096 - 8)[n % 3])) for n in range(3) for key, tensor in tensors.items()]
    gets = [tier.get(key, out) for key, out in outs]  # 144 requests, three reads of each key, all in flight
    for future in gets:
        future.result(timeout=30)
    for key, out in outs:
        assert torch.equal(out, tensors[key]), key


# -- errors ------------------------------------------------------------------------------------------------


def test_missing_or_non_directory_path_fails_at_open(tmp_path: Path) -> None:
    regular = tmp_path / "regular-file"
    regular.write_text("not a directory")
    for path, words in [(regular, "is not a directory"), (regular / "sub", "does not exist")]:
        with pytest.raises(TierError) as info:
            PosixNvmeTier(path).open()
        message = str(info.value)
        assert str(path) in message and words in message and "\n" not in message


@pytest.mark.parametrize("path", ["/proc", "/sys"])
def test_unwritable_directory_fails_at_open(path: str) -> None:
    if not os.path.isdir(path):
        pytest.skip(f"{path} does not exist here")
    with pytest.raises(TierError) as info:
        PosixNvmeTier(path).open()
    message = str(info.value)
    assert f"cannot create files in {path}" in message and "\n" not in message


@pytest.mark.timeout(30)
def test_worker_exception_reaches_the_caller(
    tier: PosixNvmeTier, make_tensor: MakeTensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = make_tensor(1000, torch.float16)
    tier.put("kept", kept).result()
    calls = [0]
    real_write = posix_nvme._pwrite_all

    def flaky_write(fd: int, data: memoryview, offset: int) -> None:
        calls[0] += 1
        if calls[0] == 3:  # one chunk of many fails; the others succeed
            raise RuntimeError("injected disk fault")
        real_write(fd, data, offset)

    monkeypatch.setattr(posix_nvme, "_pwrite_all", flaky_write)
    future = tier.put("kept", make_tensor(1 * MiB, torch.uint8))  # 4 chunks of 256 KiB
    with pytest.raises(TierError, match="injected disk fault") as info:
        future.result(timeout=10)
    assert isinstance(info.value.__cause__, RuntimeError) and "\n" not in str(info.value)
    assert str(tier._root) in str(info.value)
    assert len(_files(tier)) == 1  # the half-written file is gone, the previous version stays
    assert torch.equal(_read(tier, "kept", kept), kept)

    def broken_read(fd: int, data: memoryview, offset: int, need: int) -> None:
        raise OSError(errno.EIO, "injected read fault")

    monkeypatch.setattr(posix_nvme, "_pread_into", broken_read)
    with pytest.raises(TierError, match=r"reading 'kept'.*injected read fault"):
        tier.get("kept", torch.empty_like(kept)).result(timeout=10)


def test_short_write_then_misaligned_retry_counts_as_full(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            return 512  # short: the device filled up mid-write
        raise OSError(errno.EINVAL, "Invalid argument")  # O_DIRECT retry at an unaligned offset

    monkeypatch.setattr(posix_nvme.os, "pwrite", pwrite)
    with pytest.raises(OSError) as info:
        posix_nvme._pwrite_all(-1, memoryview(bytearray(4096)), 8192)
    assert info.value.errno == errno.ENOSPC and calls == [8192, 8704]


def _gate_writes_of(tier: PosixNvmeTier, slow: torch.Tensor) -> threading.Event:
    """Make chunks of ``slow`` wait for the returned event before being written."""
    gate = threading.Event()
    real_chunk = tier._write_chunk

    def gated(fd: int, src: torch.Tensor, start: int, stop: int) -> None:
        if src.data_ptr() == slow.data_ptr():
            assert gate.wait(10)
        real_chunk(fd, src, start, stop)

    tier._write_chunk = gated  # type: ignore[method-assign]
    return gate


@pytest.mark.timeout(30)
def test_a_late_older_put_does_not_overwrite_a_newer_one(tmp_path: Path, make_tensor: MakeTensor) -> None:
    slow, fast = make_tensor(1000, seed=1), make_tensor(1000, seed=2)
    with PosixNvmeTier(tmp_path, io_threads=2) as tier:
        gate = _gate_writes_of(tier, slow)
        late = tier.put("k", slow)
        tier.put("k", fast).result(timeout=10)
        gate.set()
        late.result(timeout=10)
        assert torch.equal(_read(tier, "k", fast), fast)
        assert len(_files(tier)) == 1


@pytest.mark.timeout(30)
def test_delete_wins_over_a_put_still_in_flight(tmp_path: Path, make_tensor: MakeTensor) -> None:
    slow = make_tensor(1000)
    with PosixNvmeTier(tmp_path, io_threads=2) as tier:
        gate = _gate_writes_of(tier, slow)
        late = tier.put("k", slow)
        tier.delete("k")
        gate.set()
        late.result(timeout=10)
        assert tier.stored_keys() == [] and _files(tier) == []
        tier.put("k", slow).result(timeout=10)  # a put issued after the delete counts again
        assert torch.equal(_read(tier, "k", slow), slow)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root and mount permission; skipped otherwise)."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"cannot run mount: {error}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=10)


@pytest.mark.timeout(30)
def test_full_disk_names_path_needed_free_and_keeps_keys(tiny_tmpfs: Path, make_tensor: MakeTensor) -> None:
    first = make_tensor(64 * KiB)  # 256 KiB
    with PosixNvmeTier(tiny_tmpfs, chunk_bytes=64 * KiB) as tier:
        tier.put("first", first).result(timeout=10)
        with pytest.raises(TierError) as info:
            tier.put("big", make_tensor(512 * KiB, seed=1)).result(timeout=10)  # 2 MiB
        message = str(info.value)
        assert "\n" not in message and str(tiny_tmpfs) in message and "'big'" in message
        assert f"needs {2 * MiB} bytes" in message and "No space left on device" in message
        free = int(message.split(" bytes free")[0].rsplit(" ", 1)[1])
        assert 0 < free <= MiB - 256 * KiB
        with pytest.raises(TierError, match="no space"):  # a failed overwrite keeps the old version
            tier.put("first", make_tensor(256 * KiB, seed=2)).result(timeout=10)
        assert torch.equal(_read(tier, "first", first), first)
        assert tier.stored_keys() == ["first"] and len(_files(tier)) == 1
        second = make_tensor(64 * KiB, seed=3)  # the failed writes gave their space back
        tier.put("second", second).result(timeout=10)
        assert torch.equal(_read(tier, "second", second), second)


_FSIZE_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import torch
    from slide_core import TierError
    from slide_io import PosixNvmeTier

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of failing with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    generator = torch.Generator().manual_seed(5)
    small = torch.randn(100_000, generator=generator) + 1
    with PosixNvmeTier(sys.argv[1], chunk_bytes=1 << 18) as tier:
        tier.put("small", small).result(timeout=20)
        try:
            tier.put("big", torch.randn(1_000_000, generator=generator)).result(timeout=20)
            message = None
        except TierError as error:
            message = str(error)
        out = torch.empty_like(small)
        tier.get("small", out).result(timeout=20)
        report = {"message": message, "intact": torch.equal(out, small), "files": len(os.listdir(tier._root))}
    print(json.dumps(report))
    """
)


@pytest.mark.slow  # a fresh Python process: seconds of imports
@pytest.mark.timeout(60)
def test_file_size_limit_is_reported_like_a_full_disk(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    message = report["message"]
    assert message is not None and "\n" not in message
    assert str(tmp_path) in message and re.search(r"needs (4000000|4001792) bytes, \d+ bytes free", message)
    assert "File too large" in message and "RLIMIT_FSIZE) is 1048576 bytes" in message
    assert report["intact"] is True and report["files"] == 1


@pytest.mark.gpu
def test_cuda_tensors_go_through_the_bounce_buffers(tier: PosixNvmeTier, make_tensor: MakeTensor) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tensor = make_tensor(1_000_003, torch.bfloat16, device="cuda")
    tier.put("k", tensor).result(timeout=20)
    assert torch.equal(_read(tier, "k", tensor), tensor)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    tier.get("k", host).result(timeout=20)
    assert torch.equal(host, tensor.cpu())
