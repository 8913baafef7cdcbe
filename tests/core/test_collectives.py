"""One process is a world of size one (slide_core/collectives.py, slide_core/engine/unit_pipelines.py):
the engine composes the same unit pipelines whatever the world size, and :class:`SingleProcess` does no
work (Note [Collectives at world size one]).

This file is also a rank's program: ``python test_collectives.py OUT.json`` with torchrun's variables in
the environment builds the engine of one rank of a gloo run, steps once, and writes what it composed.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.collectives import SingleProcess
from slide_core.devices.cpu import CPUDevice
from slide_core.distributed import ProcessGroupContext
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, launch_ranks, load_init, toy_batches, toy_init, wait_ranks
from slide_core.tiers.host_ram import HostRamTier

CONFIG = EngineConfig(
    compute_dtype=torch.float32,
    transfer_chunk_numel=1024,
    max_grad_norm=0.05,
    timeout_s=60.0,
    resident_units=("embed",),
    offloaded_units=("layers.1",),
)


def _composition(group: ProcessGroupContext | SingleProcess) -> dict:
    """The classes of every unit's pipeline and state store, and of the collectives, after one step."""
    model = ToyModel(ToyConfig(num_layers=2))
    with CPUDevice() as device, HostRamTier() as tier:
        host = HostParameters(model)
        load_init(host, toy_init(model, seed=4))
        with Engine(
            model, device, host, TorchAdamW(AdamWConfig()), CONFIG, state_tier=tier, process_group=group
        ) as engine:
            (micro,) = toy_batches(model.cfg, 1, 1, seed=5, batch=2)
            engine.step(
                [(ids[group.rank :: group.world_size], lab[group.rank :: group.world_size]) for ids, lab in micro],
                lr=1e-3,
            )
            pipelines = engine.pipelines
            return {
                "collectives": type(engine.collectives).__name__,
                "pipelines": {
                    unit.name: [type(pipeline).__name__, type(getattr(pipeline, "store", None)).__name__]
                    for unit, pipeline in pipelines.routes
                },
                "spans": {name: list(span) for name, span in pipelines.spans.items()},
            }


@pytest.mark.slow
def test_one_process_runs_the_pipelines_of_every_world_size(tmp_path: Path) -> None:
    """A 2-rank gloo run composes each unit's pipeline from the same classes as one process (there is no
    sharded pipeline class); only the shards and the collectives differ."""
    out = tmp_path / "rank{}.json"
    procs = launch_ranks([sys.executable, __file__, str(out)], 2)
    for rank, (code, err) in enumerate(wait_ranks(procs, 150.0)):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    one = _composition(SingleProcess())
    assert one["collectives"] == "SingleProcess"
    assert one["pipelines"]["embed"] == ["ResidentPipeline", "NoneType"]
    assert one["pipelines"]["layers.0"] == ["HostPipeline", "HostSlabs"]
    assert one["pipelines"]["layers.1"] == ["HostPipeline", "TierStore"]
    for rank in range(2):
        ranked = json.loads(Path(str(out).format(rank)).read_text())
        assert ranked["collectives"] == "ProcessGroupContext"
        assert ranked["pipelines"] == one["pipelines"], f"rank {rank}"
        for name, (lo, hi) in ranked["spans"].items():
            assert one["spans"][name][0] == 0 and 0 < hi - lo < one["spans"][name][1]
    for gone in ("sharded_pipeline", "sharded_resident", "offloaded_pipeline"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"slide_core.engine.{gone}")


def test_single_process_collectives_do_nothing() -> None:
    """Every collective of a world of one leaves its tensor as it is, in place, and allocates nothing; the
    gradient's sum stays on the compute stream (the same context object each time)."""
    one = SingleProcess()
    flat = torch.randn(37)
    before, pointer = flat.clone(), flat.data_ptr()
    for collective in (one.reduce_scatter_, one.all_gather_, one.all_gather_main_, one.all_gather_host_):
        collective(flat, "a test")
    one.all_reduce_(flat, "a test")
    one.all_reduce_host_(flat, "a test")
    one.gather_to_root_(flat, "a test", host=True)
    assert torch.equal(flat, before) and flat.data_ptr() == pointer
    assert one.span(37) == (0, 37) and (one.rank, one.world_size) == (0, 1)
    assert one.sum_counts((3, 4), "a test") == [3, 4]

    def never() -> None:
        raise AssertionError("a world of one waits for nothing")

    values = {"a": 1.5}
    one.sum_values(values, ["a", "b"], "a test", ready=never)
    assert values == {"a": 1.5}
    marker = object()
    assert one.broadcast_object(marker, "a test") is marker
    one.barrier("a test", slow=True)
    with CPUDevice() as device:
        first = one.sum_gradient(device, flat, "a test")
        assert one.sum_gradient(device, flat, "a test") is first
        with first as stream:
            assert stream == "compute"
        one.wait_gradient_sums(device)
        one.check_device(device)


def test_an_engine_without_collectives_is_a_world_of_one() -> None:
    model = ToyModel(ToyConfig(num_layers=2))
    with CPUDevice() as device:
        host = HostParameters(model)
        engine = Engine(model, device, host, TorchAdamW(AdamWConfig()), EngineConfig(compute_dtype=torch.float32))
        assert isinstance(engine.collectives, SingleProcess)


def _rank_main(out: str) -> None:
    group = ProcessGroupContext.from_env("cpu", timeout_s=60.0)
    with group:
        Path(out.format(group.rank)).write_text(json.dumps(_composition(group)))


if __name__ == "__main__":
    _rank_main(sys.argv[1])
