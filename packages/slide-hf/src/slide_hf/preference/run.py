"""What `slide train --objective dpo|simpo` adds to the recipe: the head's objective, the pairs, the
reference pass, the per-step metrics and the evaluation of held-out pairs. The recipe calls these at fixed
places (slide_hf/recipe.py); everything else about the run (placement, engine, checkpoints, resume) is SFT's.

Note [A head per pair set]: the held-out pairs (``--eval-data``, ``--eval-fraction``) are rows of their own,
their completions numbered from 0 (slide_hf/data/preference.py), and a :class:`PreferenceHead` of their
own computes their loss: its reference log-probabilities, its per-micro-batch sums over its completions and
its metric sums. The evaluation and the held-out pairs' reference pass put that head on the model's head
unit and the training head back after (:meth:`PreferenceObjective.computing`). So the training head's
tensors are exactly those of a run without evaluation (the same sizes, so the same reductions), a step's
metrics never mix with an evaluation's, and the run trains bit for bit as one without evaluation
(``test_evaluation_changes_no_training_bit``). Evaluations run between steps only, never while the head
computes a step's loss.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slide_core.collectives import Collectives
from slide_hf.data import DataOptions, Dataset, eval_batches
from slide_hf.data.preference import load_pair_split, load_pairs
from slide_hf.errors import UserError
from slide_hf.options import TrainConfig
from slide_hf.preference.head import PreferenceHead, metric_means
from slide_hf.preference.losses import PairLoss
from slide_hf.preference.reference import (
    compute_reference,
    prepare_reference,
    record_fingerprint,
    recorded_fingerprint,
    reference_path,
    weights_fingerprint,
)
from slide_hf.spelling import option

__all__ = [
    "PairSet",
    "PreferenceObjective",
    "attach_objective",
    "check_ref_model",
    "eval_metrics",
    "evaluation_scope",
    "load_preference_data",
    "needs_reference_pass",
    "reference_source",
    "run_reference",
    "step_metric_sums",
]

log = logging.getLogger("slide.train")

EVAL_PREFIX = "eval_"
"""TRL's prefix of an evaluation's metrics: ``eval_rewards/chosen`` beside a step's ``rewards/chosen``."""


@dataclass(frozen=True)
class PairSet:
    """Pairs in rows and the head that computes their loss; ``label`` names their reference pass."""

    head: PreferenceHead
    rows: Dataset
    label: str


@dataclass(frozen=True)
class PreferenceObjective:
    """A preference run's pair sets: the training pairs, and the held-out pairs (None without evaluation),
    each with its own head (Note [A head per pair set]); ``unit``: the model's head unit, whose
    ``preference`` is the head it computes with (the training head outside :meth:`computing`)."""

    unit: Any
    train: PairSet
    held_out: PairSet | None

    @property
    def sets(self) -> tuple[PairSet, ...]:
        return (self.train,) if self.held_out is None else (self.train, self.held_out)

    @contextlib.contextmanager
    def computing(self, pairs: PairSet) -> Iterator[None]:
        """The model computes ``pairs``' loss inside the block; the training head is back after it."""
        self.unit.preference = pairs.head
        try:
            yield
        finally:
            self.unit.preference = self.train.head


def load_preference_data(cfg: TrainConfig, tokenizer: Any, options: DataOptions) -> tuple[Dataset, Dataset | None]:
    """The pairs of ``--data`` in rows (slide_hf/data/preference.py), and the held-out pairs (``--eval-data``,
    or ``--eval-fraction`` of ``--data`` split by pair) or None; their truncations said once."""
    eval_set: Dataset | None
    if cfg.eval_fraction > 0:
        fraction, seed = cfg.eval_fraction, cfg.seed
        dataset, eval_set = load_pair_split(cfg.data, tokenizer, options, eval_fraction=fraction, seed=seed)
    else:
        dataset = load_pairs(cfg.data, tokenizer, options)
        eval_set = load_pairs(cfg.eval_data, tokenizer, options, what="eval_data") if cfg.eval_data else None
    for what, rows in (("data", dataset), ("eval data", eval_set)):
        if rows is None:
            continue
        stats = rows.stats
        log.info(
            "%s: %d preference pairs in %d rows of %d tokens (%s)", what, stats.examples, stats.rows, options.seq_len,
            "packed" if options.packing else "one pair a row",
        )  # fmt: skip
        if stats.truncated_examples:
            log.warning(
                "%s: truncated %d pair(s) with a sequence longer than %s / 2 = %d tokens (the end of the completion)",
                rows.source, stats.truncated_examples, option("seq_len"), options.seq_len // 2,
            )  # fmt: skip
    return dataset, eval_set


def attach_objective(
    cfg: TrainConfig, slide_model: Any, dataset: Dataset, eval_set: Dataset | None = None
) -> PreferenceObjective | None:
    """Give the model's head the run's preference loss, with a head of the same loss for ``eval_set``'s
    pairs (Note [A head per pair set]); None for SFT, which leaves the head as it is."""
    if not cfg.preference:
        return None
    loss = PairLoss(cfg.objective.value, cfg.resolved_beta, cfg.gamma, cfg.dpo_loss.value, cfg.label_smoothing)
    train = PairSet(PreferenceHead(loss, dataset.stats.examples), dataset, "reference pass")
    held_out = None
    if eval_set is not None:
        held_out = PairSet(PreferenceHead(loss, eval_set.stats.examples), eval_set, "reference pass of the eval pairs")
    slide_model.head.preference = train.head
    log.info(
        "objective %s: beta %g%s over %d pairs%s", cfg.objective.value, loss.beta,
        f", gamma {loss.gamma:g}" if loss.objective == "simpo" else f", loss {loss.dpo_loss}",
        train.head.pairs, "" if held_out is None else f", evaluated on {held_out.head.pairs} held-out pairs",
    )  # fmt: skip
    return PreferenceObjective(slide_model.head, train, held_out)


_CONFIG_KEYS_A_REFERENCE_MAY_CHANGE = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "architectures",
        "auto_map",
    }
)
"""Keys of a config.json that say nothing of the computation: where it was saved, its storage dtype (the run
computes in its own), the special token ids (a preset run's export sets its tokenizer's), the inference
cache."""


def check_ref_model(ref_model: Path | None, policy_config: Any) -> None:
    """Refuse in one line a ``--ref-model`` whose config.json differs from the model's in anything that
    shapes the computation. The reference's weights run through the model's own architecture (the engine
    holds one), so a different head count, RoPE base or vocabulary would give log-probabilities of a model
    that does not exist, or fail deep in the load naming neither option nor directory. Keys only one side
    writes are the other's defaults and are not compared."""
    if ref_model is None:
        return
    from transformers import AutoConfig

    if not ref_model.is_dir():
        raise UserError(f"{option('ref_model')} {ref_model} is not a model directory")
    try:
        reference = AutoConfig.from_pretrained(ref_model).to_dict()
    except (OSError, ValueError) as error:
        raise UserError(f"{option('ref_model')} {ref_model}: its config.json cannot be read ({error})") from None
    policy = policy_config.to_dict()
    for key in sorted((reference.keys() & policy.keys()) - _CONFIG_KEYS_A_REFERENCE_MAY_CHANGE):
        if reference[key] != policy[key]:
            raise UserError(
                f"{option('ref_model')} {ref_model} is not the model's architecture: its {key} is "
                f"{reference[key]!r}, the model's {policy[key]!r} (the reference runs through the model's layers)"
            )


def reference_source(cfg: TrainConfig, model_dir: Path | None) -> tuple[str | Path, str]:
    """Where the reference weights come from (``--ref-model``, ``--init-from``, the model directory, or a
    preset) and the fingerprint that names their pass. A ``--ref-model`` that is no model directory, or not
    the model's architecture, was refused before (:func:`check_ref_model`)."""
    if cfg.ref_model is not None:
        return cfg.ref_model, weights_fingerprint(cfg.ref_model)
    if cfg.init_from is not None:
        return cfg.init_from, weights_fingerprint(cfg.init_from, extra="init-from")
    if model_dir is not None:
        return model_dir, weights_fingerprint(model_dir)
    return cfg.model, weights_fingerprint(cfg.model, extra=f"preset seed {cfg.seed}")


def _fingerprint(cfg: TrainConfig, cache_dir: Path, model_dir: Path | None, *, resumed: bool) -> str:
    """The fingerprint naming this run's passes: a resume's as its run recorded it, else its source's now
    (Note [A resume reads the reference's fingerprint] in preference/reference.py)."""
    recorded = recorded_fingerprint(cache_dir) if resumed else None
    return recorded if recorded is not None else reference_source(cfg, model_dir)[1]


def needs_reference_pass(
    cfg: TrainConfig,
    objective: PreferenceObjective | None,
    cache_dir: Path,
    model_dir: Path | None,
    group: Collectives,
    *,
    resumed: bool = False,
) -> bool:
    """Whether this run must run DPO's reference pass: DPO, and no saved pass of this reference for the
    training pairs or the held-out ones (a resumed run always has both). Rank 0's answer on every rank:
    the pass is collective (Note [The ranks share the reference pass])."""
    if objective is None or not objective.train.head.loss.needs_reference:
        return False
    fingerprint = _fingerprint(cfg, cache_dir, model_dir, resumed=resumed)
    missing = any(not reference_path(cache_dir, pairs.rows.digest, fingerprint).is_file() for pairs in objective.sets)
    return bool(group.broadcast_object(missing, "rank 0's answer whether the reference pass is saved"))


def run_reference(
    cfg: TrainConfig,
    objective: PreferenceObjective,
    cache_dir: Path,
    model_dir: Path | None,
    device: torch.device,
    *,
    evaluate: Callable[[Any], Any],
    resumed: bool,
    group: Collectives,
    planned_micro_batch_s: float | None = None,
    stopping: Callable[[], bool] | None = None,
    may_compute: bool | None = None,
) -> bool:
    """DPO: the reference log-probabilities of the training pairs, then of the held-out pairs, each from
    this run's saved pass or a new one through ``evaluate`` (an engine holding the reference's weights);
    SimPO needs none. Returns whether a pass ran. With data parallel each rank of ``group`` computes its
    share of the rows and every rank ends with every completion's (Note [The ranks share the reference
    pass] in preference/reference.py). ``planned_micro_batch_s``: the plan's seconds per micro-batch of a
    pass (the same for both: a forward of each pair), logged beside its time. ``stopping``: asked between
    the pass's evaluations (Note [A stop during the reference pass] in preference/reference.py).
    ``resumed``: the passes are named as the run recorded them (Note [A resume reads the reference's
    fingerprint]); ``may_compute``: a pass not saved may be computed (by default only when not resumed: a
    resumed run's weights are no longer the reference's; ``--ref-model``'s always are)."""
    may_compute = not resumed if may_compute is None else may_compute
    fingerprint = _fingerprint(cfg, cache_dir, model_dir, resumed=resumed)
    ran = False
    for pairs in objective.sets:
        if not pairs.head.loss.needs_reference:
            continue
        head = pairs.head
        batches = list(eval_batches(pairs.rows, cfg.batch_size, rank=group.rank, world_size=group.world_size))
        compute = functools.partial(
            compute_reference, evaluate, head, batches, device, planned_micro_batch_s,
            label=pairs.label, group=group, stopping=stopping,
        )  # fmt: skip
        with objective.computing(pairs):
            path = reference_path(cache_dir, pairs.rows.digest, fingerprint)
            ran |= prepare_reference(head, path, device, compute=compute, resumed=not may_compute, group=group)
    if ran and group.rank == 0:
        record_fingerprint(cache_dir, fingerprint)
    return ran


def step_metric_sums(objective: PreferenceObjective | None) -> torch.Tensor | None:
    """This rank's sums of the step's TRL-named metrics (float64 on the host: the pairs, then one sum per
    metric), to add over the ranks in the step's one host collective with its token counts and signals
    (``_Trainer._log_step`` in slide_hf/recipe.py), then means over the global batch's pairs
    (:func:`~slide_hf.preference.head.metric_means`); None for SFT. Note: a CPU-GPU sync point, once per
    step."""
    return None if objective is None else objective.train.head.take_metric_sums()


def evaluation_scope(objective: PreferenceObjective | None) -> contextlib.AbstractContextManager[None]:
    """Where an evaluation runs: with the held-out pairs' head on the model (Note [A head per pair set]);
    nothing to do for SFT."""
    if objective is None or objective.held_out is None:
        return contextlib.nullcontext()
    return objective.computing(objective.held_out)


def eval_metrics(objective: PreferenceObjective | None, group: Collectives) -> dict[str, float]:
    """The evaluation's TRL-named metrics, means over the held-out pairs (every rank's) with the ``eval_``
    prefix (empty for SFT). Note: a CPU-GPU sync point, once per evaluation."""
    if objective is None or objective.held_out is None:
        return {}
    metrics = _global_metrics(objective.held_out.head, group, "the evaluation's")
    return {EVAL_PREFIX + name: value for name, value in metrics.items()}


def _global_metrics(head: PreferenceHead, group: Collectives, whose: str) -> dict[str, float]:
    """``head``'s metrics as means over every rank's pairs: the sums (pairs included) summed over the
    ranks, then divided, so N ranks log what one process logs at the same batch."""
    sums = head.take_metric_sums()
    group.all_reduce_host_(sums, f"the sum of {whose} preference metrics")
    return metric_means(sums)
