"""`slide plan`'s "max batch" and "longest seq-len" are plans of their own: the batch and the length they
print, planned again as ``--batch-size`` and ``--seq-len``, fit, with the tile ``--seq-tile auto`` takes for
them (slide_hf/planner/plan.py's ``largest_batch``, slide_hf/planner/seq_fit.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from slide_hf import build_model, resolve_model
from slide_hf.cli import plan as plan_command
from slide_hf.options import RULES
from slide_hf.planner import PlanInputs, largest_batch
from slide_hf.planner.auto_tile import auto_seq_tile
from slide_hf.presets import run_overrides

GiB = 1 << 30
LLAMA_24 = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "24GiB")


@pytest.fixture
def _any_output_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """An output disk that holds the checkpoints: these tests are about GPU and host memory, and an 8B model's
    checkpoint outgrows a small test machine's free disk, which `slide plan` also reports as not fitting."""
    monkeypatch.setattr(plan_command, "_output_disk_problem", lambda directory, outputs: None)


@pytest.fixture(scope="module")
def llama8b() -> Any:
    config, _ = resolve_model("llama3.1-8b", **run_overrides("llama3.1-8b"))
    return build_model(config)


def _plan(slide: Any, *argv: str) -> dict[str, Any]:
    status, out, err = slide(*argv, "--json")
    assert status == 0, err
    return json.loads(out)


# ---- the tile auto proposes ------------------------------------------------------------------------------
def test_auto_never_proposes_a_tile_past_the_options_bound(slide: Any) -> None:
    """A micro-batch of more than 2^24 tokens: auto's tiles stop at the largest ``--seq-tile`` accepts, so the
    plan answers instead of refusing an option the user never gave."""
    bound = RULES["seq_tile"].high
    assert bound is not None
    status, out, err = slide(
        "plan", "--model", "tiny-llama", "--gpu-memory", "24GiB", "--batch-size", "20000", "--json"
    )
    assert status == 0, err
    plan = json.loads(out)
    assert plan["seq_tile_source"] == "auto" and 0 < plan["seq_tile"] <= bound
    assert plan["inputs"]["batch_size"] * plan["inputs"]["seq_len"] > 2 * bound


def test_auto_on_a_micro_batch_past_the_bound_when_nothing_fits(llama8b: Any) -> None:
    """257 rows of 131072 tokens: nothing fits 80 GiB, and auto's answer is still a tile a run accepts."""
    inputs = PlanInputs(llama8b, batch_size=257, seq_len=131072, gpu_memory_bytes=80 * GiB)
    tile = auto_seq_tile(inputs, 80 * GiB)
    assert 0 < tile <= RULES["seq_tile"].high
    assert dataclasses.replace(inputs, seq_tile=tile).seq_tile == tile  # PlanInputs takes it


# ---- max batch -------------------------------------------------------------------------------------------
def test_max_batch_does_not_depend_on_the_planned_batch(slide: Any, _any_output_disk: None) -> None:
    """The same budget gives the same max batch whatever ``--batch-size`` is planned, and that batch, planned,
    fits (with the tile auto takes for it), one more does not."""
    base = (*LLAMA_24, "--host-memory", "256GiB")
    answers = {b: _plan(slide, *base, "--batch-size", str(b))["max_batch_size"] for b in (1, 8, 20)}
    best = answers[1]
    assert set(answers.values()) == {best} and best > 20, answers
    at_best = _plan(slide, *base, "--batch-size", str(best))
    assert at_best["problem"] is None and at_best["max_batch_size"] == best
    assert at_best["seq_tile_source"] == "auto" and at_best["seq_tile"] > 0  # untiled, it would not fit
    past = _plan(slide, *base, "--batch-size", str(best + 1))
    assert past["problem"] is not None and "GPU memory" in past["problem"]


def test_a_given_tile_stays_fixed_in_the_search(llama8b: Any) -> None:
    """With ``--seq-tile`` given (here 0, untiled) every batch is tried untiled, as the run takes it; with the
    tile auto chose, each batch is tried with the tile auto takes for it, which holds more."""
    budget = 24 * GiB
    given = PlanInputs(llama8b, seq_len=2048, seq_tile=0, gpu_memory_bytes=budget)
    fixed, _ = largest_batch(given, gpu_cap=budget, host_cap=None)
    assert fixed > 0
    at = dataclasses.replace(given, batch_size=fixed)
    assert largest_batch(at, gpu_cap=budget, host_cap=None)[0] == fixed
    auto = dataclasses.replace(given, seq_tile=auto_seq_tile(given, budget))
    assert auto.seq_tile == 0  # the same tile as given, but chosen by auto
    chosen, _ = largest_batch(auto, gpu_cap=budget, host_cap=None)
    assert chosen > fixed
    at_chosen = dataclasses.replace(auto, batch_size=chosen)
    assert largest_batch(at_chosen, gpu_cap=budget, host_cap=None)[0] == chosen


# ---- longest seq-len -------------------------------------------------------------------------------------
def test_longest_seq_len_fits_the_host_too(slide: Any, _any_output_disk: None) -> None:
    """Where host RAM stops the length before the GPU does, the longest length is host RAM's: planned, it
    fits; one token more needs more host RAM than there is."""
    base = (*LLAMA_24, "--host-memory", "105GiB")
    plan = _plan(slide, *base)
    longest = plan["longest_seq_len"]
    assert longest and plan["longest_seq_len_limit"] == "host"
    at_longest = _plan(slide, *base, "--seq-len", str(longest))
    assert at_longest["problem"] is None
    past = _plan(slide, *base, "--seq-len", str(longest + 1))
    assert past["problem"] is not None and "host RAM" in past["problem"] and "GPU memory" not in past["problem"]


def test_longest_seq_len_of_a_roomy_host_is_still_the_gpus(slide: Any) -> None:
    plan = _plan(slide, *LLAMA_24, "--host-memory", "1TiB")
    assert plan["longest_seq_len"] and plan["longest_seq_len_limit"] == "gpu"


def test_the_longest_row_names_host_ram_when_it_stops_the_search(slide):
    status, out, err = slide("plan", "--model", "llama3.1-8b", "--gpu-memory", "24GiB", "--host-memory", "105GiB")
    assert status == 0, err
    (row,) = [line for line in out.splitlines() if line.startswith("longest seq-len")]
    assert "limited by host RAM" in row, row
