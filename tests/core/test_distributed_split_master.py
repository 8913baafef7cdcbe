"""The split master under data parallel, in real gloo processes: three ranks train with a split master
exactly as with an fp32 one (each rank steps its shard of the planes, whose bounds need not fall on a tie
byte; a drain all-gathers every unit decoded and encodes it again), and each rank's checkpoint resumes
in the other format bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.checkpoint import save_checkpoint
from slide_core.devices.cpu import CPUDevice
from slide_core.distributed import ProcessGroupContext
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, launch_ranks, load_init, toy_batches, toy_init, wait_ranks

WORLD_SIZE = 3  # units are 64-element multiples: three ranks' shards start and end inside tie bytes
ROWS_PER_RANK = 2
CFG = ToyConfig(tie_embeddings=True, num_layers=3, vocab_size=101, hidden_size=40)
CONFIG = EngineConfig(
    compute_dtype=torch.bfloat16,
    transfer_chunk_numel=1024,
    max_grad_norm=0.05,
    resident_units=("layers.1",),
    timeout_s=60.0,
)


def _optimizer():
    try:
        from slide_core.optim.fused_adamw import FusedAdamW

        if FusedAdamW.available():
            return FusedAdamW(AdamWConfig(weight_decay=0.1))
    except ImportError:
        pass
    return TorchAdamW(AdamWConfig(weight_decay=0.1))


def _rows(rank: int):
    batches = toy_batches(CFG, steps=3, accum=2, seed=5, batch=WORLD_SIZE * ROWS_PER_RANK)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return [[(ids[rows], labels[rows]) for ids, labels in micro] for micro in batches]


def _engine(device: CPUDevice, master_format: str, group: ProcessGroupContext) -> tuple[Engine, HostParameters]:
    model = ToyModel(CFG)
    host = HostParameters(model, master_format=master_format)
    load_init(host, toy_init(model, seed=4))
    return Engine(model, device, host, _optimizer(), CONFIG, process_group=group), host


def _masters(host: HostParameters) -> dict[str, torch.Tensor]:
    return {unit.name: host.read(unit).clone() for unit in host.model.units}


def _rank_main(out: Path) -> None:
    group = ProcessGroupContext.from_env("cpu", timeout_s=60.0)
    batches = _rows(group.rank)
    results: dict[str, object] = {}
    with group, CPUDevice() as device:
        for fmt in ("fp32", "split"):
            engine, host = _engine(device, fmt, group)
            with engine:  # leaving drains: every unit all-gathered on every rank
                results[f"{fmt}-losses"] = [engine.step(micro, lr=3e-3).loss for micro in batches]
            results[f"{fmt}-master"] = _masters(host)
            engine, host = _engine(device, fmt, group)
            with engine:
                for micro in batches[:2]:
                    engine.step(micro, lr=3e-3)
                arrays, state = engine.checkpoint_arrays(), engine.schedule_state()
                results[f"{fmt}-saved"] = str(save_checkpoint(out / f"{fmt}-rank{group.rank}", 2, arrays, state))
        for saved, then in (("split", "fp32"), ("fp32", "split")):
            engine, host = _engine(device, then, group)
            with engine:
                engine.restore_schedule_state(engine.restore_checkpoint(Path(results[f"{saved}-saved"]))["extra"])
                results[f"{saved}-to-{then}-losses"] = [engine.step(micro, lr=3e-3).loss for micro in batches[2:]]
            results[f"{saved}-to-{then}-master"] = _masters(host)
    torch.save(results, out / f"rank{group.rank}.pt")


@pytest.mark.slow
def test_three_ranks_train_and_resume_alike_with_either_master(tmp_path: Path) -> None:
    procs = launch_ranks([sys.executable, __file__, str(tmp_path)], WORLD_SIZE)
    for rank, (code, err) in enumerate(wait_ranks(procs, 240.0)):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    for got in ranks:
        assert got["split-losses"] == got["fp32-losses"]
        _same(got["split-master"], got["fp32-master"])
        _same(got["split-master"], ranks[0]["split-master"])  # every rank holds the whole, gathered master
        for saved, then in (("split", "fp32"), ("fp32", "split")):
            assert got[f"{saved}-to-{then}-losses"] == got["fp32-losses"][2:]
            _same(got[f"{saved}-to-{then}-master"], got["fp32-master"])


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, tensor in b.items():
        assert torch.equal(a[name].view(torch.int32), tensor.view(torch.int32)), name


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
