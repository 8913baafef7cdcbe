"""Cutting a configuration to its first layers keeps every per-layer field consistent with the layers kept."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slide_hf.presets import PRESETS
from slide_hf.truncate import truncate_layers


def test_per_layer_lists_are_cut_and_layer_indices_filtered() -> None:
    full = PRESETS["llama4-scout-text"]()
    cut = truncate_layers(full, 4)
    assert cut.num_hidden_layers == 4 and full.num_hidden_layers == 48  # the original is untouched
    assert cut.layer_types == full.layer_types[:4] and "full_attention" in cut.layer_types
    assert cut.no_rope_layers == full.no_rope_layers[:4]
    assert cut.moe_layers == [0, 1, 2, 3]
    assert cut.hidden_size == full.hidden_size and cut.num_local_experts == full.num_local_experts


def test_index_lists_drop_the_layers_cut_away() -> None:
    cut = truncate_layers(PRESETS["test-llama4"](), 1)
    assert cut.moe_layers == [] and cut.layer_types == PRESETS["test-llama4"]().layer_types[:1]


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "moonlight-16b-a3b", "smollm3-3b"])
def test_transformers_builds_the_cut_model_with_the_layers_kept(name: str) -> None:
    cut = truncate_layers(PRESETS[name](), 4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cut)
    assert len(model.model.layers) == 4


@pytest.mark.parametrize("layers", [0, -1, 29, 2.5, True])
def test_a_count_outside_the_model_is_refused(layers: object) -> None:
    with pytest.raises(ValueError, match=r"--layers must be a whole number from 1 to 28"):
        truncate_layers(PRESETS["llama3.2-3b"](), layers)


@pytest.mark.parametrize("layers, shared", [(22, 7), (15, 0), (35, 20), (4, 0)])
def test_kv_sharing_keeps_the_shared_layers_among_those_kept(layers: int, shared: int) -> None:
    """Gemma 4 E2B: the last 20 of 35 layers reuse keys and values; the first 22 layers hold 7 of them,
    and the adapter finds a source layer for every shared one (it refuses a cut that leaves none)."""
    from slide_hf.adapters.gemma4 import _kv_roles

    full = PRESETS["gemma4-e2b"]()
    cut = truncate_layers(full, layers)
    assert cut.num_kv_shared_layers == shared and full.num_kv_shared_layers == 20
    roles = _kv_roles(cut)
    assert list(roles.values()).count("reads") == shared
