"""Long-context RoPE with tiled blocks: a 4,096-token row of tiny Llama (Llama 3's ``llama3`` frequency scaling)
and Qwen3 (YaRN, whose attention factor also scales cos and sin) configs, in fp32 on the CPU, gives the same
loss and gradients tiled (slide_hf/adapters/token_tiles.py), untiled, and in transformers' own model.

Each config.json is written as the released checkpoints write it (a ``rope_scaling`` dict beside
``rope_theta``), and transformers' reference model is loaded from that same file, so what both sides
read is the checkpoint's spelling, not a config object handed over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM

from slide_core.host_params import HostParameters
from slide_hf import build_model
from slide_hf.load import load_config, load_weights
from slide_hf.presets import PRESETS

SEQ = 4096
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
ROPE = {
    "llama3": (
        "test-llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        500000.0,
        1000,
    ),
    "yarn": (
        "test-qwen3",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        10000.0,
        512,
    ),
}
"""Case -> (preset, the checkpoint's ``rope_scaling``, ``rope_theta``, tokens per tile)."""


def _checkpoint(case: str, path: Path) -> tuple[Any, Path]:
    """transformers' model of the case, loaded back from a directory whose config.json has the scaling as
    a checkpoint spells it."""
    preset, scaling, theta, _ = ROPE[case]
    config = PRESETS[preset]()
    config.max_position_embeddings = 2 * SEQ
    config.rope_parameters = {**scaling, "rope_theta": theta}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    written.pop("rope_parameters", None)
    written.update({"rope_scaling": scaling, "rope_theta": theta})
    (path / "config.json").write_text(json.dumps(written))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    assert hf.model.rotary_emb.rope_type == scaling["rope_type"]  # the file's scaling is the one that runs
    return hf, path


def _row(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :100] = -100
    return ids, labels


def _loss_and_grads(model: Any, host: Any, helpers: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    leaves = helpers.leaves_of(model, host)
    loss = helpers.run_units(model, leaves, ids, labels)
    loss.backward()
    grads = {(unit, name): leaf.grad for unit, params in leaves.items() for name, leaf in params.items()}
    return loss.detach(), grads


def _hf_grad(hf: Any, model: Any, unit_name: str, param: str) -> torch.Tensor:
    unit = next(u for u in model.units if u.name == unit_name)
    return hf.get_parameter(unit.checkpoint_names[param]).grad


@pytest.mark.parametrize("case", sorted(ROPE))
def test_tiled_blocks_with_scaled_rope_match_untiled_and_transformers(
    case: str, tmp_path: Path, helpers: Any, torch_kernels: None
) -> None:
    hf, path = _checkpoint(case, tmp_path / case)
    config = load_config(path)
    config._attn_implementation = "sdpa"
    assert config.rope_parameters["rope_type"] == ROPE[case][1]["rope_type"]
    model = build_model(config)
    host = HostParameters(model)
    load_weights(model, host, path)
    ids, labels = _row(hf.config.vocab_size)

    loss_untiled, grads_untiled = _loss_and_grads(model, host, helpers, ids, labels)
    hf.zero_grad()
    hf_loss = hf(ids, labels=labels).loss
    hf_loss.backward()

    model.seq_tiling.tile_tokens = ROPE[case][3]
    loss, grads = _loss_and_grads(model, host, helpers, ids, labels)
    assert abs(loss.item() - loss_untiled.item()) <= LOSS_RTOL * abs(loss_untiled.item())
    assert abs(loss.item() - hf_loss.item()) <= LOSS_RTOL * abs(hf_loss.item())
    assert len(grads) == len(list(hf.parameters()))  # every parameter of the model is compared
    for (unit, name), grad in grads.items():
        assert helpers.rel_err(grad, grads_untiled[unit, name]) <= GRAD_RTOL, (unit, name)
        assert helpers.rel_err(grad, _hf_grad(hf, model, unit, name)) <= GRAD_RTOL, (unit, name, "transformers")


def test_the_scaling_changes_the_loss(tmp_path: Path) -> None:
    """The cases test something: at 4,096 tokens the scaled frequencies give another loss than plain RoPE."""
    hf, _ = _checkpoint("yarn", tmp_path / "yarn")
    ids, labels = _row(hf.config.vocab_size)
    scaled = hf(ids, labels=labels).loss.item()
    plain_config = PRESETS["test-qwen3"]()
    plain_config.max_position_embeddings = 2 * SEQ
    plain = AutoModelForCausalLM.from_config(plain_config, attn_implementation="sdpa").float().eval()
    plain.load_state_dict(hf.state_dict())
    assert abs(plain(ids, labels=labels).loss.item() - scaled) > 1e-4
