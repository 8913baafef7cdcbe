"""Gemma 2 as released (both logit caps, query_pre_attn_scalar, a sliding window on every other layer, a
tied head) trains through the engine exactly like transformers, exports what transformers loads, and runs
through `slide train`; and the rule that picks each layer type's attention (slide_hf/adapters/attention.py).

The tiny models here get sharpened weights (``_sharpen``) so both caps act: at HF's initial scale the
scores and logits are far below 50 and 30, where ``tanh`` is the identity to 1e-5 and a run that dropped
the caps would pass every comparison.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_hf import PRESETS, build_model, export_hf, load_config, load_weights
from slide_hf.adapters import attention_summary
from slide_hf.adapters.attention import (
    EAGER,
    FLASH,
    FLEX,
    SDPA,
    AttentionSupport,
    LayerAttention,
    choose_attention,
)
from slide_hf.errors import UserError
from slide_hf.model import checkpoint_entries, param_count

PRESET = "tiny-gemma2"
SEQ = 16  # > the preset's sliding window of 8
STEPS = 3
RTOL = 1e-5
LR = 3e-3

RELEASED = {  # google/gemma-2-*: (layers, hidden, heads, kv heads, head_dim, query_pre_attn_scalar, params)
    "gemma2-2b": (26, 2304, 8, 4, 256, 256, 2_614_341_888),
    "gemma2-9b": (42, 3584, 16, 8, 256, 256, 9_241_705_984),
    "gemma2-27b": (46, 4608, 32, 16, 128, 144, 27_227_128_320),
}


# ---- the released configurations ----------------------------------------------------------------------


@pytest.mark.parametrize("name", [*RELEASED, PRESET])
def test_presets_carry_the_released_attention_values(name):
    c = PRESETS[name]()
    assert c.model_type == "gemma2"
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.layer_types == ["sliding_attention", "full_attention"] * (c.num_hidden_layers // 2)
    assert c.tie_word_embeddings and c.hidden_activation == "gelu_pytorch_tanh"
    if name in RELEASED:
        layers, hidden, heads, kv, head_dim, scalar, params = RELEASED[name]
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (layers, hidden, heads)
        assert (c.num_key_value_heads, c.head_dim, c.query_pre_attn_scalar) == (kv, head_dim, scalar)
        assert c.sliding_window == 4096 and c.vocab_size == 256000
        assert param_count(build_model(c)) == params  # meta device: nothing allocated
    else:
        assert c.query_pre_attn_scalar == c.head_dim and c.sliding_window < SEQ


# ---- the rule -------------------------------------------------------------------------------------------

PLAIN = LayerAttention()
CAPPED = LayerAttention(softcap=50.0, sliding_window=4096)
CUDA_BF16 = {"device_type": "cuda", "dtype": torch.bfloat16}


@pytest.mark.parametrize(
    ("layer", "support", "expected"),
    [
        (PLAIN, AttentionSupport("cpu", torch.float32), SDPA),
        (CAPPED, AttentionSupport("cpu", torch.float32), EAGER),
        (CAPPED, AttentionSupport("cpu", torch.bfloat16), EAGER),  # flex has no backward on the CPU
        (PLAIN, AttentionSupport(**CUDA_BF16), SDPA),
        (CAPPED, AttentionSupport(**CUDA_BF16), FLEX),
        (CAPPED, AttentionSupport(**CUDA_BF16, flex_attention=False), EAGER),
        (PLAIN, AttentionSupport(**CUDA_BF16, flash_attn=True), FLASH),
        (CAPPED, AttentionSupport(**CUDA_BF16, flash_attn=True, flash_attn_softcap=True), FLASH),
        (CAPPED, AttentionSupport(**CUDA_BF16, flash_attn=True), FLEX),  # flash-attn < 2.6 drops the cap
        (PLAIN, AttentionSupport("cuda", torch.float32, flash_attn=True, flash_attn_softcap=True), SDPA),
        (CAPPED, AttentionSupport("cuda", torch.float32, flash_attn=True, flash_attn_softcap=True), FLEX),
        (CAPPED, AttentionSupport("mps", torch.bfloat16), EAGER),
    ],
)
def test_rule(layer, support, expected):
    assert choose_attention(layer, support) == expected


def test_detect_on_this_machine():
    """No flash-attn here: CUDA gets flex for capped layers, the CPU eager, plain layers sdpa."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed")
    cuda = AttentionSupport.detect("cuda", torch.bfloat16)
    assert not cuda.flash_attn and cuda.flex_attention
    assert choose_attention(CAPPED, cuda) == FLEX
    assert choose_attention(CAPPED, AttentionSupport.detect("cpu", torch.bfloat16)) == EAGER


def test_adapter_chooses_per_layer_type_and_device():
    config = PRESETS[PRESET]()
    model = build_model(config)
    assert config._attn_implementation is None and model.config._attn_implementation is None
    cpu = model.attention_for("cpu", torch.float32)
    assert cpu == {"sliding_attention": EAGER, "full_attention": EAGER}
    assert set(model.attention_for("cuda", torch.bfloat16).values()) <= {FLEX, FLASH}
    assert attention_summary(model, "cpu", torch.float32) == "sliding_attention=eager, full_attention=eager"
    assert attention_summary(config, "cpu", torch.float32) == "sliding_attention=eager, full_attention=eager"
    llama = build_model(PRESETS["test-llama"]())
    assert attention_summary(llama, "cpu") == "full_attention=sdpa"


def test_choice_is_made_once_per_device_and_cached_on_the_instance(monkeypatch):
    detected = []

    def counting(device_type: str, dtype: torch.dtype) -> AttentionSupport:
        detected.append(device_type)
        return AttentionSupport(device_type, dtype)

    monkeypatch.setattr(AttentionSupport, "detect", staticmethod(counting))
    first, second = build_model(PRESETS[PRESET]()), build_model(PRESETS[PRESET]())
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    for _ in range(3):
        first.prepare_inputs(ids, ids, torch.float32)
        assert first.attention_for("cpu", torch.float32) == {"sliding_attention": EAGER, "full_attention": EAGER}
    assert detected == ["cpu", "cpu"]  # once per layer type
    assert first.attention_for("cuda", torch.bfloat16) == {"sliding_attention": FLEX, "full_attention": FLEX}
    second.attention_for("cpu", torch.float32)
    assert detected == ["cpu", "cpu", "cuda", "cuda", "cpu", "cpu"]  # nothing shared between instances


def test_each_layer_type_reads_its_own_config():
    """Every HF module in a block that holds a config holds its layer type's copy, and the mask builder
    gets that same copy, set for the device the micro-batch is on."""
    model = build_model(PRESETS[PRESET]())
    copies = {t: model.attention_config(t, "cpu", torch.float32) for t in ("sliding_attention", "full_attention")}
    assert copies["sliding_attention"] is not copies["full_attention"]
    for block in model.blocks:
        holders = [m for m in block.root.modules() if getattr(m, "config", None) is not None]
        assert holders and all(m.config is copies[block.attention_type] for m in holders)
    assert all(c._attn_implementation == EAGER for c in copies.values())


def test_explicit_choice_is_kept():
    config = PRESETS[PRESET]()
    config._attn_implementation = FLEX
    assert build_model(config).attention_for("cpu", torch.float32) == {
        "sliding_attention": FLEX,
        "full_attention": FLEX,
    }
    llama = PRESETS["test-llama"]()
    llama._attn_implementation = SDPA  # sdpa is fine where no layer is capped
    assert build_model(llama).attention_for("cuda", torch.bfloat16) == {"full_attention": SDPA}


def test_explicit_sdpa_with_a_cap_is_refused_in_one_line():
    config = PRESETS[PRESET]()
    config._attn_implementation = SDPA
    with pytest.raises(UserError, match="attention 'sdpa' cannot apply gemma2's attention logit softcap") as error:
        build_model(config)
    assert "\n" not in str(error.value) and "attn_logit_softcapping=50.0" in str(error.value)


def test_explicit_flash_without_softcap_support_is_refused(monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_greater_or_equal", lambda version: False)
    config = PRESETS[PRESET]()
    config._attn_implementation = FLASH
    with pytest.raises(UserError, match=r"needs flash-attn >= 2\.6"):
        build_model(config)


# ---- training through the engine, against transformers -----------------------------------------------


def _sharpen(hf: Any) -> None:
    """Scale q/k so attention scores reach ~100 (cap 50) and the final norm so logits reach ~50 (cap 30)."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(60.0)
            layer.self_attn.k_proj.weight.mul_(60.0)
        hf.model.norm.weight.fill_(300.0)


def _batches(vocab: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        micro = []
        for _ in range(2):  # gradient accumulation over two micro-batches
            ids = torch.randint(0, vocab, (2, SEQ), generator=generator)
            labels = ids.clone()
            labels[1, :5] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def _hf_steps(hf: Any, batches: list, adam: AdamWConfig) -> list[float]:
    """transformers (eager attention) + torch AdamW with HF's decay convention (>= 2 dims decay)."""
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": adam.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    losses = []
    for micro in batches:
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            loss = hf(ids, labels=labels).loss * int((labels[:, 1:] != -100).sum())  # HF: mean per micro-batch
            (loss / tokens).backward()
            total += loss.item()
        losses.append(total / tokens)
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Any:
    """A sharpened tiny Gemma 2 trained three steps by transformers and by the engine (default attention
    choice: eager on the CPU); yields what the tests below compare."""
    from slide_hf.adapters import base

    path = tmp_path_factory.mktemp(PRESET)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(PRESETS[PRESET](), attn_implementation=EAGER).float().eval()
    _sharpen(hf)
    hf.save_pretrained(path)
    batches = _batches(hf.config.vocab_size)
    adam = AdamWConfig(weight_decay=0.1)
    expected = _hf_steps(hf, batches, adam)

    model = build_model(load_config(path))
    # HF's own loss math in the head, as tests/hf/test_engine_families.py explains: the fused loss agrees
    # to rounding, which Adam amplifies past 1e-5 on near-zero gradients within three steps.
    with pytest.MonkeyPatch.context() as patch, CPUDevice() as device:
        patch.setattr(base, "_fused_linear_cross_entropy", lambda: None)
        host = HostParameters(model, device.alloc_pinned)
        load_weights(model, host, path)
        engine_config = EngineConfig(block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=4096)
        with Engine(model, device, host, TorchAdamW(adam), engine_config) as engine:
            got = [engine.step(micro, LR).loss for micro in batches]
        yield {"hf": hf, "path": path, "model": model, "host": host, "expected": expected, "got": got}


def test_caps_are_live_in_the_sharpened_model(trained):
    """The comparison below can fail: dropping the caps (as sdpa does) changes the loss by far more."""
    hf = AutoModelForCausalLM.from_pretrained(trained["path"], attn_implementation=EAGER).float().eval()
    ids, labels = _batches(hf.config.vocab_size)[0][0]
    with torch.no_grad():
        capped = hf(ids, labels=labels).loss.item()
        hf.config.final_logit_softcapping = None
        hf.set_attn_implementation(SDPA)  # HF's sdpa takes the attention cap and ignores it
        uncapped = hf(ids, labels=labels).loss.item()
    assert abs(uncapped - capped) > 0.1 * abs(capped)


def test_engine_trains_like_transformers(trained):
    """Losses to 1e-5 at every step; weights to within one Adam step (``LR``). The caps saturate the
    sharpened model's softmax and head, so many gradient entries are rounding noise on both sides, and
    Adam's ``g / sqrt(v)`` turns noise of any size into a move of up to ``LR`` (seen: 3e-4 of it, on
    embedding rows whose only gradient comes through the saturated head)."""
    assert trained["model"].attention_for("cpu", torch.float32) == {
        "sliding_attention": EAGER,
        "full_attention": EAGER,
    }
    assert trained["got"] == pytest.approx(trained["expected"], rel=RTOL)
    state = trained["hf"].state_dict()
    views = {unit.name: trained["host"].views(unit) for unit in trained["model"].units}
    for entry in checkpoint_entries(trained["model"]):
        moved = (entry.target(views[entry.unit.name]) - state[entry.key].float()).abs().max().item()
        assert moved <= LR, f"{entry.key}: final weights differ by {moved:.2e}"


def test_export_loads_in_transformers_with_equal_logits(trained, helpers, tmp_path):
    model, host = trained["model"], trained["host"]
    out = export_hf(model, host, load_config(trained["path"]), tmp_path / "out")
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation=EAGER)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.attn_logit_softcapping == 50.0 and hf.config.final_logit_softcapping == 30.0
    ids, _ = _batches(hf.config.vocab_size)[0][0]
    leaves = helpers.leaves_of(model, host)
    inputs = model.prepare_inputs(ids, torch.full_like(ids, -100), torch.float32)
    with torch.no_grad():
        expected = hf.float().eval()(ids).logits
        x = helpers.hidden_through_blocks(model, leaves, ids, inputs)
        params = helpers.head_params(model, leaves)
        logits = model.head.call(model.head.norm_name, params, x) @ params[model.head.lm_head_name].T
        logits = torch.tanh(logits / 30.0) * 30.0
    assert helpers.rel_err(logits, expected) <= RTOL


@pytest.mark.slow
def test_flex_attention_masks_from_the_adapter_match_eager():
    """flex_attention through the adapter's own masks (HF's BlockMasks for sliding and full layers, with
    two packed documents per row) gives eager's loss. Forward only: flex has no CPU backward (~30 s of
    compilation on a 2-core machine)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(PRESETS[PRESET](), attn_implementation=EAGER).float().eval()
    _sharpen(hf)
    ids, labels = _batches(hf.config.vocab_size)[0][0]
    positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(2, SEQ)
    losses = {}
    for implementation in (EAGER, FLEX):
        config = PRESETS[PRESET]()
        config._attn_implementation = implementation
        model = build_model(config)
        params = {u.name: {} for u in model.units}
        for unit in model.units:
            for name, key in unit.checkpoint_names.items():
                params[unit.name][name] = hf.get_parameter(key).detach()
        params[model.head.name].update(
            {mine: params[model.embedding.name][theirs] for mine, theirs in model.head.borrowed.items()}
        )
        inputs = model.prepare_inputs(ids, labels, torch.float32, position_ids=positions)
        with torch.no_grad():
            x = model.embedding.forward(params[model.embedding.name], ids, inputs)
            for block in model.blocks:
                x = block.forward(params[block.name], x, inputs)
            losses[implementation] = model.head.forward(params[model.head.name], x, inputs).item()
    assert losses[FLEX] == pytest.approx(losses[EAGER], rel=RTOL)


# ---- slide train ------------------------------------------------------------------------------------------


def test_slide_train_tiny_gemma2_on_cpu(slide, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="slide")
    status, out, err = slide(
        "train", "--model", PRESET, "--steps", "2", "--device", "cpu", "--output", tmp_path / "run"
    )
    text = out + err
    assert status == 0, text
    assert "attention: sliding_attention=eager, full_attention=eager" in caplog.messages
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_slide_doctor_says_which_attention_runs(slide):
    status, out, err = slide("doctor", "--model", PRESET)
    text = out + err
    assert status == 0, text
    assert "cpu: sliding_attention=eager, full_attention=eager" in text
    status, out, err = slide("doctor")
    text = out + err
    assert status == 0, text
    assert "cpu: sdpa; layers with a logit softcap (Gemma 2): eager" in text
    status, out, err = slide("doctor", "--model", "no-such-model")
    text = out + err
    lines = text.strip().splitlines()
    assert status == 2 and len(lines) == 1, text
    assert lines[0].startswith("slide doctor: error: unknown model 'no-such-model'")
