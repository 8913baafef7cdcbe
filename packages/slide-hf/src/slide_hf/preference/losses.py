"""The preference losses on per-completion log-probabilities, written from their papers and matched to TRL.

Every function here works on tiny tensors (one value per pair): the head (preference/head.py) turns token
log-probabilities into these, differentiates the loss through them, and sends the result back to the
tokens as weights. Conventions, as TRL names and computes them:

- DPO, ``sigmoid`` (Rafailov et al. 2023; TRL ``DPOTrainer`` ``loss_type="sigmoid"``):
  ``z = beta * ((pi_c - pi_r) - (ref_c - ref_r))``, loss ``-logsigmoid(z) (1 - eps) - logsigmoid(-z) eps``
  where ``eps`` is the label smoothing (conservative DPO, Mitchell 2023). Log-probabilities are summed over
  each completion's tokens.
- DPO, ``ipo`` (Azar et al. 2023; TRL ``loss_type="ipo"``): ``h = (pi_c - pi_r) - (ref_c - ref_r)``, loss
  ``(h - 1 / (2 beta))**2``, with log-probabilities *averaged* over each completion's tokens, as TRL does
  for IPO. No label smoothing.
- SimPO (Meng et al. 2024; TRL ``CPOTrainer`` ``loss_type="simpo"``, ``cpo_alpha=0``): reference-free,
  ``z = beta * (avg_c - avg_r) - gamma`` with averaged log-probabilities and ``gamma`` TRL's
  ``simpo_gamma`` (a margin in reward units, subtracted after the beta scaling), loss
  ``-logsigmoid(z) (1 - eps) - logsigmoid(-z) eps``.

Rewards (logged as ``rewards/chosen`` and ``rewards/rejected``): ``beta * (pi - ref)`` for DPO, ``beta *
avg`` for SimPO, as each trainer logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PairLoss", "pair_losses"]


@dataclass(frozen=True)
class PairLoss:
    """One preference loss and its hyperparameters (``objective``: ``dpo`` or ``simpo``)."""

    objective: str
    beta: float
    gamma: float = 0.5
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.objective not in ("dpo", "simpo"):
            raise ValueError(f"a pair loss is dpo or simpo, got {self.objective!r}")
        if self.dpo_loss not in ("sigmoid", "ipo"):
            raise ValueError(f"the DPO loss is sigmoid or ipo, got {self.dpo_loss!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be positive, got {self.beta}")

    @property
    def averages(self) -> bool:
        """Whether the loss reads log-probabilities averaged over each completion's tokens (SimPO, IPO)."""
        return self.objective == "simpo" or self.dpo_loss == "ipo"

    @property
    def needs_reference(self) -> bool:
        return self.objective == "dpo"


def pair_losses(
    loss: PairLoss,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(losses, chosen_rewards, rejected_rewards)``, one value per pair, from the policy's (and for DPO the
    reference's) log-probabilities of each pair's completions, summed or averaged as ``loss.averages``
    says (the caller's to do: it knows the token counts)."""
    beta, smoothing = loss.beta, loss.label_smoothing
    if loss.objective == "simpo":
        z = beta * (chosen - rejected) - loss.gamma
        losses = -F.logsigmoid(z) * (1 - smoothing) - F.logsigmoid(-z) * smoothing
        return losses, beta * chosen.detach(), beta * rejected.detach()
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("DPO needs the reference model's log-probabilities")
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss.dpo_loss == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        z = beta * margin
        losses = -F.logsigmoid(z) * (1 - smoothing) - F.logsigmoid(-z) * smoothing
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()
