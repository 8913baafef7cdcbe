"""GdsTier: kvikio for CUDA tensors, a POSIX fallback without it, and the status line for ``slide doctor``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import slide_io
from slide_core import TierError, plugins
from slide_io import GdsTier
from slide_io._kvikio import kvikio_mode

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
ODD_SIZES = [1, 4095, 4097, 1_000_003]
MakeTensor = Callable[..., torch.Tensor]  # the ``make_tensor`` fixture from conftest.py


def _read(tier: GdsTier, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    assert tier.get(key, out).result(timeout=30) is out
    return out


def test_registered_as_gds_plugin() -> None:
    assert plugins.load("slide.tiers", "gds") is GdsTier


@pytest.mark.slow  # a fresh Python process: seconds of imports
def test_importing_slide_io_does_not_import_kvikio(tmp_path: Path) -> None:
    trap = tmp_path / "kvikio"
    trap.mkdir()
    (trap / "__init__.py").write_text("raise SystemExit('kvikio was imported')\n")
    code = "import sys, slide_io, slide_io.tiers.gds; assert 'kvikio' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stderr


# -- CPU: no kvikio ----------------------------------------------------------------------------------------


@pytest.fixture
def no_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)  # makes ``import kvikio`` raise ImportError


@pytest.mark.usefixtures("no_kvikio")
def test_falls_back_to_posix_without_kvikio(
    tmp_path: Path, make_tensor: MakeTensor, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="slide_io.tiers.gds"):
        tier = GdsTier(tmp_path, io_threads=2)
        assert tier.mode == "posix-fallback"
        with tier:
            tensors = {f"{dtype}-{numel}": make_tensor(numel, dtype) for dtype in DTYPES for numel in ODD_SIZES}
            for future in [tier.put(key, tensor) for key, tensor in tensors.items()]:
                future.result(timeout=30)
            for key, tensor in tensors.items():
                assert torch.equal(_read(tier, key, tensor), tensor), key
            tier.put(next(iter(tensors)), make_tensor(10)).result()  # overwrite with a new size
            tier.delete("torch.bool-1")
            with pytest.raises(TierError, match="gds tier has no key"):
                tier.get("torch.bool-1", torch.empty(1, dtype=torch.bool))
            root = tier._root
        tier.close()
    assert root is not None and not root.exists() and os.listdir(tmp_path) == []
    warnings = [record for record in caplog.records if record.name == "slide_io.tiers.gds"]
    assert len(warnings) == 1 and "kvikio is not importable" in warnings[0].getMessage()


@pytest.mark.usefixtures("no_kvikio")
def test_fallback_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(TierError, match=f"gds tier: directory {tmp_path / 'missing'} does not exist"):
        GdsTier(tmp_path / "missing").open()


@pytest.mark.usefixtures("no_kvikio")
def test_gds_status_without_kvikio() -> None:
    status = slide_io.gds_status()
    assert "kvikio not importable" in status and "pip install 'slide-io[gds]'" in status and "\n" not in status


# -- CPU: the kvikio compat-mode APIs across versions --------------------------------------------------


class _CompatMode:
    def __init__(self, name: str) -> None:
        self.name = name


def _fake_kvikio(**defaults: Callable[..., object]) -> types.ModuleType:
    module = types.ModuleType("kvikio")
    module.defaults = types.SimpleNamespace(**defaults)  # type: ignore[attr-defined]
    module.__version__ = "0.0-test"  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize(
    ("defaults", "expected"),
    [
        ({"is_compat_mode_preferred": lambda: False}, "gds"),
        ({"is_compat_mode_preferred": lambda: True, "compat_mode": lambda: False}, "compat"),
        ({"get": lambda name: _CompatMode("OFF")}, "gds"),
        ({"get": lambda name: _CompatMode("ON")}, "compat"),
        ({"compat_mode": lambda: False}, "gds"),
        ({"compat_mode": lambda: True}, "compat"),
        ({"compat_mode": lambda: _CompatMode("AUTO")}, "compat"),
        ({}, "compat"),
    ],
)
def test_kvikio_mode_reads_every_api_generation(defaults: dict[str, Callable[..., object]], expected: str) -> None:
    assert kvikio_mode(_fake_kvikio(**defaults)) == expected


def test_mode_and_status_with_an_importable_kvikio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", _fake_kvikio(is_compat_mode_preferred=lambda: True))
    with caplog.at_level(logging.WARNING, logger="slide_io.tiers.gds"):
        assert GdsTier(tmp_path).mode == "compat"
    assert not caplog.records
    assert "compatibility mode" in slide_io.gds_status()
    monkeypatch.setitem(sys.modules, "kvikio", _fake_kvikio(is_compat_mode_preferred=lambda: False))
    assert GdsTier(tmp_path).mode == "gds"
    assert "GPUDirect Storage (cuFile) enabled" in slide_io.gds_status()


# -- GPU + kvikio ------------------------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["own-path-in-compat", "kvikio-in-compat"])
def gds_tier(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[GdsTier]:
    """Both data paths for CUDA tensors (Note [Compat mode takes the POSIX path])."""
    pytest.importorskip("kvikio", reason="kvikio (pip install 'slide-io[gds]') is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with GdsTier(tmp_path, kvikio_in_compat=request.param) as tier:
        yield tier


def test_compat_mode_takes_the_posix_path_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Compat mode takes the POSIX path]: kvikio moves CUDA tensors only for real GDS, or on request."""
    monkeypatch.setitem(sys.modules, "kvikio", _fake_kvikio(is_compat_mode_preferred=lambda: True))
    assert not GdsTier(tmp_path)._via_kvikio
    assert GdsTier(tmp_path, kvikio_in_compat=True)._via_kvikio
    assert not GdsTier(tmp_path).moves_device_memory and not GdsTier.real_gds_available()
    monkeypatch.setitem(sys.modules, "kvikio", _fake_kvikio(is_compat_mode_preferred=lambda: False))
    assert GdsTier(tmp_path)._via_kvikio
    assert GdsTier(tmp_path).moves_device_memory and GdsTier.real_gds_available()


@pytest.mark.gds
def test_gds_mode_and_status(gds_tier: GdsTier) -> None:
    assert gds_tier.mode in ("gds", "compat")
    assert slide_io.gds_status().startswith("gds: kvikio ")


@pytest.mark.gds
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", ODD_SIZES)
def test_gds_round_trip(gds_tier: GdsTier, make_tensor: MakeTensor, dtype: torch.dtype, numel: int) -> None:
    tensor = make_tensor(numel, dtype, device="cuda")
    gds_tier.put("k", tensor).result(timeout=30)
    assert torch.equal(_read(gds_tier, "k", tensor), tensor)


@pytest.mark.gds
def test_gds_mixes_host_and_device_tensors(gds_tier: GdsTier, make_tensor: MakeTensor) -> None:
    host = make_tensor(1_000_003, torch.bfloat16)
    gds_tier.put("from-host", host).result(timeout=30)
    assert torch.equal(_read(gds_tier, "from-host", host.cuda()).cpu(), host)
    gds_tier.put("from-device", host.cuda()).result(timeout=30)
    assert torch.equal(_read(gds_tier, "from-device", host), host)


@pytest.mark.gds
def test_gds_many_requests_overwrite_delete_close(gds_tier: GdsTier, make_tensor: MakeTensor) -> None:
    tensors = {f"k{i}": make_tensor(4097 * (i + 1), DTYPES[i % 6], seed=i, device="cuda") for i in range(64)}
    for future in [gds_tier.put(key, tensor) for key, tensor in tensors.items()]:
        future.result(timeout=30)
    outs = {key: torch.empty_like(tensor) for key, tensor in tensors.items()}
    for future in [gds_tier.get(key, outs[key]) for key in tensors]:
        future.result(timeout=30)
    assert all(torch.equal(outs[key], tensors[key]) for key in tensors)
    bigger = make_tensor(1_000_003, torch.int64, device="cuda")
    gds_tier.put("k0", bigger).result(timeout=30)
    assert torch.equal(_read(gds_tier, "k0", bigger), bigger)
    gds_tier.delete("k1")
    assert "k1" not in gds_tier.stored_keys() and len(os.listdir(gds_tier._root)) == 63  # type: ignore[arg-type]
    root = gds_tier._root
    gds_tier.close()
    gds_tier.close()
    assert root is not None and not root.exists()


@pytest.mark.gds
def test_engine_activations_through_kvikio_match_ram(tmp_path: Path) -> None:
    """Note [Direct activation I/O] on a GPU: block inputs written from and read into GPU memory by
    kvikio give the same losses and weights as inputs kept in host RAM."""
    pytest.importorskip("kvikio", reason="kvikio (pip install 'slide-io[gds]') is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from slide_core import AdamWConfig, HostParameters
    from slide_core.devices.cuda import CUDADevice
    from slide_core.engine import Engine, EngineConfig
    from slide_core.optim import TorchAdamW
    from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init

    cfg = ToyConfig(vocab_size=512, hidden_size=256, num_heads=8, intermediate_size=688, num_layers=4)
    model = ToyModel(cfg)
    init = toy_init(model, seed=7)
    batches = toy_batches(cfg, steps=3, accum=1, seed=1)

    def run(tier=None):
        with CUDADevice() as device:
            host = HostParameters(model, device.alloc_pinned)
            load_init(host, init)
            config = EngineConfig(compute_dtype=torch.bfloat16, transfer_chunk_numel=1 << 16)
            with Engine(model, device, host, TorchAdamW(AdamWConfig()), config, activation_tier=tier) as engine:
                assert tier is None or engine.stash.direct
                losses = [engine.step(micro, lr=1e-3).loss for micro in batches]
            return losses, host.slab.clone()

    in_ram = run()
    with GdsTier(tmp_path, kvikio_in_compat=True) as tier:
        through_kvikio = run(tier)
    assert through_kvikio[0] == in_ram[0]
    assert torch.equal(through_kvikio[1], in_ram[1])
