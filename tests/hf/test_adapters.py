"""Adapters against transformers itself: same loss, same gradients, same AdamW trajectory, per family."""

from __future__ import annotations

import types

import pytest
import torch

from slide_core.unit import SlideModel, UnitRole
from slide_hf import PRESETS, UnsupportedModelError, build_model
from slide_hf.adapters import base, supported_model_types

FAMILIES = [
    "test-llama",
    "test-llama-untied",
    "test-mistral",
    "test-qwen2",
    "test-qwen3",
    "test-gemma2",
    "test-phi3",
    "test-gpt2",
    "test-qwen3-moe",
]
TOL = 1e-5


def _check_loss_and_grads(ref, helpers, dtype=torch.float32, tol=TOL):
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    ref.hf.zero_grad(set_to_none=True)
    expected = ref.hf(ids, labels=labels).loss
    expected.backward()
    leaves = helpers.leaves_of(ref.model, ref.host, dtype)
    loss = helpers.run_units(ref.model, leaves, ids, labels, dtype)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - expected.item()) <= tol * abs(expected.item())
    for unit in ref.model.units:
        for name, leaf in leaves[unit.name].items():
            err = helpers.rel_err(leaf.grad, helpers.hf_param(ref, unit.name, name).grad)
            assert err <= tol, f"{unit.name}/{name}: grad relative error {err:.2e}"
    return leaves


@pytest.mark.parametrize("preset", FAMILIES)
def test_loss_and_grads_match_hf(reference, helpers, preset):
    ref = reference(preset)
    _check_loss_and_grads(ref, helpers)


@pytest.mark.parametrize("preset", ["test-llama", "test-qwen2", "test-mistral"])
def test_sdpa_matches_hf(reference, helpers, preset):
    ref = reference(preset, attn="sdpa")
    assert ref.model.config._attn_implementation == "sdpa"
    _check_loss_and_grads(ref, helpers)


@pytest.mark.parametrize("preset", FAMILIES)
def test_adamw_steps_track_hf(reference, helpers, preset):
    """Losses agree to 1e-5 at every step; weights to within one step (``lr``). Adam divides each
    gradient entry by its own magnitude: an entry that is ~1e-10 on both sides but of opposite sign (the
    fused loss kernel sums in another order than HF) moves its weight the other way, by under a step."""
    ref = reference(preset)
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    leaves = helpers.leaves_of(ref.model, ref.host)
    lr = 1e-3
    ours = torch.optim.AdamW([t for unit in leaves.values() for t in unit.values()], lr=lr)
    theirs = torch.optim.AdamW(ref.hf.parameters(), lr=lr)
    for _ in range(3):
        ours.zero_grad()
        theirs.zero_grad()
        loss = helpers.run_units(ref.model, leaves, ids, labels)
        expected = ref.hf(ids, labels=labels).loss
        assert abs(loss.item() - expected.item()) <= TOL * expected.item()
        loss.backward()
        expected.backward()
        ours.step()
        theirs.step()
    for unit in ref.model.units:
        for name, leaf in leaves[unit.name].items():
            expected = helpers.hf_param(ref, unit.name, name)
            torch.testing.assert_close(leaf, expected, rtol=TOL, atol=lr)


@pytest.mark.parametrize("preset", ["test-llama", "test-gemma2"])
def test_bf16_units_match_hf_bf16(reference, helpers, preset):
    """In bf16 the units run HF's own ops in HF's order (Gemma's bf16-rounded embedding scale included)."""
    ref = reference(preset)
    ref.hf.to(torch.bfloat16)
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    with torch.no_grad():
        expected = ref.hf(ids, labels=labels).loss
        loss = helpers.run_units(
            ref.model, helpers.leaves_of(ref.model, ref.host, torch.bfloat16), ids, labels, torch.bfloat16
        )
    assert abs(loss.item() - expected.item()) <= 1e-2 * expected.item()


@pytest.mark.parametrize("preset", ["test-gemma2", "test-mistral"])
def test_sliding_window_masks_are_exercised(reference, helpers, preset):
    """Guard for the parity tests: with full masks everywhere the loss changes, so the windows matter."""
    ref = reference(preset)
    assert any(b.attention_type == "sliding_attention" for b in ref.model.blocks)
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    leaves = helpers.leaves_of(ref.model, ref.host)
    with torch.no_grad():
        windowed = helpers.run_units(ref.model, leaves, ids, labels)
        for block in ref.model.blocks:
            block.attention_type = "full_attention"
        full = helpers.run_units(ref.model, leaves, ids, labels)
    assert abs(windowed.item() - full.item()) > 1e-4


def test_gemma2_layer_types_alternate():
    model = build_model(PRESETS["test-gemma2"]())
    assert [b.attention_type for b in model.blocks] == ["sliding_attention", "full_attention"]
    assert model.head.softcap == 2.0


def test_torch_fallback_loss_matches(reference, helpers, monkeypatch):
    """The head's plain-torch path (used when slide_kernels is absent) also matches HF."""
    monkeypatch.setattr(base, "_fused_linear_cross_entropy", lambda: None)
    ref = reference("test-gemma2")
    _check_loss_and_grads(ref, helpers)


def test_fused_kernel_matches_fallback(helpers):
    fused = base._fused_linear_cross_entropy()
    if fused is None:
        pytest.skip("slide_kernels.linear_cross_entropy is not importable")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 32, generator=g)
    weight = torch.randn(100, 32, generator=g) * 0.1
    labels = torch.randint(0, 100, (2, 12), generator=g)
    labels[0, :4] = -100
    for softcap in (None, 2.0):
        expected = torch.nn.functional.cross_entropy(
            (torch.tanh(hidden @ weight.T / softcap) * softcap if softcap else hidden @ weight.T).reshape(-1, 100),
            labels.reshape(-1),
            reduction="sum",
        )
        got = base.causal_lm_loss_sum(hidden, weight, labels, softcap=softcap)
        assert abs(got.item() - expected.item()) <= 1e-4 * expected.item()


@pytest.mark.parametrize("preset", FAMILIES)
def test_checkpoint_names_are_hf_state_dict(preset):
    """Every HF parameter is exactly one unit parameter (tied: the embedding's), and vice versa."""
    config = PRESETS[preset]()
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(PRESETS[preset]())  # from_config sets its config's attention
    model = build_model(config)
    ours = {}
    for unit in model.units:
        for spec in unit.layout:
            ours[unit.checkpoint_names[spec.name]] = spec.shape
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}  # tied lm_head deduplicated by torch
    assert ours == theirs


@pytest.mark.parametrize("preset", FAMILIES)
def test_unit_structure(preset):
    config = PRESETS[preset]()
    model = build_model(config)
    assert isinstance(model, SlideModel)
    assert model.embedding.role is UnitRole.EMBEDDING and model.head.role is UnitRole.HEAD
    assert [b.role for b in model.blocks] == [UnitRole.BLOCK] * config.num_hidden_layers
    assert len({u.name for u in model.units}) == len(model.units)
    tied = config.tie_word_embeddings
    assert ("lm_head.weight" in model.head.layout) is not tied
    if tied:
        (borrowed,) = model.head.borrowed.items()
        assert borrowed[0] == "lm_head.weight" and borrowed[1] in model.embedding.layout
    for unit in model.units:  # decaying (>= 2-dim) parameters first
        decays = [spec.decay for spec in unit.layout]
        assert decays == sorted(decays, reverse=True)


def test_adapter_does_not_mutate_callers_config():
    config = PRESETS["test-llama"]()
    assert config._attn_implementation is None
    model = build_model(config)
    model.prepare_inputs(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), torch.float32)
    assert config._attn_implementation is None
    assert model.attention_for("cpu", torch.float32) == {"full_attention": "sdpa"}


def test_prepare_inputs_shifts_labels_hf_style():
    model = build_model(PRESETS["test-llama"]())
    ids = torch.arange(12).reshape(2, 6)
    labels = ids.clone()
    labels[0, 2] = -100
    inputs = model.prepare_inputs(ids, labels, torch.float32)
    assert inputs.shift_labels.tolist() == [[1, -100, 3, 4, 5, -100], [7, 8, 9, 10, 11, -100]]
    assert model.loss_token_count(labels) == 9
    cos, _ = inputs.position_embeddings
    assert cos.shape == (1, 6, 16) and cos.dtype == torch.float32
    assert inputs.position_ids.tolist() == [list(range(6))]


def test_dropout_is_off(reference, helpers):
    """GPT-2's default dropouts are 0.1; units must still be deterministic (the engine recomputes)."""
    ref = reference("test-gpt2")
    assert ref.model.config.resid_pdrop > 0
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    leaves = helpers.leaves_of(ref.model, ref.host)
    with torch.no_grad():
        first = helpers.run_units(ref.model, leaves, ids, labels)
        second = helpers.run_units(ref.model, leaves, ids, labels)
    assert first.item() == second.item()


def test_unsupported_architecture_lists_supported():
    from transformers import BertConfig

    with pytest.raises(UnsupportedModelError) as info:
        build_model(BertConfig())
    message = str(info.value)
    assert "'bert'" in message and "\n" not in message
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "phi3", "gpt2"):
        assert model_type in message
    assert isinstance(info.value, ValueError)


def test_unknown_model_type():
    with pytest.raises(UnsupportedModelError, match=r"'not-a-model'.*supported model types: .*llama"):
        build_model(types.SimpleNamespace(model_type="not-a-model", architectures=["NotAModel"]))


def test_supported_model_types_registered():
    assert set(supported_model_types()) >= {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma2",
        "phi3",
        "gpt2",
    }
