"""slide_hf/planner/attention_masks.py: the (S x S) masks a plan prices are the masks the adapters' inputs hold
(HF's own builders, through ``prepare_inputs``), and `slide plan` says what they cost and what removes them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from slide_hf import build_model
from slide_hf import setup as run_setup
from slide_hf.planner import PlanInputs, make_plan
from slide_hf.planner.attention_masks import attention_masks
from slide_hf.presets import PRESETS

GiB = 1 << 30
PRESETS_WITH_MASKS = ["test-llama", "test-olmo3", "test-gemma3", "test-llama4"]
"""Full attention only; sliding layers (window 4); capped layers (eager on the CPU); chunked layers."""


def _held_by_inputs(model: Any, batch: int, seq: int, packed: bool) -> int:
    """Bytes of the mask tensors ``prepare_inputs`` builds for one micro-batch on the CPU in fp32."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    positions = None
    if packed:  # two documents per row
        half = seq // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq - half)]).repeat(batch, 1)
    inputs = model.prepare_inputs(ids, ids, torch.float32, position_ids=positions)
    return sum(mask.numel() * mask.element_size() for mask in inputs.masks.values() if isinstance(mask, torch.Tensor))


@pytest.mark.parametrize("preset", PRESETS_WITH_MASKS)
@pytest.mark.parametrize("seq", [4, 24])
@pytest.mark.parametrize("packed", [False, True])
def test_priced_masks_are_the_masks_the_inputs_hold(preset: str, seq: int, packed: bool) -> None:
    model = build_model(PRESETS[preset]())
    held = _held_by_inputs(model, 2, seq, packed)
    inputs = PlanInputs(model, batch_size=2, seq_len=seq, packed_rows=packed, compute_dtype_bytes=4, accelerator=False)
    masks = attention_masks(inputs)
    assert masks.held_bytes == held
    assert masks.any == (held > 0)


def test_flash_attention_builds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(PRESETS["test-olmo3"]())
    inputs = PlanInputs(model, batch_size=1, seq_len=64, packed_rows=True)
    assert attention_masks(inputs).any  # sdpa on a GPU without flash-attn: sliding and packed masks
    monkeypatch.setattr(
        type(model),
        "attention_for",
        lambda self, device, dtype: dict.fromkeys(("sliding_attention", "full_attention"), "flash_attention_2"),
    )
    assert not attention_masks(inputs).any


def test_the_gpu_peak_carries_the_masks_and_one_calls_bias() -> None:
    """Held masks are persistent over the step; SDPA's additive copy of a boolean mask adds to the phases a
    block runs in, in the compute dtype."""
    model = build_model(PRESETS["test-olmo3"]())
    plain = PlanInputs(model, batch_size=1, seq_len=2048)
    packed = PlanInputs(model, batch_size=1, seq_len=2048, packed_rows=True)
    masks = attention_masks(packed)
    assert [kind for kind, _ in masks.layers] == ["sliding_attention", "full_attention"]
    assert masks.held_bytes == 2 * 2048 * 2048 and masks.call_bytes == 2048 * 2048 * 2
    assert attention_masks(plain).held_bytes == 2048 * 2048  # the sliding layers' alone
    assert make_plan(packed).gpu_peak_bytes - make_plan(plain).gpu_peak_bytes == 2048 * 2048


@pytest.fixture
def _fused_loss_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_setup, "fused_loss_available", lambda: True)


def test_slide_plan_prices_packed_rows_and_names_the_fix(slide: Any, _fused_loss_installed: None) -> None:
    """Llama-3.1-8B at 131,072 tokens with SDPA: packed rows need a 16 GiB mask and a 32 GiB bias per call,
    which no GPU of 40 GiB holds; the plan says so and names flash-attn and --no-packing. Unpacked rows
    need no mask (SDPA's causal path) and fit."""
    base = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "40", "--host-memory", "4096GiB", "--batch-size", "1")
    status, out, err = slide(*base, "--seq-len", "131072", "--json")
    assert status == 0, err
    packed = json.loads(out)
    assert packed["attention_masks"] == {
        "layers": {"full_attention": "sdpa"},
        "held_bytes": 16 * GiB,
        "call_bytes": 32 * GiB,
    }
    assert not packed["fits"]
    assert "attention masks" in packed["problem"] and "flash-attn" in packed["problem"]
    assert "--no-packing" in packed["problem"]
    status, out, err = slide(*base, "--seq-len", "131072", "--no-packing", "--json")
    assert status == 0, err
    unpacked = json.loads(out)
    assert unpacked["fits"] and unpacked["attention_masks"]["held_bytes"] == 0
    status, out, err = slide(*base, "--seq-len", "131072")
    assert status == 0, err
    assert "attention masks" in out and "pip install flash-attn" in out
