"""Every mixture-of-experts family runs transformers' grouped_mm experts, as HF's ``from_config`` gives them,
whatever its config calls the experts' count (Qwen3-MoE ``num_experts``, DeepSeek-V3 ``n_routed_experts``);
left unset, an experts class falls back to its per-expert loop (DeepSeek-V3's streamed blocks ran at 8 % of
an H100's matmul rate)."""

from __future__ import annotations

import pytest

from slide_hf import PRESETS, build_model

MOE_PRESETS = ["test-qwen3-moe", "test-deepseek-v3", "moonlight-16b-a3b", "test-qwen3-next"]


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_the_experts_run_grouped_mm(name: str) -> None:
    model = build_model(PRESETS[name]())
    experts = [
        module
        for block in model.blocks
        for module in block.root.modules()
        if type(module).__name__.endswith("Experts") and hasattr(module, "config")
    ]
    assert experts, f"{name} has no experts module"
    assert {module.config._experts_implementation for module in experts} == {"grouped_mm"}


def test_a_dense_family_is_left_alone() -> None:
    model = build_model(PRESETS["tiny-llama"]())
    assert getattr(model.config, "_experts_implementation", None) is None
