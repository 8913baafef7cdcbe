"""Packed rows through HF families: masks per document, and training equal to HF over separate documents.

Rows packed with several documents carry position ids that restart at 0 for each document and label -100
on each document's first token. Trained through the engine (fp32, CPU device) they must equal HF's own
model run on every document separately. See ``HFCausalLM.prepare_inputs`` and Note [Packed micro-batches]
in slide_core/engine/micro_batch.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_hf import PRESETS, build_model, load_config, load_weights
from slide_hf.model import checkpoint_entries

LR = 3e-3
EPS = 1e-6
"""Adam's epsilon for the one-step comparison. Adam's first step is ``lr * g / (|g| + eps)``: packed rows
and separate documents sum attention in different orders (gradients agree to ~4e-7 relative), and with
eps 1e-8 a gradient entry near zero turns that rounding noise into a step of up to ``lr``. 1e-6 bounds the
amplification (``lr * noise / (4 * eps)``) while every other entry still takes a full step; a packing bug
moves gradients by far more than either."""
ROWS = [(7, 5, 4), (9, 7)]
"""Document lengths of the two packed rows (16 tokens each); 7 and 9 exceed the presets' window of 4."""

FAMILIES = {
    "test-llama": {},
    "test-qwen3": {},
    "test-gemma2": {"attn_logit_softcapping": None},  # HF's sdpa path has no attention-logit softcap
    "test-mistral": {},  # every layer sliding (window 4)
}


class MicroBatch(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def _documents(vocab: int, rows=ROWS, seed: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (n,), generator=g) for n in lengths] for lengths in rows]


def _pack(rows: list[list[torch.Tensor]]) -> MicroBatch:
    """One micro-batch of packed rows: position ids restart per document, its first label is -100."""
    ids = torch.stack([torch.cat(docs) for docs in rows])
    labels = torch.stack([torch.cat([torch.cat((torch.tensor([-100]), doc[1:])) for doc in docs]) for docs in rows])
    positions = torch.stack([torch.cat([torch.arange(doc.numel()) for doc in docs]) for docs in rows])
    return MicroBatch(ids, labels, positions)


def _pair(preset: str, attn: str, path: Path, overrides: dict[str, Any]):
    """HF's model (fp32, eval, weights moved off their init) and ours loaded from its saved checkpoint,
    both with ``attn``."""
    config = PRESETS[preset]()
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval()
    with torch.no_grad():  # away from the init, as a trained checkpoint is: Gemma's norms start at exactly 0,
        for param in hf.parameters():  # where the weight after one step would be the step itself
            param.add_(torch.randn_like(param), alpha=0.1)
    hf.save_pretrained(path)
    loaded = load_config(path)
    loaded._attn_implementation = attn
    model = build_model(loaded)
    return hf, model


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (sdpa) or additive (eager) 4-d mask as 'may attend'."""
    return mask if mask.dtype == torch.bool else mask == 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["test-llama", "test-mistral", "test-qwen2", "test-gemma2"])
def test_packed_masks_equal_hf_detection(preset: str, attn: str) -> None:
    """Our masks for packed rows are the ones HF builds when it finds the documents from the position ids
    itself, are materialized (no ``is_causal`` shortcut), and are causal (and sliding) per document."""
    config = PRESETS[preset]()
    config._attn_implementation = attn
    if preset == "test-gemma2":
        config.attn_logit_softcapping = None  # sdpa cannot apply it (the adapters refuse the pair)
    model = build_model(config)
    batch = _pack(_documents(config.vocab_size))
    inputs = model.prepare_inputs(batch.input_ids, batch.labels, torch.float32, position_ids=batch.position_ids)
    probe = torch.empty((*batch.input_ids.shape, 0))
    builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    assert set(inputs.masks) == {block.attention_type for block in model.blocks}
    document = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)] for lengths in ROWS])
    q, k = torch.arange(16)[:, None], torch.arange(16)[None, :]
    for kind, mask in inputs.masks.items():
        hf_detected = builders[kind](
            config=model.config,
            inputs_embeds=probe,
            attention_mask=None,
            past_key_values=None,
            position_ids=batch.position_ids,
        )
        assert mask is not None and hf_detected is not None
        assert torch.equal(mask, hf_detected), kind
        expected = (document[:, :, None] == document[:, None, :]) & (k <= q)
        if kind == "sliding_attention":
            expected &= q - k < model.config.sliding_window
        assert torch.equal(_allowed(mask)[:, 0], expected), kind
    assert torch.equal(inputs.position_ids, batch.position_ids)

    plain = model.prepare_inputs(batch.input_ids, batch.labels, torch.float32)
    if attn == "sdpa" and "full_attention" in plain.masks:
        assert plain.masks["full_attention"] is None  # unpacked rows keep SDPA's is_causal path


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", list(FAMILIES))
def test_packed_rows_train_like_separate_documents(preset: str, attn: str, tmp_path: Path, monkeypatch) -> None:
    """A packed micro-batch gives HF's loss over each document alone (summed token losses over all loss
    tokens), whatever the documents' order in the row, and one engine step with AdamW gives the weights
    of HF + torch.optim.AdamW trained on the separate documents."""
    # HF's own loss math in the head, as in test_engine_families.py: the comparison isolates packing.
    from slide_hf.adapters import base

    monkeypatch.setattr(base, "_fused_linear_cross_entropy", lambda: None)
    hf, model = _pair(preset, attn, tmp_path, FAMILIES[preset])
    rows = _documents(hf.config.vocab_size)
    packed = _pack(rows)
    reordered = _pack([docs[::-1] for docs in rows[::-1]])
    loss_tokens = sum(doc.numel() - 1 for docs in rows for doc in docs)

    # Reference: HF over every document on its own, then torch AdamW (HF's >= 2-dim decay convention).
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS
    )
    expected_sum = 0.0
    for doc in (doc for docs in rows for doc in docs):
        loss = hf(doc[None], labels=doc[None]).loss * (doc.numel() - 1)  # HF's loss is the mean
        (loss / loss_tokens).backward()
        expected_sum += loss.item()
    optimizer.step()

    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_weights(model, host, tmp_path)
        config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=4096)
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1, eps=EPS)), config) as engine:
            evaluated = engine.evaluate([packed])
            evaluated_reordered = engine.evaluate([reordered])
            result = engine.step([packed], lr=LR)
        assert evaluated.loss_tokens == result.loss_tokens == loss_tokens
        assert evaluated.loss_sum == pytest.approx(expected_sum, rel=1e-6)
        assert evaluated_reordered.loss_sum == pytest.approx(expected_sum, rel=1e-6)
        assert result.loss == pytest.approx(expected_sum / loss_tokens, rel=1e-6)

        state = hf.state_dict()
        views = {unit.name: host.views(unit) for unit in model.units}
        for entry in checkpoint_entries(model):
            want = state[entry.key].float()
            have = entry.target(views[entry.unit.name])
            err = (have - want).norm() / want.norm().clamp_min(1e-12)
            assert err <= 1e-5, f"{entry.key}: weights after the step differ ({err:.2e})"


def test_flash_attention_refuses_several_packed_rows() -> None:
    """HF's flash path finds documents from position ids in a one-row batch only; several packed rows
    would attend across documents, so prepare_inputs refuses them (one row, or unpacked rows, pass)."""
    from slide_hf.errors import UserError

    config = PRESETS["test-llama"]()
    config._attn_implementation = "flash_attention_2"  # an explicit choice is kept on any device
    model = build_model(config)
    batch = _pack(_documents(config.vocab_size))
    with pytest.raises(UserError, match="flash_attention_2 cannot keep the documents of packed rows apart"):
        model.prepare_inputs(batch.input_ids, batch.labels, torch.float32, position_ids=batch.position_ids)
    one_row = model.prepare_inputs(
        batch.input_ids[:1], batch.labels[:1], torch.float32, position_ids=batch.position_ids[:1]
    )
    assert torch.equal(one_row.position_ids, batch.position_ids[:1])  # HF's flash path reads them
    model.prepare_inputs(batch.input_ids, batch.labels, torch.float32)
