"""What `slide train --objective dpo|simpo` adds to the recipe: the head's objective, the pairs, the
reference pass and the per-step metrics. The recipe calls these at fixed places (slide_hf/recipe.py);
everything else about the run (placement, engine, checkpoints, resume) is SFT's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slide_hf.data import DataOptions, eval_batches
from slide_hf.data.preference import load_pairs
from slide_hf.errors import UserError
from slide_hf.options import TrainConfig
from slide_hf.preference.head import PreferenceHead
from slide_hf.preference.losses import PairLoss
from slide_hf.preference.reference import compute_reference, prepare_reference, reference_path, weights_fingerprint
from slide_hf.spelling import option

__all__ = [
    "attach_objective",
    "load_preference_data",
    "needs_reference_pass",
    "preference_metrics",
    "reference_source",
    "run_reference",
]

log = logging.getLogger("slide.train")


def load_preference_data(cfg: TrainConfig, tokenizer: Any, options: DataOptions) -> Any:
    """The pairs of ``--data`` in rows (slide_hf/data/preference.py), their truncations said once."""
    dataset = load_pairs(cfg.data, tokenizer, options)
    stats = dataset.stats
    log.info(
        "data: %d preference pairs in %d rows of %d tokens (%s)", stats.examples, stats.rows, options.seq_len,
        "packed" if options.packing else "one pair a row",
    )  # fmt: skip
    if stats.truncated_examples:
        log.warning(
            "%s: truncated %d pair(s) with a sequence longer than %s / 2 = %d tokens (the end of the completion)",
            dataset.source, stats.truncated_examples, option("seq_len"), options.seq_len // 2,
        )  # fmt: skip
    return dataset


def attach_objective(cfg: TrainConfig, slide_model: Any, dataset: Any) -> PreferenceHead | None:
    """Give the model's head the run's preference loss (None for SFT, which leaves the head as it is)."""
    if not cfg.preference:
        return None
    loss = PairLoss(cfg.objective.value, cfg.resolved_beta, cfg.gamma, cfg.dpo_loss.value, cfg.label_smoothing)
    head = PreferenceHead(loss, dataset.stats.examples)
    slide_model.head.preference = head
    log.info(
        "objective %s: beta %g%s over %d pairs", cfg.objective.value, loss.beta,
        f", gamma {loss.gamma:g}" if loss.objective == "simpo" else f", loss {loss.dpo_loss}",
        head.pairs,
    )  # fmt: skip
    return head


def reference_source(cfg: TrainConfig, model_dir: Path | None) -> tuple[str | Path, str]:
    """Where the reference weights come from (``--ref-model``, ``--init-from``, the model directory, or a
    preset) and the fingerprint that names their pass."""
    if cfg.ref_model is not None:
        if not cfg.ref_model.is_dir():
            raise UserError(f"{option('ref_model')} {cfg.ref_model} is not a model directory")
        return cfg.ref_model, weights_fingerprint(cfg.ref_model)
    if cfg.init_from is not None:
        return cfg.init_from, weights_fingerprint(cfg.init_from, extra="init-from")
    if model_dir is not None:
        return model_dir, weights_fingerprint(model_dir)
    return cfg.model, weights_fingerprint(cfg.model, extra=f"preset seed {cfg.seed}")


def _reference_file(cfg: TrainConfig, dataset: Any, cache_dir: Path, model_dir: Path | None) -> Path:
    _, fingerprint = reference_source(cfg, model_dir)
    return reference_path(cache_dir, dataset.digest, fingerprint)


def needs_reference_pass(
    cfg: TrainConfig, head: PreferenceHead | None, dataset: Any, cache_dir: Path, model_dir: Path | None
) -> bool:
    """Whether this run must run DPO's reference pass: DPO, and no saved pass of this data and reference
    (a resumed run always has one)."""
    if head is None or not head.loss.needs_reference:
        return False
    return not _reference_file(cfg, dataset, cache_dir, model_dir).is_file()


def run_reference(
    cfg: TrainConfig,
    head: PreferenceHead,
    dataset: Any,
    cache_dir: Path,
    model_dir: Path | None,
    device: torch.device,
    *,
    evaluate: Callable[[Any], Any],
    resumed: bool,
    planned_micro_batch_s: float | None = None,
) -> bool:
    """DPO: the reference log-probabilities, from this run's saved pass or a new one through ``evaluate``
    (an engine holding the reference's weights); SimPO needs none. Returns whether a pass ran.
    ``planned_micro_batch_s``: the plan's seconds per micro-batch of the pass, logged beside its time."""
    if not head.loss.needs_reference:
        return False
    path = _reference_file(cfg, dataset, cache_dir, model_dir)
    batches = list(eval_batches(dataset, cfg.batch_size))
    return prepare_reference(
        head,
        path,
        device,
        compute=lambda: compute_reference(evaluate, head, batches, device, planned_micro_batch_s),
        resumed=resumed,
    )


def preference_metrics(head: PreferenceHead | None) -> dict[str, float]:
    """The step's TRL-named metrics (empty for SFT). Note: a CPU-GPU sync point, once per step."""
    return {} if head is None else head.take_metrics()
