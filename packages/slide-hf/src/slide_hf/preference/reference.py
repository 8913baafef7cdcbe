"""DPO's reference log-probabilities: one forward-only sliding pass before training, kept in the run.

Note [Reference pass once per run]: DPO compares the policy with a frozen reference (the starting weights,
or ``--ref-model``). Its log-probabilities of every completion depend only on the reference's weights and
the prepared pairs, so they are computed once, before the first step, by the engine's own forward-only
path (``Engine.evaluate``, Note [Evaluation between steps]) with the head collecting per-completion sums
(preference/head.py), and saved in the run directory under a name made of the data digest and a
fingerprint of the reference's weight files. A resumed run finds them there and never recomputes them: its
own weights are no longer the reference's. The held-out pairs of an evaluation (``--eval-data``,
``--eval-fraction``) have a pass of their own, right after the training pairs', saved the same way under
their rows' digest (Note [A head per pair set] in preference/run.py). Tested by
``test_resume_is_bit_exact_and_reuses_the_reference_pass`` and ``test_resume_with_evaluation_is_bit_exact``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from slide_core.engine.evaluation import MAX_EVAL_GROUP
from slide_hf.errors import UserError
from slide_hf.preference.head import PreferenceHead
from slide_hf.progress import PassProgress

__all__ = ["REFERENCE_DIR", "compute_reference", "prepare_reference", "reference_path", "weights_fingerprint"]

log = logging.getLogger("slide.train")

REFERENCE_DIR = "reference"
_UPDATES = 50
"""Evaluations a reference pass is split into at most, so its progress moves (each costs one CPU-GPU sync)."""


def weights_fingerprint(source: str | Path, *, extra: str = "") -> str:
    """A digest of where reference weights come from: every file of a model or checkpoint directory by
    relative name, size and modification time (reading the weights themselves would cost as much as the
    pass), or the name itself for a preset (``extra`` then says its seed)."""
    digest = hashlib.sha256(extra.encode())
    path = Path(source)
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            stat = file.stat()
            digest.update(f"{file.relative_to(path)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    else:
        digest.update(str(source).encode())
    return digest.hexdigest()


def reference_path(run: Path, data_digest: str, model_digest: str) -> Path:
    return run / REFERENCE_DIR / f"logps-{data_digest[:16]}-{model_digest[:16]}.pt"


def compute_reference(
    evaluate: Callable[[Sequence[Any]], Any],
    head: PreferenceHead,
    batches: Sequence[Any],
    device: torch.device,
    planned_micro_batch_s: float | None = None,
    *,
    label: str = "reference pass",
) -> torch.Tensor:
    """Run the reference pass over ``batches`` (every row once) through ``evaluate`` (the engine's
    forward-only path) with ``head`` collecting; returns the log-probabilities, one per completion, on the
    host. Progress and the time remaining show as the pass goes (slide_hf/progress.py), under ``label``
    (the held-out pairs' pass has its own); the log line at the end puts the plan's time
    (``planned_micro_batch_s`` per micro-batch, ``Plan.reference_step_s``) beside the pass's."""
    head.start_reference(device)
    total = len(batches)
    # No fewer micro-batches per evaluation than it carries through each unit per load (Note
    # [Evaluation by groups] in slide_core/engine/evaluation.py).
    every = max(MAX_EVAL_GROUP, total // _UPDATES)
    started = time.perf_counter()
    try:
        with PassProgress(label, total) as progress:
            for done in range(0, total, every):
                evaluate(batches[done : done + every])
                progress.update(min(done + every, total))
    finally:
        head.collecting = False
    assert head.reference is not None
    reference = head.reference.detach().cpu()  # note: a CPU-GPU sync point (once per run)
    # Its time and tokens (padding included: the pass computes it), what bench/preference.py holds against
    # the forward's FLOP bound; the pass has no metrics record of its own.
    elapsed_s = time.perf_counter() - started
    tokens = sum(int(batch.input_ids.numel()) for batch in batches)
    planned = "" if planned_micro_batch_s is None else f"; planned {planned_micro_batch_s * total:.3g} s"
    log.info(
        "%s: %d tokens in %d micro-batches in %.3f s (%.0f tok/s)%s",
        label, tokens, total, elapsed_s, tokens / max(elapsed_s, 1e-9), planned,
    )  # fmt: skip
    return reference


def prepare_reference(
    head: PreferenceHead,
    path: Path,
    device: torch.device,
    *,
    compute: Callable[[], torch.Tensor],
    resumed: bool,
) -> bool:
    """Give ``head`` its reference log-probabilities: from ``path`` when a pass of this data and reference
    was saved there, else from ``compute()`` (then saved). Returns whether the pass ran."""
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        head.use_reference(saved, device)
        log.info("reference log-probabilities of %d pairs from %s", head.pairs, path)
        return False
    if resumed:
        raise UserError(
            f"the reference log-probabilities of this run are not in {path.parent}; a resumed run's weights are no "
            "longer the reference's, so they cannot be computed again (start the run anew)"
        )
    reference = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(reference, partial)
    os.replace(partial, path)
    head.use_reference(reference, device)
    log.info("reference log-probabilities of %d pairs saved to %s", head.pairs, path)
    return True
