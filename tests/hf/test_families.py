"""The families with layer types, per-type rotary tables, multipliers, linear attention and MLA, each
against transformers itself: trained through the engine on the CPU device (fp32) like HF's model with
``torch.optim.AdamW``, exported into a directory transformers loads with equal logits, and built with
exactly HF's parameters. Each test preset switches its family's features on; the guards below check that
those features act (a run that dropped them would differ from HF, or from itself with them off).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.unit import SlideModel, UnitRole
from slide_hf import PRESETS, build_model, export_hf, load_config, load_weights
from slide_hf.model import checkpoint_entries

FAMILIES = [
    "test-olmo2",
    "test-olmo3",
    "test-smollm3",
    "test-glm4",
    "test-granite",
    "test-ministral3",
    "test-gemma3",
    "test-qwen3-next",
    "test-qwen3.5",
    "test-qwen3.5-moe",
    "test-llama4",
    "test-deepseek-v3",
]
STEPS = 3
RTOL = 1e-5
LR = 3e-3


@pytest.mark.parametrize("preset", FAMILIES)
def test_engine_trains_like_hf(preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers) -> None:
    """Three AdamW steps of two accumulated micro-batches: every loss within 1e-5 of transformers, and
    every final weight (the engine recomputes each block in backward, so this covers recompute)."""
    # HF's own loss math in the head, as in test_engine_families: the comparison isolates the engine.
    from slide_hf.adapters import base

    monkeypatch.setattr(base, "_fused_linear_cross_entropy", lambda: None)
    hf = helpers.eager_hf_model(preset)
    hf.save_pretrained(tmp_path)
    batches = helpers.accumulation_batches(hf.config.vocab_size, STEPS)
    adam = AdamWConfig(weight_decay=0.1)
    expected = helpers.hf_adamw_losses(hf, batches, lr=LR, weight_decay=adam.weight_decay)

    config = load_config(tmp_path)
    config._attn_implementation = "eager"
    model = build_model(config)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_weights(model, host, tmp_path)
        engine_config = EngineConfig(block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=4096)
        with Engine(model, device, host, TorchAdamW(adam), engine_config) as engine:
            got = [engine.step(micro, LR).loss for micro in batches]
        assert got == pytest.approx(expected, rel=RTOL)

        state = hf.state_dict()
        views = {unit.name: host.views(unit) for unit in model.units}
        for entry in checkpoint_entries(model):
            if entry.key not in state:
                continue  # stored per expert on disk, fused in memory; covered by the losses
            want = state[entry.key].float()
            have = entry.target(views[entry.unit.name])
            if entry.key.endswith("k_proj.bias"):
                # As in test_engine_families: softmax ignores a constant added to every key, so the key
                # bias's gradient is (nearly, under rotary) cancelled and both runs see rounding noise of
                # its size; Adam turns that noise into steps of ~lr.
                assert (have - want).abs().max() <= 2 * LR * STEPS
                continue
            err = (have - want).norm() / want.norm().clamp_min(1e-12)
            assert err <= RTOL, f"{entry.key}: final weights differ ({err:.2e})"


def _logits_through_units(model: SlideModel, host: HostParameters, ids: torch.Tensor, helpers) -> torch.Tensor:
    """Our logits: embedding, blocks, the head's norm and matrix, and the family's logit transform."""
    leaves = helpers.leaves_of(model, host)
    inputs = model.prepare_inputs(ids, torch.full_like(ids, -100), torch.float32)
    with torch.no_grad():
        x = helpers.hidden_through_blocks(model, leaves, ids, inputs)
        params = helpers.head_params(model, leaves)
        hidden = model.head.call(model.head.norm_name, params, x)
        logits = hidden @ params[model.head.lm_head_name].T / getattr(model.head, "logits_scaling", 1.0)
        if model.head.softcap is not None:
            logits = torch.tanh(logits / model.head.softcap) * model.head.softcap
    return logits


@pytest.mark.parametrize("preset", FAMILIES)
def test_export_loads_in_transformers(reference, helpers, tmp_path: Path, preset: str) -> None:
    """Perturbed weights, exported in shards: transformers loads every key and gives our logits."""
    ref = reference(preset)
    g = torch.Generator().manual_seed(3)
    for _, _, view in ref.host.named_tensors():
        view.add_(torch.randn(view.shape, generator=g) * 0.01)
    out = export_hf(ref.model, ref.host, load_config(ref.path), tmp_path / "out", max_shard_bytes=40_000)
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, _ = helpers.batch(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf.float().eval()(ids).logits
    got = _logits_through_units(ref.model, ref.host, ids, helpers)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", FAMILIES)
def test_units_are_hf_parameters(preset: str) -> None:
    """Every HF parameter is exactly one unit parameter under its state-dict name (tied: the
    embedding's), blocks are blocks, decaying parameters come first."""
    config = PRESETS[preset]()
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(PRESETS[preset]())
    model = build_model(config)
    ours = {}
    for unit in model.units:
        for spec in unit.layout:
            ours[unit.checkpoint_names[spec.name]] = spec.shape
        decays = [spec.decay for spec in unit.layout]
        assert decays == sorted(decays, reverse=True)
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    carried = {u.checkpoint_names[n] for u in model.units for n in u.buffer_params}
    theirs |= {n: tuple(b.shape) for n, b in hf.named_buffers() if n in carried}  # Note [Buffers carried as parameters]
    assert ours == theirs
    assert [b.role for b in model.blocks] == [UnitRole.BLOCK] * config.num_hidden_layers
    assert ("lm_head.weight" in model.head.layout) is not config.tie_word_embeddings


@pytest.mark.parametrize("preset", FAMILIES)
def test_fused_kernels_match_hf(reference, helpers, monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """slide-kernels' RMSNorm, GLU and RoPE forced on (Triton interpreter, fp32) where the adapter
    rebinds them: loss and every gradient still equal HF's eager modules. This is what catches a norm
    fused with the wrong parametrization (``1 + w`` against ``w``)."""
    pytest.importorskip("slide_kernels")
    from slide_hf.adapters import fused_modules
    from slide_kernels._backend import interpret_mode

    if not interpret_mode():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py when no GPU is visible)")
    ref = reference(preset)
    if not any(unit.fused_modules for unit in ref.model.units):
        pytest.skip(f"{preset}: no module is rebound")
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    ref.hf.zero_grad(set_to_none=True)
    expected = ref.hf(ids, labels=labels).loss
    expected.backward()
    monkeypatch.setattr(fused_modules, "_runs_fused", lambda x: True)
    leaves = helpers.leaves_of(ref.model, ref.host)
    loss = helpers.run_units(ref.model, leaves, ids, labels, torch.float32)
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 2e-5 * abs(expected.item())
    for unit in ref.model.units:
        for name, leaf in leaves[unit.name].items():
            if name in unit.buffer_params:  # HF buffers: no gradient on either side
                assert leaf.grad is None
                continue
            err = helpers.rel_err(leaf.grad, helpers.hf_param(ref, unit.name, name).grad)
            assert err <= 2e-5, f"{unit.name}/{name}: grad relative error {err:.2e}"


# ---- the features each preset switches on, acting ------------------------------------------------------


def _loss(model: SlideModel, host: HostParameters, helpers, inputs_hook=None) -> float:
    ids, labels = helpers.batch(model.config.vocab_size)
    leaves = helpers.leaves_of(model, host)
    inputs = model.prepare_inputs(ids, labels, torch.float32)
    if inputs_hook is not None:
        inputs = inputs_hook(inputs)
    with torch.no_grad():
        x = helpers.hidden_through_blocks(model, leaves, ids, inputs)
        return (
            model.head.forward(helpers.head_params(model, leaves), x, inputs) / model.loss_token_count(labels)
        ).item()


@pytest.mark.parametrize("preset", ["test-olmo3", "test-gemma3"])
def test_layer_types_rotate_differently(reference, helpers, preset: str) -> None:
    """Each layer type gets its own rotary table: swapping them changes the loss, so the parity tests
    would catch one table for all layers."""
    ref = reference(preset)
    assert [b.attention_type for b in ref.model.blocks] == ["sliding_attention", "full_attention"]
    baseline = _loss(ref.model, ref.host, helpers)

    def swapped(inputs):
        tables = inputs.rotary_by_type
        flipped = {"sliding_attention": tables["full_attention"], "full_attention": tables["sliding_attention"]}
        return dataclasses.replace(inputs, rotary_by_type=flipped)

    cos = {
        t: table[0] for t, table in ref.model.prepare_inputs(*helpers.batch(300), torch.float32).rotary_by_type.items()
    }
    assert not torch.allclose(cos["sliding_attention"], cos["full_attention"])
    assert abs(_loss(ref.model, ref.host, helpers, swapped) - baseline) > 1e-4


def _loss_with(ref, helpers, **overrides) -> float:
    """The loss of ``ref``'s weights under its config with ``overrides`` (same parameter layout)."""
    config = load_config(ref.path)
    config._attn_implementation = "eager"
    for name, value in overrides.items():
        setattr(config, name, value)
    model = build_model(config)
    host = HostParameters(model)
    host.slab.copy_(ref.host.slab)
    return _loss(model, host, helpers)


def test_smollm3_nope_layer_ignores_rotary(reference, helpers) -> None:
    """Layer 1 has no rotary (``no_rope_layers``) and slides; layer 0 rotates and attends fully."""
    ref = reference("test-smollm3")
    blocks = ref.model.blocks
    assert [b.root.self_attn.use_rope for b in blocks] == [True, False]
    assert [b.attention_type for b in blocks] == ["full_attention", "sliding_attention"]
    ids, labels = helpers.batch(300)
    inputs = ref.model.prepare_inputs(ids, labels, torch.float32)
    leaves = helpers.leaves_of(ref.model, ref.host)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = inputs.position_embeddings
    moved = dataclasses.replace(inputs, position_embeddings=(cos.roll(1, dims=1), sin.roll(1, dims=1)))
    with torch.no_grad():
        for block, rotates in zip(blocks, (True, False), strict=True):
            same = torch.equal(
                block.forward(leaves[block.name], x, inputs), block.forward(leaves[block.name], x, moved)
            )
            assert same is not rotates


def test_granite_multipliers_act(reference, helpers) -> None:
    """Each of Granite's four multipliers changes the loss: none of them can be dropped unnoticed."""
    ref = reference("test-granite")
    baseline = _loss(ref.model, ref.host, helpers)
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        assert abs(_loss_with(ref, helpers, **{name: 1.0}) - baseline) > 1e-4, name


def test_ministral3_query_scale_acts(reference, helpers) -> None:
    """The Llama-4 query scale (past ``original_max_position_embeddings`` = 4 tokens) changes the loss."""
    ref = reference("test-ministral3")
    rope = dict(ref.model.config.rope_parameters, llama_4_scaling_beta=0.0)
    assert abs(_loss_with(ref, helpers, rope_parameters=rope) - _loss(ref.model, ref.host, helpers)) > 1e-4


@pytest.mark.parametrize("preset", ["test-qwen3-next", "test-qwen3.5", "test-qwen3.5-moe"])
def test_linear_attention_layers(preset: str) -> None:
    """Delta-net layers choose no attention implementation, take HF's recurrent mask (None without
    padding), and refuse packed rows, whose documents their recurrent state would join."""
    from slide_hf.errors import UserError

    model = build_model(PRESETS[preset]())
    kinds = [b.attention_type for b in model.blocks]
    assert "linear_attention" in kinds and "full_attention" in kinds
    assert model.attention_for("cpu", torch.float32) == {"full_attention": "sdpa"}
    ids = torch.zeros(1, 8, dtype=torch.long)
    assert model.prepare_inputs(ids, ids, torch.float32).masks["linear_attention"] is None
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(UserError, match="--no-packing") as info:
        model.prepare_inputs(ids, ids, torch.float32, position_ids=packed)
    assert "\n" not in str(info.value)


RELEASED = [
    "olmo2-7b",
    "olmo3-7b",
    "smollm3-3b",
    "glm4-9b",
    "granite-3.3-8b",
    "ministral3-8b",
    "gemma3-12b",
    "qwen3-next-80b-a3b",
    "qwen3.5-9b",
    "qwen3.5-35b-a3b",
    "llama4-scout-text",
    "moonlight-16b-a3b",
]


@pytest.mark.parametrize("preset", RELEASED)
def test_planner_prices_released_shapes(preset: str) -> None:
    """``slide plan``'s model works from the unit layouts: every parameter priced, per-block sizes from
    the blocks themselves (delta-net and attention layers differ)."""
    from slide_hf.model import param_count
    from slide_hf.planner import PlanInputs, make_plan

    model = build_model(PRESETS[preset]())  # meta device: nothing allocated
    plan = make_plan(PlanInputs(model, batch_size=1, seq_len=4096))
    assert plan.params == sum(unit.layout.param_numel for unit in model.units)
    assert plan.params - param_count(model) == sum(u.layout[n].numel for u in model.units for n in u.buffer_params)
    assert plan.shape.block_numels == tuple(b.layout.numel for b in model.blocks)
    assert plan.step_time_s > 0 and plan.host_peak_bytes > 12 * plan.params


def test_llama4_chunks_and_temperature_act(reference, helpers) -> None:
    """Layer 0 attends within 4-token chunks, layer 1 (NoPE) scales its queries past 4 tokens: turning
    either off changes the loss beyond the parity tolerance."""
    ref = reference("test-llama4")
    assert [b.attention_type for b in ref.model.blocks] == ["chunked_attention", "full_attention"]
    assert [b.root.self_attn.use_rope for b in ref.model.blocks] == [True, False]
    baseline = _loss(ref.model, ref.host, helpers)
    assert abs(_loss_with(ref, helpers, attn_temperature_tuning=False) - baseline) > 1e-4
    for block in ref.model.blocks:
        block.attention_type = "full_attention"
    assert abs(_loss(ref.model, ref.host, helpers) - baseline) > 1e-4


def test_llama4_never_runs_flash_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers has no flash-attention path for Llama 4: not chosen where flash-attn is installed,
    refused in one line when asked for."""
    from slide_hf.adapters.attention import AttentionSupport
    from slide_hf.errors import UserError

    def with_flash(device_type: str, dtype: torch.dtype) -> AttentionSupport:
        return AttentionSupport(device_type, dtype, flash_attn=True, flash_attn_softcap=True)

    monkeypatch.setattr(AttentionSupport, "detect", staticmethod(with_flash))
    assert build_model(PRESETS["test-llama"]()).attention_for("cuda", torch.bfloat16) == {
        "full_attention": "flash_attention_2"
    }
    model = build_model(PRESETS["test-llama4"]())
    assert set(model.attention_for("cuda", torch.bfloat16).values()) == {"sdpa"}
    config = PRESETS["test-llama4"]()
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="not available for Llama 4") as info:
        build_model(config)
    assert "\n" not in str(info.value)


def test_deepseek_correction_bias_steers_routing_and_never_trains(tmp_path: Path, helpers) -> None:
    """A checkpoint's ``e_score_correction_bias`` (an HF buffer) is loaded, changes which experts run --
    our loss equals transformers' with it and differs from the loss without it -- survives training
    unchanged, and is exported."""
    hf = helpers.eager_hf_model("test-deepseek-v3")
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    with torch.no_grad():
        hf.get_buffer(key).copy_(torch.tensor([0.8, 0.0, -0.4, 0.0]))  # favours group 0 (experts 0, 1)
    hf.save_pretrained(tmp_path / "in")
    ids, labels = helpers.batch(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids, labels=labels).loss.item()
    config = load_config(tmp_path / "in")
    config._attn_implementation = "eager"
    model = build_model(config)
    host = HostParameters(model)
    load_weights(model, host, tmp_path / "in")
    block = model.blocks[1]
    assert block.buffer_params == {"mlp.gate.e_score_correction_bias"}
    assert _loss(model, host, helpers) == pytest.approx(expected, rel=1e-6)
    loaded = host.views(block)["mlp.gate.e_score_correction_bias"].clone()
    host.views(block)["mlp.gate.e_score_correction_bias"].zero_()
    assert abs(_loss(model, host, helpers) - expected) > 1e-4
    host.views(block)["mlp.gate.e_score_correction_bias"].copy_(loaded)

    with CPUDevice() as device:
        pinned = HostParameters(model, device.alloc_pinned)
        pinned.slab.copy_(host.slab)
        engine_config = EngineConfig(block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=4096)
        with Engine(model, device, pinned, TorchAdamW(AdamWConfig(weight_decay=0.1)), engine_config) as engine:
            for micro in helpers.accumulation_batches(hf.config.vocab_size, 2):
                engine.step(micro, LR)
        assert torch.equal(pinned.views(block)["mlp.gate.e_score_correction_bias"], loaded)
        out = export_hf(model, pinned, config, tmp_path / "out")
    again, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(again.get_buffer(key), loaded)


def test_unsupported_model_type_lists_every_family_in_one_line() -> None:
    """A decoder no adapter takes (here Falcon) is refused in one line that names every supported model
    type, these families and Gemma 4 included."""
    from transformers import AutoConfig

    from slide_hf import UnsupportedModelError

    with pytest.raises(UnsupportedModelError) as info:
        build_model(AutoConfig.for_model("falcon"))
    message = str(info.value)
    assert "'falcon'" in message and "\n" not in message
    supported = message.split("supported model types: ")[1].split(", ")
    for preset in (*FAMILIES, "gemma4-31b"):
        assert PRESETS[preset]().model_type in supported
