"""`slide plan` prices the run `slide train` builds: for a grid of flags, the engine config the run's engine
is built with and the buffers its plan prices equal those `slide plan --json` prints for the same flags,
and the host bytes the run's engine holds for those buffers, counted where each is allocated
(``Engine.host_allocations``, slide_core/allocation_ledger.py), are the plan's within 1 %, buffer by buffer.

Both commands build their plan inputs with one function (slide_hf/setup.py's ``plan_inputs``) and the run's
engine takes the plan's own config (``PlanInputs.engine_config``); this test is what keeps it so. The run is
recorded where its engine is built (the config handed to the engine, and the plan of the placement) and
after each of its steps (the engine's ledger, once its updates are done). Two steps, so a buffer
allocated again every step would show; with data parallel, two gloo processes, each rank against the
per-rank plan of `slide plan --nproc-per-node 2`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from slide_core.engine import Engine
from slide_core.testing import launch_ranks, wait_ranks
from slide_hf import setup
from slide_hf.adapters import token_tiles
from slide_hf.cli.plan import engine_config_dict

_BASE = ("--model", "tiny-llama", "--device", "cpu", "--seq-len", "32", "--batch-size", "2")
_STEPS = ("--steps", "2")
_TOLERANCE = 0.01
"""How far a buffer the run holds may be from the plan's price, relative to the price: rounding only (a
data-parallel rank's shards are one element shorter than the plan's longest, at most)."""

GRID: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "split master": ("--master", "split"),
    "split master, bf16 state, clipping": ("--master", "split", "--optimizer-state", "bf16", "--max-grad-norm", "1"),
    "int8 state, accumulation": ("--optimizer-state", "int8", "--grad-accum", "3"),
    "fp32 compute, clipping, accumulation": ("--dtype", "float32", "--max-grad-norm", "0.5", "--grad-accum", "2"),
    "auto master, auto placement": ("--master", "auto", "--update-placement", "auto"),
    "host placement, bf16 state": ("--update-placement", "host", "--optimizer-state", "bf16"),
    "nvme state, half": ("--offload-optimizer", "nvme", "--nvme-fraction", "0.5"),
    "nvme state, all, clipping": ("--offload-optimizer", "nvme", "--max-grad-norm", "1", "--master", "split"),
    "three slots": ("--block-slots", "3", "--optimizer-state", "bf16"),
    "state tier in memory, half": ("--offload-optimizer", "pinned", "--nvme-fraction", "0.5"),
    "tiled blocks": ("--seq-len", "512", "--seq-tile", "128"),
    "tiled blocks, clipping, accumulation": (
        "--seq-len",
        "256",
        "--seq-tile",
        "96",
        "--max-grad-norm",
        "1",
        "--grad-accum",
        "2",
    ),
}
"""`--update-placement gpu` is refused on the CPU device, by plan and train in the same words:
tests/hf/test_plan_hostile.py."""

GPU_STREAMED: dict[str, tuple[str, ...]] = {
    "gpu placement, accumulation": ("--update-placement", "gpu", "--grad-accum", "2"),
}
"""Rows of GRID whose units stream: the CPU device refuses `--update-placement gpu` in both commands, yet the
engine's streamed path runs on it as on a GPU (tests/core/test_streamed_pipeline.py), so these lift that
refusal to hold plan and run to one another. Accumulation: the streamed units' sums (Note [Streamed
accumulation] in slide_core/engine/streamed_pipeline.py)."""


@pytest.mark.parametrize("flags", list(GPU_STREAMED.values()), ids=list(GPU_STREAMED))
def test_a_gpu_streamed_plan_is_its_run(flags, slide, tmp_path: Path, monkeypatch) -> None:
    from slide_hf.planner import plan as planning

    monkeypatch.setattr(planning, "_refuse_gpu_updates", lambda inputs: None)
    status, out, err = slide("plan", *_BASE, *flags, "--json")
    assert status == 0, err
    assert json.loads(out)["engine_config"]["streamed_units"]
    test_plan_json_is_the_runs_engine_config_buffers_and_host_allocations(flags, slide, tmp_path, monkeypatch)


DATA_PARALLEL: dict[str, tuple[str, ...]] = {
    "split master, bf16 state, accumulation": ("--master", "split", "--optimizer-state", "bf16", "--grad-accum", "2"),
}
"""One pair of ranks (each costs two processes' start): the ring (which keeps its least number of chunks
whatever a rank's shards), the accumulators and every plane of a split master, sharded. The clipping
store's shards: tests/hf/test_planner_distributed.py."""


def _recorded_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record the run's engine config and its placed plan where `open_engine` builds the engine, and the
    engine's host allocations after each step (its updates done first: they allocate on first use)."""
    seen: dict[str, Any] = {"steps": []}
    built = setup.engine_config

    def recording(placement: setup.Placement) -> Any:
        config = built(placement)
        seen["engine_config"] = engine_config_dict(config)
        seen["buffers"] = placement.plan.buffers().to_dict()
        seen["host_peak_bytes"] = placement.plan.host_peak_bytes
        seen["seq_tile"] = placement.plan.inputs.seq_tile
        return config

    stepping = Engine.step

    def step(engine: Engine, *args: Any, **kwargs: Any) -> Any:
        result = stepping(engine, *args, **kwargs)
        engine.wait_idle()
        seen["steps"].append(engine.host_allocations.to_dict())
        return result

    monkeypatch.setattr(setup, "engine_config", recording)
    monkeypatch.setattr(Engine, "step", step)
    setting = token_tiles.use_seq_tile

    def use_seq_tile(model: Any, tile_tokens: int) -> None:
        seen["model_seq_tile"] = tile_tokens
        setting(model, tile_tokens)

    monkeypatch.setattr(token_tiles, "use_seq_tile", use_seq_tile)
    return seen


def _nvme(flags: tuple[str, ...], tmp_path: Path) -> tuple[str, ...]:
    if "nvme" not in flags:
        return ()
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return ("--nvme-dir", str(tmp_path / "nvme"))


def _same_allocations_every_step(steps: list[dict[str, Any]], who: str = "the run") -> dict[str, Any]:
    """The last step's ledger, after checking no step allocated a host buffer the step before had not."""
    assert len(steps) == 2, f"{who} recorded {len(steps)} steps"
    first, last = steps
    assert last["allocations"] == first["allocations"], f"{who} allocated host buffers in its second step"
    assert last["buffers"] == first["buffers"]
    return last


def _held_as_planned(planned: Mapping[str, int], held: Mapping[str, Any], who: str = "the run") -> None:
    """Every host buffer the plan prices is what the engine holds for it within ``_TOLERANCE``, and the
    engine holds no buffer the plan does not price; a failure lists every buffer, with its owners."""
    rows, drifted = [], []
    for buffer in sorted(set(planned) | set(held["buffers"])):
        price, holds = planned.get(buffer, 0), held["buffers"].get(buffer, 0)
        owners = ", ".join(f"{owner} {nbytes}" for owner, nbytes in held["owners"].get(buffer, {}).items())
        off = abs(holds - price) > _TOLERANCE * price
        rows.append(f"{'DRIFT' if off else 'ok':>5} {buffer}: planned {price}, {who} holds {holds} ({owners or '-'})")
        drifted += [buffer] if off else []
    assert not drifted, f"{', '.join(drifted)} drifted from the plan:\n" + "\n".join(rows)


@pytest.mark.parametrize("flags", list(GRID.values()), ids=list(GRID))
def test_plan_json_is_the_runs_engine_config_buffers_and_host_allocations(
    flags, slide, tmp_path: Path, monkeypatch
) -> None:
    status, out, err = slide("plan", *_BASE, *flags, "--json")
    assert status == 0, err
    planned = json.loads(out)

    seen = _recorded_run(monkeypatch)
    run = ("train", *_BASE, *flags, *_nvme(flags, tmp_path), *_STEPS, "--output", str(tmp_path / "run"))
    status, _, err = slide(*run)
    assert status == 0, err
    assert seen["engine_config"] == planned["engine_config"]
    assert seen["buffers"] == planned["buffers"]
    assert seen["host_peak_bytes"] == planned["host_peak_bytes"]
    # the tile the plan priced is the one the run's blocks take (--seq-tile auto included)
    assert seen["seq_tile"] == seen["model_seq_tile"] == planned["seq_tile"]
    _held_as_planned(planned["buffers"]["host"], _same_allocations_every_step(seen["steps"]))


_RANK = """
import json, os, sys
from slide_core.engine import Engine
from slide_hf import setup
from slide_hf.adapters import token_tiles
from slide_hf.cli.main import main
from slide_hf.cli.plan import engine_config_dict

record, argv = sys.argv[1], sys.argv[2:]
seen = {"steps": []}
built, stepping = setup.engine_config, Engine.step

def recording(placement):
    config = built(placement)
    seen["engine_config"] = engine_config_dict(config)
    seen["buffers"] = placement.plan.buffers().to_dict()
    return config

def step(engine, *args, **kwargs):
    result = stepping(engine, *args, **kwargs)
    engine.wait_idle()
    seen["steps"].append(engine.host_allocations.to_dict())
    return result

setup.engine_config, Engine.step = recording, step
status = main(argv)
with open(os.path.join(record, f"rank{os.environ['RANK']}.json"), "w") as out:
    json.dump(seen, out)
sys.exit(status)
"""
"""One rank of `slide train` (torchrun's variables set by ``launch_ranks``), recorded as the in-process
run above is, into ``rank<RANK>.json`` of the folder its first argument names."""


@pytest.mark.parametrize("flags", list(DATA_PARALLEL.values()), ids=list(DATA_PARALLEL))
@pytest.mark.slow
def test_each_gloo_rank_is_the_per_rank_plan(flags, slide, tmp_path: Path) -> None:
    """Two gloo ranks on the CPU device: each rank's engine config and plan are `slide plan
    --nproc-per-node 2`'s, and what each rank's engine holds is the plan's per-rank host buffers (its
    shards of the master, the state, the accumulators and the ring or store; the rest as one process)."""
    status, out, err = slide("plan", *_BASE, *flags, "--nproc-per-node", "2", "--json")
    assert status == 0, err
    planned = json.loads(out)
    per_rank = planned["data_parallel"]["host_rank_breakdown"]

    record = tmp_path / "ranks"
    record.mkdir()
    argv = ("train", *_BASE, *flags, *_STEPS, "--output", str(tmp_path / "run"))
    command = [sys.executable, "-c", _RANK, str(record), *argv]
    finished = wait_ranks(launch_ranks(command, 2, stdout=subprocess.DEVNULL), 240.0)
    for rank, (code, rank_err) in enumerate(finished):
        assert code == 0, f"rank {rank} failed:\n{rank_err[-3000:]}"
    for rank in range(2):
        seen = json.loads((record / f"rank{rank}.json").read_text())
        assert seen["engine_config"] == planned["engine_config"], f"rank {rank}"
        assert seen["buffers"] == planned["buffers"], f"rank {rank}"
        held = _same_allocations_every_step(seen["steps"], f"rank {rank}")
        _held_as_planned({key: per_rank[key] for key in planned["buffers"]["host"]}, held, f"rank {rank}")


def test_plan_prices_the_clipping_store(slide) -> None:
    """`--max-grad-norm` is a plan option: with it on, the step's gradients are kept whole in a pinned store
    (2 bytes per sliding parameter in bf16), where without it a ring of chunks holds them."""
    status, out, err = slide("plan", *_BASE, "--json")
    assert status == 0, err
    ring = json.loads(out)["buffers"]["host"]["grad_ring"]
    status, out, err = slide("plan", *_BASE, "--max-grad-norm", "1", "--json")
    assert status == 0, err
    planned = json.loads(out)
    store = planned["buffers"]["host"]["grad_ring"]
    assert planned["engine_config"]["max_grad_norm"] == 1.0
    assert store != ring
    assert store >= 2 * planned["params"]  # every parameter's bf16 gradient (units are padded, never smaller)


def test_a_plan_that_streams_every_unit_and_does_not_fit_the_host_is_one_verdict(slide) -> None:
    """The host hint tries NVMe state for units that stream: a streamed unit keeps its state in RAM (it
    travels with the unit), so the trial offloads the others and the plan says what to do, not a bug."""
    argv = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "24GiB", "--update-placement", "gpu")
    status, out, err = slide(*argv, "--host-memory", "16GiB", "--json")
    assert status == 0, err
    planned = json.loads(out)
    assert planned["fits"] is False and "host RAM" in planned["problem"]
    streamed = set(planned["engine_config"]["streamed_units"])
    assert streamed and not streamed & set(planned["engine_config"]["offloaded_units"])
