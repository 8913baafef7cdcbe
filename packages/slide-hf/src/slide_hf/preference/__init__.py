"""Preference training (``--objective dpo|simpo``): the losses over pairs, the head that computes them
through the sliding engine, and the DPO reference pass. docs/preference.md says what each option does."""

from slide_hf.preference.head import PreferenceHead, PreferenceMetrics
from slide_hf.preference.losses import PairLoss, pair_losses
from slide_hf.preference.tags import PAIR_TAG_SHIFT, pair_count, tag_labels

__all__ = [
    "PAIR_TAG_SHIFT",
    "PairLoss",
    "PreferenceHead",
    "PreferenceMetrics",
    "pair_count",
    "pair_losses",
    "tag_labels",
]
