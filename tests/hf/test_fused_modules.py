"""HF modules rebound to slide-kernels' fused RMSNorm and gated MLP (slide_hf/adapters/fused_modules.py).

On the CPU the fused path is forced (``_runs_fused`` patched) and runs the Triton kernels under the
interpreter (tests/conftest.py turns it on without a GPU): loss and every gradient still match HF's eager
modules. Unpatched, a CPU run never takes the fused path, so every other test compares HF to HF.
"""

from __future__ import annotations

import pytest
import torch

from slide_hf import PRESETS, build_model
from slide_hf.adapters import fused_modules

pytest.importorskip("slide_kernels")

TOL = 2e-5


@pytest.mark.parametrize("preset", ["test-llama", "test-gemma2", "test-qwen3", "test-phi3", "test-mistral"])
def test_fused_modules_match_hf(reference, helpers, monkeypatch, preset: str) -> None:
    from slide_kernels._backend import interpret_mode

    if not interpret_mode():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py when no GPU is visible)")
    calls: list[bool] = []

    def forced(x: torch.Tensor) -> bool:
        calls.append(True)
        return True

    ref = reference(preset)  # HF's own model: its modules are never rebound
    ids, labels = helpers.batch(ref.hf.config.vocab_size)
    ref.hf.zero_grad(set_to_none=True)
    expected = ref.hf(ids, labels=labels).loss
    expected.backward()
    monkeypatch.setattr(fused_modules, "_runs_fused", forced)
    import slide_kernels

    rotary_calls: list[bool] = []
    fused_rotary = slide_kernels.apply_rotary

    def counted_rotary(*args):
        rotary_calls.append(True)
        return fused_rotary(*args)

    monkeypatch.setattr(slide_kernels, "apply_rotary", counted_rotary)
    leaves = helpers.leaves_of(ref.model, ref.host)
    loss = helpers.run_units(ref.model, leaves, ids, labels, torch.float32)
    loss.backward()
    assert calls, "no module took the fused path"
    assert rotary_calls, "the attention did not use the fused rotary"
    assert abs(loss.item() - expected.item()) <= TOL * abs(expected.item())
    for unit in ref.model.units:
        for name, leaf in leaves[unit.name].items():
            err = helpers.rel_err(leaf.grad, helpers.hf_param(ref, unit.name, name).grad)
            assert err <= TOL, f"{unit.name}/{name}: grad relative error {err:.2e}"


def test_which_modules_are_rebound() -> None:
    llama = build_model(PRESETS["test-llama"]())
    assert llama.blocks[0].fused_modules == ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]
    assert llama.head.fused_modules == ["norm"]
    qwen3 = build_model(PRESETS["test-qwen3"]())
    assert {"self_attn", "self_attn.q_norm", "self_attn.k_norm", "mlp"} <= set(qwen3.blocks[0].fused_modules)
    phi3 = build_model(PRESETS["test-phi3"]())
    assert "mlp" not in phi3.blocks[0].fused_modules  # a fused gate_up projection: left to HF
    gpt2 = build_model(PRESETS["test-gpt2"]())
    assert gpt2.blocks[0].fused_modules == [] and gpt2.head.fused_modules == []


def test_cpu_tensors_take_hf_path() -> None:
    assert not fused_modules._runs_fused(torch.zeros(2))


def test_rotary_is_swapped_for_one_instance_only() -> None:
    """The attention's copy of ``forward`` sees the fused rotary; HF's module global is untouched."""
    from transformers.models.llama import modeling_llama

    hf_rotary = modeling_llama.apply_rotary_pos_emb
    llama = build_model(PRESETS["test-llama"]())
    attention = llama.blocks[0].root.self_attn
    assert modeling_llama.apply_rotary_pos_emb is hf_rotary
    assert attention.forward.__func__.__globals__["apply_rotary_pos_emb"] is not hf_rotary
    assert type(attention).forward.__globals__["apply_rotary_pos_emb"] is hf_rotary


_NORM_FORMS = {  # HF module -> (offset, casting mode) its code computes; None: neither, left to HF
    "llama.LlamaRMSNorm": (0.0, "llama"),
    "gemma2.Gemma2RMSNorm": (1.0, "gemma"),
    "olmo2.Olmo2RMSNorm": (0.0, "gemma"),  # w * x in fp32, then rounded
    "olmo3.Olmo3RMSNorm": (0.0, "gemma"),
    "smollm3.SmolLM3RMSNorm": (0.0, "llama"),
    "glm4.Glm4RMSNorm": (0.0, "llama"),
    "granite.GraniteRMSNorm": (0.0, "llama"),
    "gemma3.Gemma3RMSNorm": (1.0, "gemma"),
    "gemma4.Gemma4RMSNorm": (0.0, "gemma"),  # a Gemma name, Llama's w * x
    "qwen3_next.Qwen3NextRMSNorm": (1.0, "gemma"),  # a Qwen name, Gemma's (1 + w) * x
    "qwen3_5.Qwen3_5RMSNorm": (1.0, "gemma"),
    "llama4.Llama4TextRMSNorm": (0.0, "llama"),
    "deepseek_v3.DeepseekV3RMSNorm": (0.0, "llama"),
}


@pytest.mark.parametrize(("path", "form"), list(_NORM_FORMS.items()))
def test_norm_forms_are_read_from_the_code(path: str, form) -> None:
    """Note [Fused modules are checked, not named]: the parametrization comes from running the module."""
    import importlib

    family, name = path.split(".")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    with torch.device("meta"):
        norm = getattr(module, name)(24)
    assert fused_modules.norm_form(norm) == form


def test_only_rotate_half_rotary_is_fused() -> None:
    """GLM-4 rotates interleaved pairs: its attention keeps HF's rotary; Llama's is rebound."""
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.llama import modeling_llama

    assert fused_modules.rotates_halves(modeling_llama.apply_rotary_pos_emb)
    assert not fused_modules.rotates_halves(modeling_glm4.apply_rotary_pos_emb)
