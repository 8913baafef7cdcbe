"""`slide plan` prices the run `slide train` builds: for a grid of flags, the engine config the run's engine
is built with and the buffers its plan prices equal those `slide plan --json` prints for the same flags.

Both commands build their plan inputs with one function (slide_hf/setup.py's ``plan_inputs``) and the run's
engine takes the plan's own config (``PlanInputs.engine_config``); this test is what keeps it so. The run is
recorded where its engine is built: the config handed to the engine, and the plan of the placement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from slide_hf import setup
from slide_hf.cli.plan import engine_config_dict

_BASE = ("--model", "tiny-llama", "--device", "cpu", "--seq-len", "32", "--batch-size", "2")

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
}


def _recorded_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record the run's engine config and its placed plan where `open_engine` builds the engine."""
    seen: dict[str, Any] = {}
    built = setup.engine_config

    def recording(placement: setup.Placement) -> Any:
        config = built(placement)
        seen["engine_config"] = engine_config_dict(config)
        seen["buffers"] = placement.plan.buffers().to_dict()
        seen["host_peak_bytes"] = placement.plan.host_peak_bytes
        return config

    monkeypatch.setattr(setup, "engine_config", recording)
    return seen


@pytest.mark.parametrize("flags", list(GRID.values()), ids=list(GRID))
def test_plan_json_is_the_runs_engine_config_and_buffers(flags, slide, tmp_path: Path, monkeypatch) -> None:
    nvme = ("--nvme-dir", str(tmp_path / "nvme")) if "nvme" in flags else ()
    (tmp_path / "nvme").mkdir()
    status, out, err = slide("plan", *_BASE, *flags, "--json")
    assert status == 0, err
    planned = json.loads(out)

    seen = _recorded_run(monkeypatch)
    status, _, err = slide("train", *_BASE, *flags, *nvme, "--steps", "1", "--output", str(tmp_path / "run"))
    assert status == 0, err
    assert seen["engine_config"] == planned["engine_config"]
    assert seen["buffers"] == planned["buffers"]
    assert seen["host_peak_bytes"] == planned["host_peak_bytes"]


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
