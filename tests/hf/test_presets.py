"""Presets: published shapes and parameter counts, model resolution, deterministic random init."""

from __future__ import annotations

import pytest
import torch

from slide_core.host_params import HostParameters
from slide_hf import PRESETS, ModelNotFoundError, build_model, init_random, resolve_model
from slide_hf.model import param_count

PUBLISHED = {  # parameter counts of the Hub checkpoints
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_matches_hf_count(name):
    """On meta only: no weights are allocated, on either side."""
    from transformers import AutoModelForCausalLM

    config = PRESETS[name]()
    model = build_model(config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    assert param_count(model) == sum(p.numel() for p in hf.parameters())
    if name in PUBLISHED:
        assert param_count(model) == pytest.approx(PUBLISHED[name], rel=1e-3)


def test_published_shapes():
    c = PRESETS["llama3.1-8b"]()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (4096, 32, 32, 8)
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["rope_theta"] == 500000.0
    assert not c.tie_word_embeddings and c.vocab_size == 128256
    assert PRESETS["llama3.2-3b"]().tie_word_embeddings
    assert PRESETS["qwen3-8b"]().head_dim == 128
    yarn = PRESETS["qwen3-8b-yarn"]()  # Qwen3-8B's model card: YaRN, factor 4 over 32,768, for 131,072 tokens
    assert yarn.max_position_embeddings == 131072 and PRESETS["qwen3-8b"]().max_position_embeddings == 40960
    assert yarn.rope_parameters["rope_type"] == "yarn" and yarn.rope_parameters["factor"] == 4.0
    assert yarn.rope_parameters["original_max_position_embeddings"] == 32768
    assert PRESETS["mistral-7b"]().sliding_window is None
    tiny = PRESETS["tiny-llama"]()
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.intermediate_size, tiny.max_position_embeddings) == (
        256,
        4,
        688,
        2048,
    )
    assert tiny.tie_word_embeddings


def test_resolve_preset_with_vocab_override():
    config, path = resolve_model("tiny-llama", vocab_size=50257)
    assert path is None and config.vocab_size == 50257 and config.model_type == "llama"


def test_resolve_directory(tmp_path):
    PRESETS["test-qwen3"]().save_pretrained(tmp_path)
    config, path = resolve_model(str(tmp_path))
    assert path == tmp_path and config.model_type == "qwen3"


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'llama-9000'.*tiny-llama") as info:
        resolve_model("llama-9000")
    assert "\n" not in str(info.value) and "llama3.1-8b" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model("./checkpoints/run1")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is not a directory"):
        resolve_model(tmp_path / "model.safetensors")


def _init(name: str, seed: int, **kw) -> tuple:
    config = PRESETS[name]()
    model = build_model(config)
    host = HostParameters(model)
    init_random(model, host, config, seed, **kw)
    return model, host


def test_init_random_is_deterministic_and_hf_like():
    _, host = _init("tiny-llama", 0)
    _, same = _init("tiny-llama", 0, threads=1)  # thread count does not change the result
    _, other = _init("tiny-llama", 1)
    assert torch.equal(host.slab, same.slab)
    assert not torch.equal(host.slab, other.slab)
    for unit, name, view in host.named_tensors():
        if view.dim() >= 2:
            assert view.std().item() == pytest.approx(0.02, rel=0.1), (unit.name, name)
            assert view.abs().max() > 0
        else:
            assert torch.all(view == 1.0), (unit.name, name)  # RMSNorm weights


def test_init_random_family_rules():
    model, host = _init("test-gemma2", 0)
    norms = [v for _, n, v in host.named_tensors() if v.dim() == 1]
    assert norms and all(torch.all(v == 0) for v in norms)  # Gemma's (1 + w) norms
    pad = model.config.pad_token_id
    assert torch.all(host.views(model.embedding)["embed_tokens.weight"][pad] == 0)

    model, host = _init("test-qwen2", 0)
    biases = {n: v for _, n, v in host.named_tensors() if n.endswith("bias")}
    assert biases and all(torch.all(v == 0) for v in biases.values())

    model, host = _init("test-gpt2", 0)
    views = host.views(model.blocks[0])
    std = model.config.initializer_range
    assert views["attn.c_proj.weight"].std().item() == pytest.approx(std / 2, rel=0.15)  # / sqrt(2 * 2)
    assert views["attn.c_attn.weight"].std().item() == pytest.approx(std, rel=0.1)
    assert torch.all(views["ln_1.weight"] == 1) and torch.all(views["ln_1.bias"] == 0)
