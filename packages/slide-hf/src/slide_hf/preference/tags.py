"""Which completion a label belongs to, carried in the label itself.

Note [Tagged preference labels]: the head of a preference run needs, for every token that carries loss,
the completion (pair, chosen or rejected) it belongs to, so it can sum log-probabilities per completion.
Rather than a fourth micro-batch tensor through the engine, a preference label carries that number in its
high bits: ``label = token | (completion + 1) << 32`` with ``completion = 2 * pair + rejected`` (``pair``
the pair's index in the prepared data). Labels are int64 on their way to the device and token ids are
far below 2**32, so nothing is lost; an untrained token keeps ``IGNORE`` (-100). The engine reads labels
only through the model (``SlideModel.loss_token_count`` and ``prepare_inputs``), so the SFT path is not
touched at all: its labels carry no tag and its head never decodes one. The pair index is global, which is
how the head finds a pair's reference log-probabilities without a host lookup (no CPU-GPU sync).
Tested by ``test_tags_round_trip`` and the exactness tests of tests/hf/test_preference_exactness.py.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PAIR_TAG_SHIFT", "decode_tags", "pair_count", "tag_labels"]

PAIR_TAG_SHIFT = 32
_TOKEN_MASK = (1 << PAIR_TAG_SHIFT) - 1


def tag_labels(labels: np.ndarray, completion: int) -> np.ndarray:
    """``labels`` (token ids, ``IGNORE`` for untrained) of completion ``completion`` as int64 tagged labels."""
    out = labels.astype(np.int64)
    trained = out >= 0
    out[trained] |= (completion + 1) << PAIR_TAG_SHIFT
    return out


def decode_tags(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, completions)`` of tagged labels, on their device: ``tokens`` with -100 where untrained,
    ``completions`` with -1 there (and for an untagged trained label)."""
    trained = labels >= 0
    tokens = torch.where(trained, labels & _TOKEN_MASK, torch.full_like(labels, -100))
    completions = torch.where(trained, (labels >> PAIR_TAG_SHIFT) - 1, torch.full_like(labels, -1))
    return tokens, completions


def pair_count(labels: torch.Tensor) -> int:
    """Pairs with a trained token in ``labels`` (a host tensor): a preference run's divisor for the step,
    so its loss is the mean over the step's pairs (Note [Tagged preference labels])."""
    tags = labels[labels >= 0] >> PAIR_TAG_SHIFT
    return int(torch.unique((tags[tags > 0] - 1) >> 1).numel())
