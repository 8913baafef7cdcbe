"""Training with Adam state on the POSIX NVMe tier: bit-identical to RAM, and the state is on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel
from slide_io import PosixNvmeTier


def _run(model: ToyModel, config: EngineConfig, tier=None, on_step=None):
    generator = torch.Generator().manual_seed(5)
    batches = [[(ids, ids.clone())] for ids in (torch.randint(0, 97, (2, 16), generator=generator) for _ in range(4))]
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        model.init_({u.name: host.views(u) for u in model.units}, 3)
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config, state_tier=tier) as engine:
            losses = []
            for micro in batches:
                losses.append(engine.step(micro, lr=2e-3).loss)
                if on_step is not None:
                    on_step(engine)
        return losses, host.slab.clone()


def test_nvme_tier_training_is_bit_identical_and_on_disk(tmp_path: Path) -> None:
    model = ToyModel(ToyConfig(num_layers=3))
    ram = _run(model, EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024))
    offloaded = ("layers.0", "layers.1", "layers.2", "embed", "head")
    state_bytes = 8 * sum(u.layout.numel for u in model.units if u.name in offloaded)
    seen: list[int] = []

    def on_disk(engine: Engine) -> None:
        engine.drain()  # every update and write-back of this step has landed
        seen.append(sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()))

    with PosixNvmeTier(tmp_path) as tier:
        config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, offloaded_units=offloaded)
        nvme = _run(model, config, tier, on_disk)
    assert nvme[0] == ram[0]
    assert torch.equal(nvme[1], ram[1])
    assert all(size >= state_bytes for size in seen), (seen, state_bytes)
    assert not [f for f in tmp_path.rglob("*") if f.is_file()], "tier files left behind after close"


@pytest.mark.usefixtures("torch_kernels")
def test_slide_train_offload_optimizer_nvme_matches_ram(tmp_path: Path) -> None:
    from slide_hf.cli.main import main

    common = ["--steps", "3", "--seq-len", "32", "--dtype", "float32", "--device", "cpu"]
    assert main(["train", "--output", str(tmp_path / "ram"), "--metrics", str(tmp_path / "ram.jsonl"), *common]) == 0
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    args = ["--offload-optimizer", "nvme", "--nvme-dir", str(nvme_dir), "--nvme-fraction", "1.0"]
    assert main(["train", "--output", str(tmp_path / "n"), "--metrics", str(tmp_path / "n.jsonl"), *args, *common]) == 0
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / f).read_text().splitlines()] for f in ("ram.jsonl", "n.jsonl")
    ]
    assert losses[0] == losses[1]


def test_activations_on_the_nvme_tier_are_bit_identical(tmp_path: Path) -> None:
    model = ToyModel(ToyConfig(num_layers=4))
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024)
    ram = _run(model, config)
    generator = torch.Generator().manual_seed(5)
    batches = [[(ids, ids.clone())] for ids in (torch.randint(0, 97, (2, 16), generator=generator) for _ in range(4))]
    with PosixNvmeTier(tmp_path) as tier, CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        model.init_({u.name: host.views(u) for u in model.units}, 3)
        with Engine(
            model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config, activation_tier=tier
        ) as engine:
            losses = [engine.step(micro, lr=2e-3).loss for micro in batches]
            on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert losses == ram[0]
    assert torch.equal(host.slab, ram[1])
    assert on_disk >= 4 * 2 * 16 * 32 * 4  # four blocks' inputs (batch 2 x 16 tokens x 32 hidden, fp32)
