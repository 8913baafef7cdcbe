"""Shared fixtures for the slide-hf tests: tiny HF reference models and a plain-torch unit runner.

The runner does what the engine does, minus the sliding window: bind leaf tensors per unit, run
embedding -> blocks -> head with autograd, divide the head's loss sum by ``loss_token_count``. Helpers
are exposed as fixtures (not imported from here) so this file never clashes with other test folders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel
from slide_hf import PRESETS, build_model, load_config, load_weights

BATCH, SEQ = 2, 12  # SEQ > the test presets' sliding windows (4)


@dataclass
class Reference:
    """An HF model saved to ``path``, and our model loaded from that directory."""

    hf: Any
    path: Path
    model: SlideModel
    host: HostParameters


def make_reference(preset: str, path: Path, *, attn: str = "eager", seed: int = 0, **save: Any) -> Reference:
    config = PRESETS[preset]()
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval()
    hf.save_pretrained(path, **save)
    loaded = load_config(path)
    loaded._attn_implementation = attn
    model = build_model(loaded)
    host = HostParameters(model)
    load_weights(model, host, path)
    return Reference(hf, path, model, host)


def batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with some ignored positions (a prompt prefix and a hole)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7] = -100
    return ids, labels


def leaves_of(model: SlideModel, host: HostParameters, dtype: torch.dtype = torch.float32) -> dict:
    """Per-unit leaf copies of the host views, as the engine would bind them."""
    return {
        u.name: {n: v.detach().to(dtype).clone().requires_grad_(True) for n, v in host.views(u).items()}
        for u in model.units
    }


def head_params(model: SlideModel, leaves: dict) -> dict[str, torch.Tensor]:
    params = dict(leaves[model.head.name])
    for mine, theirs in model.head.borrowed.items():
        params[mine] = leaves[model.embedding.name][theirs]
    return params


def hidden_through_blocks(model: SlideModel, leaves: dict, ids: torch.Tensor, inputs: Any) -> torch.Tensor:
    x = model.embedding.forward(leaves[model.embedding.name], ids, inputs)
    for block in model.blocks:
        x = block.forward(leaves[block.name], x, inputs)
    return x


def run_units(
    model: SlideModel, leaves: dict, ids: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Mean loss over label tokens, differentiable w.r.t. ``leaves``."""
    inputs = model.prepare_inputs(ids, labels, dtype)
    x = hidden_through_blocks(model, leaves, ids, inputs)
    return model.head.forward(head_params(model, leaves), x, inputs) / model.loss_token_count(labels)


def hf_param(reference: Reference, unit_name: str, param: str) -> torch.nn.Parameter:
    unit = next(u for u in reference.model.units if u.name == unit_name)
    return reference.hf.get_parameter(unit.checkpoint_names[param])


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error (element-wise would blow up on near-zero gradient entries)."""
    denom = expected.float().norm().item()
    diff = (actual.float() - expected.float()).norm().item()
    return diff / denom if denom > 0 else diff


def eager_hf_model(preset: str, seed: int = 0) -> Any:
    """transformers' model of ``preset`` (eager attention, fp32, eval: units run without dropout so a
    recomputed block reproduces its forward, and so does the reference)."""
    config = PRESETS[preset]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


def accumulation_batches(vocab: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` steps of two accumulated micro-batches (2 x 12 tokens, a masked prompt), seeded."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(2):
            ids = torch.randint(0, vocab, (2, 12), generator=generator)
            labels = ids.clone()
            labels[1, :4] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def hf_adamw_losses(hf: Any, batches: list, *, lr: float, weight_decay: float) -> list[float]:
    """Train ``hf`` (transformers' model and loss) with ``torch.optim.AdamW`` under HF's weight-decay
    convention (decay on >= 2-dim params), the loss of each step normalised over all its micro-batches'
    label tokens as the engine does; return the per-step losses. The reference of the engine tests."""
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    losses = []
    for micro in batches:
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            per_batch = int((labels[:, 1:] != -100).sum())
            loss = hf(ids, labels=labels).loss * per_batch  # HF returns the mean over this micro-batch
            (loss / tokens).backward()
            total += loss.item()
        losses.append(total / tokens)
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.fixture
def reference(tmp_path: Path) -> Callable[..., Reference]:
    return lambda preset, **kw: make_reference(preset, tmp_path / preset, **kw)


@pytest.fixture
def helpers() -> Any:
    """The functions above, for test modules (``helpers.run_units(...)``)."""

    class _Helpers:
        BATCH = BATCH
        SEQ = SEQ

    for fn in (
        batch,
        leaves_of,
        head_params,
        hidden_through_blocks,
        run_units,
        hf_param,
        rel_err,
        hf_adamw_losses,
        eager_hf_model,
        accumulation_batches,
    ):
        setattr(_Helpers, fn.__name__, staticmethod(fn))
    return _Helpers
