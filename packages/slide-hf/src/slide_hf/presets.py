"""Named model shapes, model resolution and fast HF-style random initialisation.

Presets let a run start without a checkpoint: the published architectures (so memory planning and
benchmarks can use real shapes offline), a ``tiny-llama`` and a ``tiny-gemma2`` (Gemma 2 with its logit
caps) for the CPU demo, and one small config per supported family for tests. Shapes are copied from each
model's public ``config.json``.

``init_random`` writes straight into the host slab, in parallel: ``normal_`` on CPU runs on one core
(~2 s per GB), so an 8B model (32 GB of fp32) would take a minute serially. Each fixed-size chunk gets
its own generator, seeded from (seed, unit, parameter, chunk), so the result does not depend on the
thread count or scheduling -- and torch releases the GIL inside ``normal_``.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel, Unit

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["PRESETS", "ModelNotFoundError", "init_random", "resolve_model"]

PresetFactory = Callable[..., "PreTrainedConfig"]


class ModelNotFoundError(ValueError):
    """Neither a preset name nor an existing model directory."""


def _config(model_type: str, shape: dict[str, Any], **overrides: Any) -> PreTrainedConfig:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**shape, **overrides})


def _preset(model_type: str, **shape: Any) -> PresetFactory:
    """A factory ``(**overrides) -> config``; overrides (e.g. ``vocab_size`` from a tokenizer) win."""
    return partial(_config, model_type, shape)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _default_rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


def _gemma2_released(num_hidden_layers: int) -> dict[str, Any]:
    """What every released Gemma-2 ``config.json`` (google/gemma-2-2b, -9b, -27b) carries besides its
    shape: both logit caps, the 4096-token window on every other layer starting with layer 0, tied
    embeddings, the tanh-GELU MLP, the token ids."""
    return {
        "num_hidden_layers": num_hidden_layers,
        "layer_types": ["sliding_attention", "full_attention"] * (num_hidden_layers // 2),
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _default_rope(10000.0),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


_TEST = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
_TEST_VOCAB = 160

_FAMILY_TEST: dict[str, Any] = {
    **_TEST,
    "vocab_size": 300,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
"""The tiny shape of the test presets of the families added with layer types, per-type rotary tables,
multipliers, linear attention and MLA (2-4 layers, hidden 64, a 300-token vocabulary with its special
ids inside it); each preset switches its family's features on."""


def _gemma4_rope(theta_full: float = 1000000.0) -> dict[str, Any]:
    """Gemma 4's rotary as released: full rotation on sliding layers, a quarter of each (wider) head with
    "proportional" frequencies on full layers."""
    return {
        "sliding_attention": _default_rope(10000.0),
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": theta_full},
    }


def _gemma4_released(num_hidden_layers: int) -> dict[str, Any]:
    """What the released Gemma-4 31B and 26B-A4B text configs share besides their widths: five sliding
    layers (window 1024, heads of 256) per full one (heads of 512, keys as values), the capped tied head,
    no per-layer input embeddings and no key/value sharing (hidden_size_per_layer_input=0,
    num_kv_shared_layers=0: the class defaults are the small E2B/E4B models' settings)."""
    return {
        "num_hidden_layers": num_hidden_layers,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * (num_hidden_layers // 6),
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "rope_parameters": _gemma4_rope(),
        "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "vocab_size": 262144,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "dtype": "bfloat16",
    }


def _gemma4_test() -> dict[str, Any]:
    """The Gemma-4 test shape: a sliding layer (heads of 16, window 4) then a full one (heads of 32, one
    kv head with ``attention_k_eq_v``), both rotary kinds, and a small final cap that acts at test scale."""
    return {
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "intermediate_size": 96,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": _gemma4_rope(),
        "final_logit_softcapping": 2.0,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
    }


def _qwen3_5_rope() -> dict[str, Any]:
    """Qwen3.5's rotary as released: a quarter of each head, three position axes interleaved."""
    return {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }


def _yarn_rope(theta: float, *, factor: float, original: int, attention_factor: float) -> dict[str, Any]:
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": factor,
        "original_max_position_embeddings": original,
        "attention_factor": attention_factor,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }


_QWEN3_8B: dict[str, Any] = {  # Qwen/Qwen3-8B's config.json
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": _default_rope(1000000.0),
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_window_layers": 36,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
}

PRESETS: dict[str, PresetFactory] = {
    # ---- demo ----------------------------------------------------------------------------------------
    "tiny-llama": _preset(
        "llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters=_default_rope(10000.0),
        tie_word_embeddings=True,
    ),
    # ---- published shapes (config.json of each Hub repo) ---------------------------------------------
    "llama3.2-3b": _preset(  # meta-llama/Llama-3.2-3B
        "llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_llama3_rope(32.0),
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
        dtype="bfloat16",
    ),
    "llama3.1-8b": _preset(  # meta-llama/Llama-3.1-8B
        "llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_llama3_rope(8.0),
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        dtype="bfloat16",
    ),
    "qwen2.5-7b": _preset(  # Qwen/Qwen2.5-7B
        "qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_parameters=_default_rope(1000000.0),
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=28,
        bos_token_id=151643,
        eos_token_id=151643,
        dtype="bfloat16",
    ),
    "qwen2.5-14b": _preset(  # Qwen/Qwen2.5-14B
        "qwen2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_default_rope(1000000.0),
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=48,
        bos_token_id=151643,
        eos_token_id=151643,
        dtype="bfloat16",
    ),
    "qwen3-8b": _preset("qwen3", **_QWEN3_8B),  # Qwen/Qwen3-8B
    # Qwen3-8B at 131,072 positions, as its model card says to run past 32,768: YaRN, factor 4 over 32,768
    # (the attention factor HF derives for it, 0.1 ln 4 + 1, written out)
    "qwen3-8b-yarn": _preset(
        "qwen3",
        **{
            **_QWEN3_8B,
            "max_position_embeddings": 131072,
            "rope_parameters": _yarn_rope(
                1000000.0, factor=4.0, original=32768, attention_factor=0.1 * math.log(4.0) + 1
            ),
        },
    ),
    "mistral-7b": _preset(  # mistralai/Mistral-7B-v0.3
        "mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters=_default_rope(1000000.0),
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    ),
    "gemma2-2b": _preset(  # google/gemma-2-2b
        "gemma2",
        hidden_size=2304,
        intermediate_size=9216,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        **_gemma2_released(26),
    ),
    "gemma2-9b": _preset(  # google/gemma-2-9b
        "gemma2",
        hidden_size=3584,
        intermediate_size=14336,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        **_gemma2_released(42),
    ),
    "gemma2-27b": _preset(  # google/gemma-2-27b: queries scaled by hidden / heads = 144, not head_dim
        "gemma2",
        hidden_size=4608,
        intermediate_size=36864,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=144,
        **_gemma2_released(46),
    ),
    # ---- Gemma 2 as released at demo size: both caps, a window shorter than the demo's --seq-len 128,
    # a byte-sized vocabulary (259 tokens) so `slide train --model tiny-gemma2` runs without a tokenizer.
    "tiny-gemma2": _preset(
        "gemma2",
        **{
            **_gemma2_released(4),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "vocab_size": 320,
            "max_position_embeddings": 2048,
        },
    ),
    # ---- one tiny config per family, for tests (seq 12 > sliding windows of 4) -----------------------
    "test-llama": _preset("llama", **_TEST, intermediate_size=96, vocab_size=_TEST_VOCAB, tie_word_embeddings=True),
    "test-llama-untied": _preset(
        "llama", **_TEST, intermediate_size=96, vocab_size=_TEST_VOCAB, tie_word_embeddings=False
    ),
    "test-mistral": _preset("mistral", **_TEST, intermediate_size=96, vocab_size=_TEST_VOCAB, sliding_window=4),
    "test-qwen2": _preset(
        "qwen2",
        **_TEST,
        intermediate_size=96,
        vocab_size=_TEST_VOCAB,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,  # layer 0 full, layer 1 sliding
    ),
    "test-qwen3": _preset("qwen3", **_TEST, head_dim=16, intermediate_size=96, vocab_size=_TEST_VOCAB),
    "test-gemma2": _preset(
        "gemma2",
        **_TEST,
        head_dim=16,
        query_pre_attn_scalar=16,
        intermediate_size=96,
        vocab_size=_TEST_VOCAB,
        sliding_window=4,
        final_logit_softcapping=2.0,  # small caps so the tanh is far from linear at test scale
        attn_logit_softcapping=1.0,
    ),
    "test-phi3": _preset(
        "phi3",
        **_TEST,
        intermediate_size=96,
        vocab_size=_TEST_VOCAB,
        pad_token_id=None,
        eos_token_id=2,
        max_position_embeddings=64,
    ),
    "test-gpt2": _preset(
        "gpt2",
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        vocab_size=_TEST_VOCAB,
        bos_token_id=_TEST_VOCAB - 1,
        eos_token_id=_TEST_VOCAB - 1,
    ),
    "test-qwen3-moe": _preset(
        "qwen3_moe",
        **_TEST,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # layer 0 routed experts, layer 1 dense MLP
        vocab_size=_TEST_VOCAB,
    ),
    # ---- OLMo 2 / OLMo 3 ------------------------------------------------------------------------------
    "olmo2-7b": _preset(  # allenai/OLMo-2-1124-7B
        "olmo2",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=100352,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=_default_rope(500000.0),
        tie_word_embeddings=False,
        pad_token_id=100277,
        eos_token_id=100257,
        dtype="bfloat16",
    ),
    "olmo3-7b": _preset(  # allenai/Olmo-3-1025-7B: YaRN on the full-attention layers only
        "olmo3",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=100278,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        sliding_window=4096,
        rope_parameters={
            "sliding_attention": _default_rope(500000.0),
            "full_attention": _yarn_rope(500000.0, factor=8.0, original=8192, attention_factor=1.2079441541679836),
        },
        tie_word_embeddings=False,
        pad_token_id=100277,
        eos_token_id=100257,
        dtype="bfloat16",
    ),
    "test-olmo2": _preset("olmo2", **_FAMILY_TEST, intermediate_size=96),
    "test-olmo3": _preset(  # one sliding and one full layer, rotated differently (YaRN acts past 8 tokens)
        "olmo3",
        **_FAMILY_TEST,
        intermediate_size=96,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        rope_parameters={
            "sliding_attention": _default_rope(10000.0),
            "full_attention": _yarn_rope(500000.0, factor=8.0, original=8, attention_factor=1.2),
        },
    ),
    # ---- SmolLM3, GLM-4, Granite 3, Ministral 3 ---------------------------------------------------------
    "smollm3-3b": _preset(  # HuggingFaceTB/SmolLM3-3B: every fourth layer without rotary (NoPE)
        "smollm3",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=128256,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_parameters=_default_rope(5000000.0),
        no_rope_layer_interval=4,
        use_sliding_window=False,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128012,
        pad_token_id=128004,
        dtype="bfloat16",
    ),
    "glm4-9b": _preset(  # THUDM/GLM-4-9B-0414
        "glm4",
        hidden_size=4096,
        intermediate_size=13696,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=151552,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters={**_default_rope(10000.0), "partial_rotary_factor": 0.5},
        attention_bias=True,
        tie_word_embeddings=False,
        pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338],
        dtype="bfloat16",
    ),
    "granite-3.3-8b": _preset(  # ibm-granite/granite-3.3-8b-instruct
        "granite",
        hidden_size=4096,
        intermediate_size=12800,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=49159,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_default_rope(10000000.0),
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="bfloat16",
    ),
    "ministral3-8b": _preset(  # mistralai/Ministral-3-8B-Base-2512 (its text_config; the class defaults)
        "ministral3",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=34,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
        max_position_embeddings=262144,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=11,
        dtype="bfloat16",
    ),
    "test-smollm3": _preset(  # layer 0 rotates with full attention, layer 1 is NoPE and slides
        "smollm3",
        **{**_FAMILY_TEST, "tie_word_embeddings": True},
        intermediate_size=96,
        no_rope_layers=[1, 0],
        use_sliding_window=True,
        sliding_window=4,
    ),
    "test-glm4": _preset(
        "glm4",
        **_FAMILY_TEST,
        head_dim=16,
        intermediate_size=96,
        rope_parameters={**_default_rope(10000.0), "partial_rotary_factor": 0.5},
        attention_bias=True,
    ),
    "test-granite": _preset(  # multipliers far from 1 so that dropping one changes every loss
        "granite",
        **{**_FAMILY_TEST, "tie_word_embeddings": True},
        intermediate_size=96,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.5,
        logits_scaling=4.0,
        initializer_range=0.2,  # scores large enough at init for the attention multiplier to move the loss
    ),
    "test-ministral3": _preset(  # YaRN and the Llama-4 query scale acting past position 4, sliding layers
        "ministral3",
        **{**_FAMILY_TEST, "tie_word_embeddings": True},
        head_dim=16,
        intermediate_size=96,
        initializer_range=0.2,  # scores large enough at init for the query scale to move the loss
        max_position_embeddings=64,
        sliding_window=4,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5,
        },
    ),
    # ---- Gemma 3 (text) ----------------------------------------------------------------------------------
    "gemma3-12b": _preset(  # google/gemma-3-12b-pt, its text_config (the language model of Gemma3ForConditionalGeneration)
        "gemma3_text",
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
        rope_parameters={
            "sliding_attention": _default_rope(10000.0),
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        vocab_size=262208,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        dtype="bfloat16",
    ),
    "test-gemma3": _preset(  # both layer types with their own rotary (linear scaling on full), both caps
        "gemma3_text",
        **{**_FAMILY_TEST, "tie_word_embeddings": True},
        head_dim=16,
        query_pre_attn_scalar=16,
        intermediate_size=96,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": _default_rope(10000.0),
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        final_logit_softcapping=2.0,  # small caps so the tanh is far from linear at test scale
        attn_logit_softcapping=1.0,
    ),
    # ---- Qwen3-Next, Qwen3.5: gated delta-net layers between full-attention layers --------------------
    "qwen3-next-80b-a3b": _preset(  # Qwen/Qwen3-Next-80B-A3B-Instruct
        "qwen3_next",
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        vocab_size=151936,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={**_default_rope(10000000.0), "partial_rotary_factor": 0.25},
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
    "test-qwen3-next": _preset(  # a delta-net layer and a full layer, 4 experts + a shared one in each
        "qwen3_next",
        **_FAMILY_TEST,
        head_dim=16,
        intermediate_size=96,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters={**_default_rope(10000.0), "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
    ),
    "qwen3.5-9b": _preset(  # Qwen/Qwen3.5-9B, its text_config (the class defaults are this model's)
        "qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters=_qwen3_5_rope(),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "qwen3.5-35b-a3b": _preset(  # Qwen/Qwen3.5-35B-A3B, its text_config (the class defaults are this model's)
        "qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        vocab_size=248320,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters=_qwen3_5_rope(),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "test-qwen3.5": _preset(  # a delta-net layer and a full layer; text positions on the three rotary axes
        "qwen3_5_text",
        **{**_FAMILY_TEST, "tie_word_embeddings": True},
        head_dim=16,
        intermediate_size=96,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters={**_qwen3_5_rope(), "rope_theta": 10000.0, "mrope_section": [1, 1, 0]},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "test-qwen3.5-moe": _preset(  # as test-qwen3.5, with 4 experts and a shared one in each layer
        "qwen3_5_moe_text",
        **_FAMILY_TEST,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters={**_qwen3_5_rope(), "rope_theta": 10000.0, "mrope_section": [1, 1, 0]},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # ---- Llama 4 (text), DeepSeek-V3 -------------------------------------------------------------------
    "llama4-scout-text": _preset(  # meta-llama/Llama-4-Scout-17B-16E, its text_config (the class defaults)
        "llama4_text",
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=202048,
        max_position_embeddings=10485760,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        no_rope_layer_interval=4,
        attention_chunk_size=8192,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "test-llama4": _preset(  # a chunked rotary dense layer, a NoPE global MoE layer (temperature past 4 tokens)
        "llama4_text",
        **_FAMILY_TEST,
        head_dim=16,
        intermediate_size=32,
        intermediate_size_mlp=96,
        max_position_embeddings=64,
        no_rope_layers=[1, 0],
        attention_chunk_size=4,
        interleave_moe_layer_step=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
        initializer_range=0.2,  # scores large enough at init for the chunks and the temperature to act
    ),
    "moonlight-16b-a3b": _preset(  # moonshotai/Moonlight-16B-A3B: DeepSeek-V3 layers at DeepSeek-V2-Lite's size
        "deepseek_v3",
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        vocab_size=163840,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters=_default_rope(50000.0),
        tie_word_embeddings=False,
        bos_token_id=163584,
        eos_token_id=163585,
        dtype="bfloat16",
    ),
    "test-deepseek-v3": _preset(  # a dense layer, then an MoE layer routing within 1 of 2 expert groups; MLA
        "deepseek_v3",
        **{**_FAMILY_TEST, "num_key_value_heads": 4},  # MLA expands every head's key from the latent
        intermediate_size=96,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ),
    # ---- Gemma 4 (text) ----------------------------------------------------------------------------------
    "gemma4-31b": _preset(  # google/gemma-4-31B, its text_config (the language model of Gemma4ForConditionalGeneration)
        "gemma4_text",
        **_gemma4_released(60),
        hidden_size=5376,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
    ),
    "gemma4-26b-a4b": _preset(  # google/gemma-4-26B-A4B, its text_config: 128 experts beside a dense MLP per layer
        "gemma4_text",
        **_gemma4_released(30),
        hidden_size=2816,
        intermediate_size=2112,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
    ),
    "gemma4-e2b": _preset(  # google/gemma-4-E2B, its text_config: per-layer inputs, the last 20 layers sharing k/v
        "gemma4_text",
        **{
            **_gemma4_released(35),
            "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
            "attention_k_eq_v": False,
            "sliding_window": 512,
            "hidden_size_per_layer_input": 256,
            "num_kv_shared_layers": 20,
            "max_position_embeddings": 131072,
        },
        hidden_size=1536,
        intermediate_size=6144,
        num_attention_heads=8,
        num_key_value_heads=1,
        vocab_size_per_layer_input=262144,
        use_double_wide_mlp=True,
    ),
    "test-gemma4": _preset(  # released features at test size: k = v full layers with wider heads, a capped head
        "gemma4_text",
        **{**_FAMILY_TEST, "tie_word_embeddings": True},
        **_gemma4_test(),
    ),
    "test-gemma4-ple": _preset(  # the small releases' features: per-layer inputs, the last two layers sharing k/v
        "gemma4_text",
        **{**_FAMILY_TEST, "num_hidden_layers": 4, "tie_word_embeddings": True},
        **{
            **_gemma4_test(),
            "attention_k_eq_v": False,
            "num_global_key_value_heads": None,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 2,
        },
        vocab_size_per_layer_input=300,
        use_double_wide_mlp=True,
    ),
    "test-gemma4-moe": _preset(  # 4 experts (top 2) beside the dense MLP; separate v_proj on full layers; untied
        "gemma4_text",
        **_FAMILY_TEST,
        **{**_gemma4_test(), "attention_k_eq_v": False},
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}


def run_overrides(name: str) -> dict[str, Any]:
    """The changes `slide train` makes to a preset's config, which `slide plan` must make too to price the
    same model: ``tiny-llama`` trains with the bundled byte tokenizer, so its vocabulary is that
    tokenizer's."""
    from slide_hf.tokenizer import BYTE_VOCAB_SIZE

    return {"vocab_size": BYTE_VOCAB_SIZE} if name == "tiny-llama" else {}


def resolve_model(name_or_dir: str | os.PathLike[str], **overrides: Any) -> tuple[PreTrainedConfig, Path | None]:
    """``(config, model_dir)`` for an existing HF model directory, ``(config, None)`` for a preset.

    ``overrides`` apply to presets only (a checkpoint's shape is what it is). An existing directory wins
    over a preset of the same name. Raises :class:`ModelNotFoundError` in one line, listing the presets.
    """
    path = Path(name_or_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ModelNotFoundError(f"{path} is not a directory; pass the model directory (with config.json)")
    if path.is_dir():
        from slide_hf.load import load_config

        return load_config(path), path
    name = str(name_or_dir)
    if name in PRESETS:
        return PRESETS[name](**overrides), None
    if os.sep in name or name.startswith((".", "~")) or path.suffix:
        raise ModelNotFoundError(f"model directory {path} does not exist")
    raise ModelNotFoundError(
        f"unknown model {name!r}: not a directory, and not a preset ({', '.join(sorted(PRESETS))})"
    )


_CHUNK = 1 << 22  # 4M elements (16 MB fp32) per generator
_Rule = Callable[[Unit, str, tuple[int, ...]], tuple[str, float]]


def init_random(
    model: SlideModel,
    host_params: HostParameters,
    config: PreTrainedConfig,
    seed: int = 0,
    *,
    threads: int | None = None,
) -> None:
    """Fill ``host_params`` the way HF's ``_init_weights`` would, deterministically for ``seed``.

    Matrices and embeddings ~ N(0, ``initializer_range``) (adapters may scale some, e.g. GPT-2's
    residual projections), biases 0, norm weights 1 (0 for Gemma's ``1 + w`` norms), the padding row of
    the embedding 0.
    """
    rule: _Rule = getattr(model, "init_rule", None) or partial(_default_rule, config)
    padding = getattr(model, "padding_row", lambda: None)()
    workers = threads or os.cpu_count() or 1
    with torch.no_grad(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slide-init") as pool:
        for unit in model.units:  # one unit at a time: a split master is encoded per unit
            with host_params.overwriting(unit) as views:  # every parameter is written below
                normal_jobs = []
                for spec in unit.layout:
                    kind, value = rule(unit, spec.name, spec.shape)
                    flat = views[spec.name].view(-1)
                    if kind == "constant":
                        flat.fill_(value)
                    elif kind == "normal":
                        for i, chunk in enumerate(flat.split(_CHUNK)):
                            normal_jobs.append((chunk, value, _chunk_seed(seed, unit.name, spec.name, i)))
                    else:
                        raise ValueError(f"unknown init kind {kind!r} for {unit.name}/{spec.name}")
                list(pool.map(_normal_chunk, normal_jobs))
                if padding is not None and unit is model.embedding:
                    param, row = padding
                    views[param][row].zero_()


def _default_rule(config: PreTrainedConfig, unit: Unit, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    if len(shape) >= 2:
        return "normal", float(getattr(config, "initializer_range", 0.02))
    return "constant", 0.0 if name.endswith("bias") else 1.0


def _chunk_seed(seed: int, unit: str, param: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{unit}/{param}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _normal_chunk(job: tuple[torch.Tensor, float, int]) -> None:
    chunk, std, chunk_seed = job
    chunk.normal_(0.0, std, generator=torch.Generator().manual_seed(chunk_seed))
