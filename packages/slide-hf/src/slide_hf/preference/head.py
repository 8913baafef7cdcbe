"""The head of a preference run: per-completion log-probabilities, the pair loss, and an exact gradient.

Note [Preference loss through a weighted cross-entropy]: DPO and SimPO are functions of a few numbers per
pair (each completion's summed log-probability), and a completion's log-probability is minus the sum of
its tokens' cross-entropies. So the head, per micro-batch:

1. computes every trained token's log-probability without grad, chunk by chunk over the tokens, so the
   (tokens, vocab) logits never exist in fp32 at once;
2. sums them per completion (Note [Tagged preference labels] in preference/tags.py says which token is
   whose), evaluates the pair losses on those tiny tensors (preference/losses.py) and differentiates them
   there with autograd: ``g = d loss / d logp`` per completion;
3. runs the cross-entropy of every token weighted by ``-g`` of its completion, whose gradient is then
   exactly the pair loss's gradient (``d logp_seq = -sum d CE_t``): slide-kernels' fused linear
   cross-entropy with per-row weights where it is installed, else chunk by chunk in PyTorch
   (:class:`_WeightedCrossEntropy`). Steps 1 and 3 each run the LM head's matmul once more than SFT's
   single fused pass;
4. returns ``loss.detach() + carrier``: the value is the pair losses' sum, the gradient the weighted
   cross-entropy's (``carrier`` is zero-valued).

The engine divides the step's summed head values by ``SlideModel.loss_token_count``, which a preference
model answers with the number of pairs (tags.py's :func:`pair_count`), so the step's loss and gradient are
the mean over all pairs of the step, across micro-batches and accumulation, as TRL's with the same
effective batch. A pair's two completions are always in one row (data/preference.py), so in one micro-batch.
With data parallel the engine sums those counts over the ranks before the first micro-batch (as it sums
SFT's label tokens), so every rank divides by the pairs of the global batch, and the ranks' summed
gradients are one process's at that batch; the metrics' sums are added over the ranks the same way
(:meth:`PreferenceHead.take_metric_sums`, preference/run.py).

During the DPO reference pass (:attr:`PreferenceHead.collecting`) the head only adds each completion's
summed log-probability into :attr:`PreferenceHead.reference`, indexed by the completion's global number.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from slide_hf.preference.losses import PairLoss, pair_losses
from slide_hf.preference.tags import decode_tags

__all__ = ["METRIC_NAMES", "PreferenceHead", "PreferenceMetrics", "metric_means"]

_CHUNK_ELEMENTS = 1 << 25
"""Logits per chunk (rows x vocab): 128 MiB in fp32, whatever the vocabulary."""

METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""The per-step metrics, named as TRL's trainers log them (means over the step's pairs)."""

PreferenceMetrics = dict[str, float]


class PreferenceHead:
    """A preference loss over ``pairs`` pairs (the prepared data's), as a head computes it.

    Holds per-run state on the device it computes on: the DPO reference log-probabilities (one per
    completion) and the sums of the step's metrics, read and reset once per logged step (:meth:`take_metric_sums`).
    """

    def __init__(self, loss: PairLoss, pairs: int) -> None:
        if pairs < 1:
            raise ValueError(f"a preference head needs at least one pair, got {pairs}")
        self.loss = loss
        self.pairs = pairs
        self.reference: torch.Tensor | None = None
        """(2 x pairs,) fp32: each completion's summed log-probability under the reference model (DPO)."""
        self.collecting = False
        """True during the reference pass: the head adds log-probabilities into :attr:`reference`."""
        self._metric_sums: torch.Tensor | None = None

    # -- state --------------------------------------------------------------------------------------------
    def start_reference(self, device: torch.device) -> None:
        """Begin a reference pass: zeroed log-probabilities on ``device``, which the head fills."""
        self.reference = torch.zeros(2 * self.pairs, dtype=torch.float32, device=device)
        self.collecting = True

    def use_reference(self, reference: torch.Tensor, device: torch.device) -> None:
        """Take saved reference log-probabilities (one per completion) for training on ``device``."""
        if tuple(reference.shape) != (2 * self.pairs,):
            raise ValueError(
                f"reference log-probabilities of shape {tuple(reference.shape)}, expected ({2 * self.pairs},)"
            )
        self.reference = reference.to(device=device, dtype=torch.float32)
        self.collecting = False

    def take_metric_sums(self) -> torch.Tensor:
        """The sums of the metrics of the micro-batches since the last call, on the host in float64: the
        pairs, then one sum per name of :data:`METRIC_NAMES` (zeros where none was computed); resets them.
        Sums, not means, so that data-parallel ranks can add theirs (:func:`metric_means`). Note: a
        CPU-GPU sync point (once per logged step)."""
        if self._metric_sums is None:
            return torch.zeros(1 + len(METRIC_NAMES), dtype=torch.float64)
        sums = self._metric_sums.to("cpu", torch.float64)
        self._metric_sums.zero_()
        return sums

    # -- the loss -----------------------------------------------------------------------------------------
    def loss_sum(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        shift_labels: torch.Tensor,
        *,
        softcap: float | None,
        grad_weight_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The summed pair losses of this micro-batch (fp32, 0-dim), with the exact gradient (Note [Preference
        loss through a weighted cross-entropy]); during the reference pass, zero, having recorded the
        completions' log-probabilities. ``grad_weight_out``: the engine's buffer for the head matrix's
        gradient, which the fused kernel writes as SFT's does (``Unit.grads_in_forward``)."""
        training = torch.is_grad_enabled()
        h = hidden.reshape(-1, hidden.shape[-1])
        tokens, completions = decode_tags(shift_labels.reshape(-1))
        fused = _fused_kernels()
        with torch.no_grad():
            token_logps = (_token_logps if fused is None else _fused_token_logps)(h, weight, tokens, softcap)
            count = 2 * self.pairs
            index = torch.where(completions >= 0, completions, count)  # untrained tokens into a spill slot
            sums = torch.zeros(count + 1, dtype=torch.float32, device=h.device).index_add_(0, index, token_logps)
            lengths = torch.zeros(count + 1, dtype=torch.float32, device=h.device)
            lengths.index_add_(0, index, (completions >= 0).float())
            sums, lengths = sums[:count], lengths[:count]
        if self.collecting:
            assert self.reference is not None
            self.reference.add_(sums)
            return torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.enable_grad():
            logps = sums.detach().requires_grad_(True)
            total, metrics = self._pair_total(logps, lengths)
            grads = torch.autograd.grad(total, logps)[0] if training else None
        self._add_metrics(metrics)
        if grads is None:
            return total.detach()
        token_weights = torch.where(completions >= 0, -grads[completions.clamp(min=0)], 0.0)
        if fused is None:
            carrier = _WeightedCrossEntropy.apply(h, weight, token_weights, tokens, softcap)
        else:
            weighted = fused[0](
                h, weight, tokens, reduction="sum", softcap=softcap, row_weight=token_weights,
                grad_weight_out=grad_weight_out,
            )  # fmt: skip
            carrier = weighted - weighted.detach()
        return total.detach() + carrier

    def _pair_total(self, logps: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed loss over the pairs present in this micro-batch (both completions with a trained
        token), and the sums of their metrics."""
        loss = self.loss
        scale = lengths.clamp(min=1)
        values = logps / scale if loss.averages else logps
        reference: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if loss.needs_reference:
            if self.reference is None:
                raise RuntimeError("DPO needs the reference pass before training")
            ref = self.reference / scale if loss.averages else self.reference
            reference = (ref[0::2], ref[1::2])
        losses, chosen_rewards, rejected_rewards = pair_losses(loss, values[0::2], values[1::2], *reference)
        # A pair counts only with both completions here: one side alone would compare a completion with
        # an empty one (logp 0), a loss with a gradient that teaches nothing the pair says.
        present = ((lengths[0::2] > 0) & (lengths[1::2] > 0)).float()
        total = (losses * present).sum()
        with torch.no_grad():
            metrics = torch.stack(
                [
                    present.sum(),
                    (chosen_rewards * present).sum(),
                    (rejected_rewards * present).sum(),
                    ((chosen_rewards > rejected_rewards).float() * present).sum(),
                    ((chosen_rewards - rejected_rewards) * present).sum(),
                    (values[0::2].detach() * present).sum(),
                    (values[1::2].detach() * present).sum(),
                ]
            )
        return total, metrics

    def _add_metrics(self, metrics: torch.Tensor) -> None:
        if self._metric_sums is None or self._metric_sums.device != metrics.device:
            self._metric_sums = torch.zeros_like(metrics)
        self._metric_sums.add_(metrics)


def metric_means(sums: torch.Tensor) -> PreferenceMetrics:
    """The metrics as means over the pairs, from :meth:`PreferenceHead.take_metric_sums` (one rank's, or
    every rank's added); empty where no pair was computed."""
    pairs, *values = sums.tolist()
    if pairs == 0:
        return {}
    return {name: value / pairs for name, value in zip(METRIC_NAMES, values, strict=True)}


@functools.cache
def _fused_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., Any]] | None:
    """slide-kernels' fused linear cross-entropy (autograd) and its launcher, or None where it is not
    installed. Resolved on first use, not at import: slide_kernels may import triton."""
    try:
        from slide_kernels.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_forward
    except ImportError:
        return None
    return linear_cross_entropy, linear_cross_entropy_forward


def _fused_token_logps(
    h: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    """:func:`_token_logps` through the fused kernel: its per-row losses are minus the log-probabilities."""
    fused = _fused_kernels()
    assert fused is not None
    rows = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    fused[1](h, weight, tokens, reduction="sum", softcap=softcap, grad_hidden=False, grad_weight=False, rows_out=rows)
    return rows.neg_()


def _rows_per_chunk(tokens: int, vocab: int) -> int:
    return max(1, min(tokens, _CHUNK_ELEMENTS // max(vocab, 1)))


def _logits(h: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits of ``h`` as HF computes them (matmul in the compute dtype, softcap, then upcast), and the
    softcap's tanh for the backward (None without a softcap)."""
    logits = F.linear(h, weight)
    if softcap is None:
        return logits.float(), None
    squashed = torch.tanh(logits / softcap)
    return (squashed * softcap).float(), squashed.float()


def _token_logps(h: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """(N,) fp32 log-probability of each token's label (0 where ``tokens`` is negative), chunk by chunk."""
    out = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    rows = _rows_per_chunk(h.shape[0], weight.shape[0])
    for start in range(0, h.shape[0], rows):
        logits, _ = _logits(h[start : start + rows], weight, softcap)
        chunk_tokens = tokens[start : start + rows]
        picked = logits.gather(1, chunk_tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
        out[start : start + rows] = torch.where(chunk_tokens >= 0, picked - logits.logsumexp(-1), 0.0)
    return out


class _WeightedCrossEntropy(torch.autograd.Function):
    """A zero-valued carrier of the gradient of ``sum_t w_t CE_t`` with respect to ``h`` and ``weight``.

    The gradients are made in the forward, chunk by chunk (the weights are known by then), so neither the
    logits nor their softmax is kept for the backward; the backward scales them by the incoming gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        token_weights: torch.Tensor,
        tokens: torch.Tensor,
        softcap: float | None,
    ) -> torch.Tensor:
        grad_h = torch.empty_like(h)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        rows = _rows_per_chunk(h.shape[0], weight.shape[0])
        for start in range(0, h.shape[0], rows):
            chunk = h[start : start + rows]
            logits, squashed = _logits(chunk, weight, softcap)
            chunk_tokens = tokens[start : start + rows]
            dlogits = logits.softmax(-1)
            dlogits.scatter_add_(1, chunk_tokens.clamp(min=0).unsqueeze(1), torch.full_like(dlogits[:, :1], -1.0))
            dlogits.mul_(token_weights[start : start + rows].unsqueeze(1))
            if squashed is not None:
                dlogits.mul_(1 - squashed * squashed)
            dz = dlogits.to(h.dtype)
            grad_h[start : start + rows] = dz @ weight
            grad_weight.addmm_(dz.t().float(), chunk.float())
        ctx.grads = (grad_h, grad_weight.to(weight.dtype))  # made here, not saved inputs: held on ctx
        return torch.zeros((), dtype=torch.float32, device=h.device)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_weight = ctx.grads
        scale = grad_output.to(grad_h.dtype)
        return grad_h * scale, grad_weight * scale, None, None, None
