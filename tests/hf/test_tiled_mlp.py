"""slide_hf/adapters/tiled_mlp.py and token_tiles.py: the gated MLP over tiles of tokens computes what the
untiled MLP does.

The whole-model tests (the RMSNorms tiled too, slide_hf/adapters/tiled_norm.py) run a long row (4,096 tokens) of tiny Llama, Qwen3 and Gemma 3 configs in fp32 on the
CPU, tiled and untiled, and compare the loss and every parameter gradient with each other and with
transformers' own model (``AutoModelForCausalLM`` forward and ``loss.backward()``, none of our code).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from slide_hf.adapters.tiled_mlp import tile_mlps
from slide_hf.adapters.token_tiles import SeqTiling, TokenTilesFunction, run_over_tiles

SEQ = 4096
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
CASES = {"test-llama": ("sdpa", 1000), "test-qwen3": ("sdpa", 512), "test-gemma3": ("eager", 1000)}
"""Preset -> (attention, tokens per tile): tiles that leave a short last tile and one that divides the row.
Gemma 3's layers cap their attention logits, which sdpa cannot: the CPU runs them eagerly
(adapters/attention.py)."""


class _ReferenceMLP(nn.Module):
    """HF's dense gated MLP, written out (``LlamaMLP``'s forward): the reference a tile must reproduce."""

    def __init__(self, hidden: int, inner: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN["silu"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _reference_grads(mlp: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_()
    mlp.zero_grad()
    mlp(x).backward(grad_out)
    return {"x": x.grad, **{n: p.grad.clone() for n, p in mlp.named_parameters()}}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("tokens", "tile"), [(123, 50), (96, 32), (5, 1)])
def test_tiles_match_the_untiled_mlp(tokens: int, tile: int, bias: bool) -> None:
    torch.manual_seed(0)
    mlp = _ReferenceMLP(16, 40, bias=bias)
    config = type("Config", (), {"hidden_act": "silu"})()
    reference = _ReferenceMLP(16, 40, bias=bias)
    reference.load_state_dict(mlp.state_dict())
    tiling = SeqTiling(tile)
    assert tile_mlps(mlp, config, tiling) == [""]
    x = torch.randn(1, tokens, 16)
    grad_out = torch.randn(1, tokens, 16)
    expected = _reference_grads(reference, x, grad_out)
    got = _reference_grads(mlp, x, grad_out)
    torch.testing.assert_close(mlp(x), reference(x), rtol=1e-6, atol=1e-6)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_below_a_tile_the_untiled_forward_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    mlp = _ReferenceMLP(8, 24)
    tile_mlps(mlp, type("Config", (), {"hidden_act": "silu"})(), SeqTiling(64))
    calls = []
    monkeypatch.setattr(TokenTilesFunction, "apply", lambda *args: calls.append(args) or args[0])
    mlp(torch.randn(2, 32, 8, requires_grad=True))  # 64 tokens: one tile
    assert calls == []
    mlp(torch.randn(1, 65, 8, requires_grad=True))  # 65 tokens: two tiles, through the Function
    assert len(calls) == 1 and calls[0][1] == 64


def test_backward_holds_one_tile_of_intermediates() -> None:
    """What autograd keeps after the forward is the input and the weights; the backward's largest
    intermediate is one tile wide (counted by the shapes the tile function sees)."""
    torch.manual_seed(0)
    mlp = _ReferenceMLP(8, 24)
    weights = [mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None]
    seen: list[int] = []

    def tile_forward(x: torch.Tensor, params: Any) -> torch.Tensor:
        seen.append(x.shape[0])
        wg, _, wu, _, wd, _ = params
        return torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.T) * (x @ wu.T), wd)

    x = torch.randn(1, 100, 8, requires_grad=True)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = run_over_tiles(x, 30, tile_forward, weights)
    assert sorted(saved, key=str) == sorted([x.shape, *(w.shape for w in weights if w is not None)], key=str)
    y.sum().backward()
    assert seen == [30, 30, 30, 10] * 2  # forward, then the backward's recompute


def test_low_precision_weight_grads_accumulate_in_fp32() -> None:
    """bf16 weights: the tiles' weight gradients are summed in fp32, so the result is the fp32 sum rounded
    once, not rounded after every tile."""
    torch.manual_seed(0)
    mlp = _ReferenceMLP(16, 32).bfloat16()
    weights = [mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None]

    def tile_forward(x: torch.Tensor, params: Any) -> torch.Tensor:
        wg, _, wu, _, wd, _ = params
        return torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.T) * (x @ wu.T), wd)

    x = torch.randn(1, 256, 16, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(1, 256, 16, dtype=torch.bfloat16)
    tiled = torch.autograd.grad(run_over_tiles(x, 8, tile_forward, weights), [weights[4]], grad_out)[0]
    in_fp32 = torch.zeros(weights[4].shape)
    in_bf16 = torch.zeros(weights[4].shape, dtype=torch.bfloat16)
    with torch.no_grad():
        for start in range(0, 256, 8):  # each tile's bf16 down-projection gradient, as autograd makes it
            rows = x[0, start : start + 8]
            hidden = torch.nn.functional.silu(rows @ weights[0].T) * (rows @ weights[2].T)
            tile_grad = grad_out[0, start : start + 8].T @ hidden
            in_fp32 += tile_grad
            in_bf16 += tile_grad
    assert tiled.dtype == torch.bfloat16
    torch.testing.assert_close(tiled, in_fp32.bfloat16(), rtol=0, atol=0)
    assert not torch.equal(tiled, in_bf16)  # the test can tell the two sums apart


def _loss_and_grads(model: Any, host: Any, helpers: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    leaves = helpers.leaves_of(model, host)
    loss = helpers.run_units(model, leaves, ids, labels)
    loss.backward()
    grads = {(unit, name): leaf.grad for unit, params in leaves.items() for name, leaf in params.items()}
    return loss.detach(), grads


def _row(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :100] = -100
    return ids, labels


@pytest.mark.parametrize("preset", list(CASES))
def test_tiled_model_matches_untiled_and_transformers(
    preset: str, reference: Any, helpers: Any, torch_kernels: None
) -> None:
    attention, tile = CASES[preset]
    ref = reference(preset, attn=attention)
    model = ref.model
    for block in model.blocks:  # the MLP and every RMSNorm of the layer (Qwen3's and Gemma 3's q/k norms too)
        norms = [name for name, module in block.root.named_modules() if type(module).__name__.endswith("RMSNorm")]
        assert sorted(block.tiled_modules) == sorted(["mlp", *norms]) and norms
    ids, labels = _row(ref.hf.config.vocab_size)

    loss_untiled, grads_untiled = _loss_and_grads(model, ref.host, helpers, ids, labels)
    ref.hf.zero_grad()
    hf_loss = ref.hf(ids, labels=labels).loss
    hf_loss.backward()

    model.seq_tiling.tile_tokens = tile
    loss, grads = _loss_and_grads(model, ref.host, helpers, ids, labels)
    assert abs(loss.item() - loss_untiled.item()) <= LOSS_RTOL * abs(loss_untiled.item())
    assert abs(loss.item() - hf_loss.item()) <= LOSS_RTOL * abs(hf_loss.item())
    assert len(grads) == len(list(ref.hf.parameters()))  # every parameter of the model is compared
    for (unit, name), grad in grads.items():
        assert helpers.rel_err(grad, grads_untiled[unit, name]) <= GRAD_RTOL, (unit, name)
        assert helpers.rel_err(grad, helpers.hf_param(ref, unit, name).grad) <= GRAD_RTOL, (unit, name, "transformers")


TRAIN = ("--device", "cpu", "--dtype", "float32", "--steps", "3", "--seq-len", "32", "--batch-size", "2")


def _train_losses(slide: Any, output: Any, *extra: str) -> list[float]:
    metrics = output / "metrics.jsonl"
    status, _, err = slide("train", "--output", output, "--metrics", metrics, *TRAIN, *extra)
    assert status == 0, err
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_slide_train_with_tiles_trains_as_without(slide: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slide train --seq-tile 16` on micro-batches of 2 x 32 tokens runs the engine's blocks through the tiles
    (the tile set where the run places its units) and takes the same steps as `--seq-tile 0`."""
    calls = []
    apply = TokenTilesFunction.apply

    def counted(*args: Any) -> Any:
        calls.append(args[1])
        return apply(*args)

    monkeypatch.setattr(TokenTilesFunction, "apply", counted)
    untiled = _train_losses(slide, tmp_path / "untiled", "--seq-tile", "0")
    assert calls == []
    tiled = _train_losses(slide, tmp_path / "tiled", "--seq-tile", "16")
    assert calls and set(calls) == {16}
    for a, b in zip(tiled, untiled, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
