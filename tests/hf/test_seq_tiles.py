"""slide_hf/planner/seq_tiles.py: the plan of a long sequence with the blocks' MLPs tiled, and the longest
``--seq-len`` that fits a GPU budget (`slide plan`'s "longest seq-len" line and JSON keys)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from slide_hf import build_model, resolve_model
from slide_hf import setup as run_setup
from slide_hf.defaults import AUTO_SEQ_TILE_FLOOR
from slide_hf.planner import PlanInputs, make_plan
from slide_hf.planner.auto_tile import auto_seq_tile
from slide_hf.planner.seq_fit import longest_seq_len
from slide_hf.presets import run_overrides

GiB = 1 << 30
SEQ, TILE = 65536, 8192
BLOCK_WORKSPACE_FACTOR = 1.45  # slide_hf/planner/memory.py's: the backward's excess over the saved bytes


@pytest.fixture(scope="module")
def llama8b() -> Any:
    config, _ = resolve_model("llama3.1-8b", **run_overrides("llama3.1-8b"))
    return build_model(config)


def test_tiling_lowers_the_backward_by_the_intermediates_it_no_longer_keeps(llama8b: Any) -> None:
    """Untiled, each token's MLP saves gate, act(gate), up and their product (4 x 14,336 bf16 values) and
    each of the two RMSNorms at most two fp32 copies of its input; tiled, one tile's worth of them, and the
    tiling adds two input-gradient buffers, one tile's MLP weight gradients and their fp32 sums."""
    untiled = make_plan(PlanInputs(llama8b, seq_len=SEQ, seq_tile=0))
    tiled = make_plan(PlanInputs(llama8b, seq_len=SEQ, seq_tile=TILE))
    assert tiled.gpu_peak_bytes < untiled.gpu_peak_bytes
    hidden, inner, d = 4096, 14336, 2
    buffers = 2 * SEQ * hidden * d + 3 * hidden * inner * (d + 4)
    mlp_saved = 4 * inner * d * (SEQ - TILE)
    norms_saved_at_most = 2 * 2 * hidden * 4 * (SEQ - TILE)
    saved = untiled.gpu_phases["backward"] - tiled.gpu_phases["backward"]
    assert BLOCK_WORKSPACE_FACTOR * mlp_saved - buffers < saved
    assert saved <= BLOCK_WORKSPACE_FACTOR * (mlp_saved + norms_saved_at_most) - buffers
    # the no-grad forward holds one tile's gate, up and act instead of the sequence's
    assert tiled.gpu_phases["forward"] < untiled.gpu_phases["forward"]


def test_below_a_tile_nothing_changes(llama8b: Any) -> None:
    short = PlanInputs(llama8b, seq_len=4096, batch_size=2)
    assert make_plan(dataclasses.replace(short, seq_tile=TILE)).gpu_phases == make_plan(short).gpu_phases
    # 8 x 4096 tokens exceed a tile of 8192: the micro-batch is tiled, as the engine tiles it
    longer = dataclasses.replace(short, batch_size=8)
    tiled = make_plan(dataclasses.replace(longer, seq_tile=TILE))
    assert tiled.gpu_phases["backward"] < make_plan(longer).gpu_phases["backward"]


@pytest.mark.parametrize("seq_tile", [None, 0, 4096])
def test_longest_seq_len_is_the_edge_of_the_budget(llama8b: Any, seq_tile: int | None) -> None:
    """A plan at the longest length fits the budget at batch 1, one at 1.1 times that length does not
    (``None``: ``--seq-tile auto``, which chooses its tile at each length)."""
    budget = 24 * GiB
    inputs = PlanInputs(llama8b, seq_len=2048, gpu_memory_bytes=budget)
    longest = longest_seq_len(inputs, budget, seq_tile)
    assert longest > 0

    def peak(seq_len: int) -> int:
        at = dataclasses.replace(inputs, seq_len=seq_len)
        tile = auto_seq_tile(at, budget) if seq_tile is None else seq_tile
        return make_plan(dataclasses.replace(at, seq_tile=tile)).gpu_peak_bytes

    assert peak(longest) <= budget < peak(longest + 1)
    assert peak(int(longest * 1.1)) > budget


def _peak(inputs: PlanInputs, tile: int) -> int:
    return make_plan(dataclasses.replace(inputs, seq_tile=tile)).gpu_peak_bytes


def test_auto_runs_untiled_where_that_fits(llama8b: Any) -> None:
    inputs = PlanInputs(llama8b, seq_len=SEQ)
    assert auto_seq_tile(inputs, _peak(inputs, 0)) == 0
    assert auto_seq_tile(inputs, None) == TILE  # no GPU budget: the fixed default above 8192 tokens


def test_auto_takes_the_largest_tile_that_fits(llama8b: Any) -> None:
    """The priced peak grows with the tile; auto takes the first power of two from the top that fits."""
    inputs = PlanInputs(llama8b, seq_len=SEQ)
    peaks = {tile: _peak(inputs, tile) for tile in (0, 32768, 16384, 8192, 4096, 1024, 512, 256)}
    assert peaks[256] < peaks[512] < peaks[1024] < peaks[4096] < peaks[8192] < peaks[16384] < peaks[32768]
    assert auto_seq_tile(inputs, peaks[8192]) == 8192
    assert auto_seq_tile(inputs, peaks[16384] - 1) == 8192
    # below the floor of 1024 only where nothing from it up fits
    assert auto_seq_tile(inputs, peaks[1024]) == 1024
    assert auto_seq_tile(inputs, peaks[512]) == 512
    # nothing fits: the floor, whose plan then says by how much
    assert auto_seq_tile(inputs, peaks[256] - 1) == AUTO_SEQ_TILE_FLOOR


def test_auto_below_the_floor_of_a_short_micro_batch(llama8b: Any) -> None:
    inputs = PlanInputs(llama8b, seq_len=600)
    assert auto_seq_tile(inputs, 1) == 512  # nothing fits, and no tile from the floor up is below 600 tokens


def test_tiling_lengthens_the_longest_sequence(llama8b: Any) -> None:
    inputs = PlanInputs(llama8b, gpu_memory_bytes=24 * GiB)
    assert longest_seq_len(inputs, 24 * GiB, TILE) > 1.5 * longest_seq_len(inputs, 24 * GiB, 0)


@pytest.fixture
def _fused_loss_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_setup, "fused_loss_available", lambda: True)


def test_slide_plan_reports_the_longest_seq_len(slide: Any, _fused_loss_installed: None) -> None:
    """`slide plan` says how long a sequence fits at batch 1 and what the planned one needs; planning at that
    length fits, at 1.1 times that length it does not (``--check``: exit 2)."""
    base = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "16", "--host-memory", "4096GiB", "--batch-size", "1")
    status, out, err = slide(*base, "--seq-len", "131072", "--json")
    assert status == 0, err
    plan = json.loads(out)
    # auto: nothing fits 16 GiB at 131072 tokens, so the floor (the plan says by how much)
    assert plan["seq_tile"] == AUTO_SEQ_TILE_FLOOR and plan["seq_tile_source"] == "auto"
    assert plan["seq_len_gpu_bytes"] == plan["gpu_peak_bytes"] > 16 * GiB  # does not fit: nothing placed
    longest = plan["longest_seq_len"]
    assert 0 < longest < 131072 and plan["longest_seq_len_limit"] == "gpu"
    status, out, err = slide(*base, "--seq-len", str(longest), "--check")
    assert status == 0, err
    assert f"{longest:,}" in out and "longest seq-len" in out
    status, _, err = slide(*base, "--seq-len", str(int(longest * 1.1)), "--check")
    assert status == 2 and "GPU memory" in err
    status, out, err = slide(*base, "--seq-len", "131072", "--seq-tile", "0", "--json")
    assert status == 0, err
    untiled = json.loads(out)
    assert untiled["seq_tile"] == 0 and untiled["gpu_peak_bytes"] > plan["gpu_peak_bytes"]
    assert untiled["longest_seq_len"] < longest and untiled["seq_tile_source"] == "--seq-tile"


def test_slide_plan_chooses_the_tile_that_fits(slide: Any, _fused_loss_installed: None) -> None:
    """With a budget that holds 131072 tokens of Llama-3.1-8B tiled but not untiled, `slide plan` prints the
    tile it chose, and the run at that tile fits; ``--seq-tile auto`` is the default spelled out."""
    base = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "40", "--host-memory", "4096GiB", "--batch-size", "1")
    base += ("--no-packing",)  # packed rows need (S x S) masks with SDPA: tests/hf/test_attention_masks.py
    status, out, err = slide(*base, "--seq-len", "131072", "--json")
    assert status == 0, err
    plan = json.loads(out)
    assert plan["fits"] and plan["seq_tile"] >= AUTO_SEQ_TILE_FLOOR and plan["seq_tile_source"] == "auto"
    status, out, err = slide(*base, "--seq-len", "131072", "--seq-tile", "auto", "--json")
    assert status == 0, err
    assert json.loads(out)["seq_tile"] == plan["seq_tile"]
    status, out, err = slide(*base, "--seq-len", "131072")
    assert status == 0, err
    assert f"tiles of {plan['seq_tile']:,} tokens, --seq-tile auto" in out


def test_the_models_positions_end_the_search(slide: Any, _fused_loss_installed: None) -> None:
    """On a host that holds it (the length search counts host RAM too: this machine's would stop it)."""
    argv = ["--gpu-memory", "80", "--host-memory", "1TiB", "--seq-len", "131072", "--batch-size", "1", "--json"]
    status, out, err = slide("plan", "--model", "llama3.1-8b", *argv)
    assert status == 0, err
    plan = json.loads(out)
    assert plan["longest_seq_len"] == 131072 and plan["longest_seq_len_limit"] == "positions"


def test_the_default_tile_without_a_budget_engages_only_past_it() -> None:
    from slide_hf.defaults import DEFAULT_SEQ_TILE, resolve_seq_tile

    assert resolve_seq_tile(None, DEFAULT_SEQ_TILE) == 0
    assert resolve_seq_tile(None, DEFAULT_SEQ_TILE + 1) == DEFAULT_SEQ_TILE
    assert resolve_seq_tile(0, 1 << 20) == 0 and resolve_seq_tile(512, 100) == 512


def test_a_negative_tile_is_one_line(slide: Any) -> None:
    status, _, err = slide("plan", "--model", "tiny-llama", "--seq-tile", "-1")
    assert status == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "--seq-tile" in err


def test_auto_tiles_a_micro_batch_of_short_rows_that_does_not_fit_untiled(slide: Any) -> None:
    """Tiles count the micro-batch's tokens: 64 rows of 2048 tokens of Llama-3.1-8B do not fit 24 GiB untiled
    (tests/hf/test_cli_plan.py), and auto tiles them until they do."""
    argv = ("plan", "--model", "llama3.1-8b", "--batch-size", "64", "--gpu-memory", "24GiB", "--host-memory", "1TiB")
    status, out, err = slide(*argv, "--no-packing", "--json")
    assert status == 0, err
    plan = json.loads(out)
    assert plan["fits"] and 0 < plan["seq_tile"] < 64 * 2048 and plan["seq_tile_source"] == "auto"
