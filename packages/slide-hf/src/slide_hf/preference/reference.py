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

Note [The ranks share the reference pass]: with data parallel each rank computes its share of the rows,
the micro-batches ``r, r + N, ...`` of one process's order, as many as every other rank's (``eval_batches``
with its rank: every load of the pass is an all-gather, Note [Every rank evaluates as many micro-batches]
in slide_hf/data/batches.py). A completion is in one micro-batch, so in one rank's share, and the others'
log-probabilities of it stay zero; the ranks' tensors are summed, so every rank holds every completion's,
each exactly the value one process computes from the same micro-batch (``x + 0`` rounds to ``x``), and
trains on whatever rows it is given. Rank 0 alone saves the file, under the same name as one process's;
whether a pass is saved is rank 0's answer on every rank, so all run it or none, and a resume on any
number of ranks reads it on every rank. Tested by ``test_two_ranks_train_as_one_process`` and
``test_a_resume_of_two_ranks_reads_the_reference_pass`` (tests/hf/test_preference_data_parallel.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from slide_core.collectives import Collectives
from slide_core.engine.evaluation import MAX_EVAL_GROUP
from slide_hf.errors import UserError
from slide_hf.preference.head import PreferenceHead
from slide_hf.progress import PassProgress
from slide_hf.spelling import option

__all__ = [
    "REFERENCE_DIR",
    "PassStopped",
    "compute_reference",
    "prepare_reference",
    "record_fingerprint",
    "recorded_fingerprint",
    "reference_path",
    "weights_fingerprint",
]

log = logging.getLogger("slide.train")

REFERENCE_DIR = "reference"
_UPDATES = 50
"""Evaluations a reference pass is split into at least, so its progress moves (each costs one CPU-GPU sync)."""
_MOST_PER_EVALUATION = 8 * MAX_EVAL_GROUP
"""Micro-batches an evaluation of the pass carries at most, so a stop request is seen within seconds
(Note [A stop during the reference pass]): an 8B's micro-batch of 16 x 1,024 tokens is about 0.1 s of an H100."""


class PassStopped(Exception):
    """A SIGINT or SIGTERM came during a reference pass: it stopped after ``done`` of its ``total``
    micro-batches, nothing saved (Note [A stop during the reference pass])."""

    def __init__(self, label: str, done: int, total: int) -> None:
        super().__init__(f"{label} stopped after {done} of {total} micro-batches")
        self.label, self.done, self.total = label, done, total


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


_SOURCE_FILE = "source.json"
"""In the run's reference folder: the fingerprint its passes are named by (Note [A resume reads the
reference's fingerprint])."""

# Note [A resume reads the reference's fingerprint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The passes' file names hold a fingerprint of the reference's source, taken when the run starts. A resume
# reads it back instead of taking it again: the source it would fingerprint may be gone from the options
# (``--init-from`` is not restored on resume), or its files touched (a README edited, a config.json's time
# changed, the run's own files when it lies inside the model directory), and each of those named a pass that
# was never made, so the resume was refused although the pass was there. Runs saved before the record
# existed fingerprint the source again, as they did. Tested by
# ``test_a_dpo_run_from_init_from_resumes_with_its_reference_pass`` and
# ``test_a_touched_model_directory_does_not_lose_the_reference_pass``.


def record_fingerprint(run: Path, fingerprint: str) -> None:
    """Keep the fingerprint this run's passes are named by (rank 0, once its first pass is saved)."""
    folder = run / REFERENCE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (_SOURCE_FILE + ".partial")
    partial.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
    os.replace(partial, folder / _SOURCE_FILE)


def recorded_fingerprint(run: Path) -> str | None:
    """The fingerprint :func:`record_fingerprint` kept in ``run``, or None (a run saved before it was kept,
    or an unreadable record: the source is fingerprinted again then)."""
    try:
        value = json.loads((run / REFERENCE_DIR / _SOURCE_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) and value else None


def compute_reference(
    evaluate: Callable[[Sequence[Any]], Any],
    head: PreferenceHead,
    batches: Sequence[Any],
    device: torch.device,
    planned_micro_batch_s: float | None = None,
    *,
    label: str = "reference pass",
    group: Collectives | None = None,
    stopping: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Run the reference pass over ``batches`` (every row once) through ``evaluate`` (the engine's
    forward-only path) with ``head`` collecting; returns the log-probabilities, one per completion, on the
    host. Progress and the time remaining show as the pass goes (slide_hf/progress.py), under ``label``
    (the held-out pairs' pass has its own); the log line at the end puts the plan's time
    (``planned_micro_batch_s`` per micro-batch, ``Plan.reference_step_s``) beside the pass's.
    With data parallel (``group``), ``batches`` is this rank's share of the rows and every rank returns
    every completion's (Note [The ranks share the reference pass]). ``stopping``, asked after each
    evaluation (with data parallel, by every rank together), raises :class:`PassStopped` when it says so.

    Note [A stop during the reference pass]: the pass runs before the first step and may take hours on a
    large pair file, so a SIGINT or SIGTERM (a scheduler's notice, a user's Ctrl-C) stops it within one
    evaluation of at most ``_MOST_PER_EVALUATION`` micro-batches, where it used to be seen only after the
    whole pass and a first step. Nothing of it is saved (a partial pass is not the reference of any step),
    and the run has no checkpoint yet, so the message says to start the run again. Tested by
    tests/hf/test_preference_signals.py."""
    head.start_reference(device)
    total = len(batches)
    # No fewer micro-batches per evaluation than it carries through each unit per load (Note
    # [Evaluation by groups] in slide_core/engine/evaluation.py), no more than a stop may wait for.
    every = max(MAX_EVAL_GROUP, min(total // _UPDATES, _MOST_PER_EVALUATION))
    started = time.perf_counter()
    first_done_at: float | None = None  # when the first evaluation, which warms the kernels up, ended
    ranks = 1 if group is None else group.world_size
    try:  # rank 0 alone shows a live bar (the others log no progress either)
        with PassProgress(label, total, live=None if group is None or group.rank == 0 else False) as progress:
            for done in range(0, total, every):
                evaluate(batches[done : done + every])
                if done == 0:
                    first_done_at = time.perf_counter()
                progress.update(min(done + every, total))
                if stopping is not None and stopping():
                    raise PassStopped(label, min(done + every, total), total)
    finally:
        head.collecting = False
    assert head.reference is not None
    reference = head.reference.detach().cpu()  # note: a CPU-GPU sync point (once per run)
    if group is not None:
        group.all_reduce_host_(reference, f"the sum of the {label}'s log-probabilities")
    # Its time and tokens (padding included: the pass computes it), what bench/preference.py holds against
    # the forward's FLOP bound; the pass has no metrics record of its own. With data parallel, this rank's.
    elapsed_s = time.perf_counter() - started
    tokens = sum(int(batch.input_ids.numel()) for batch in batches)
    planned = "" if planned_micro_batch_s is None else f"; planned {planned_micro_batch_s * total:.3g} s"
    share = "" if ranks == 1 else f" (each of {ranks} ranks its share)"
    log.info(
        "%s: %d tokens in %d micro-batches in %.3f s (%.0f tok/s)%s%s%s",
        label, tokens, total, elapsed_s, tokens / max(elapsed_s, 1e-9), planned, share,
        _after_first(batches[every:], time.perf_counter() - first_done_at if first_done_at else 0.0),
    )  # fmt: skip
    return reference


def _after_first(rest: Sequence[Any], elapsed_s: float) -> str:
    """The pass's rate after its first evaluation, for the log line: the first compiles and warms the
    forward's kernels (about 2 s of an 8B's first micro-batches on an H100), which a pass over a few hundred
    pairs cannot amortize, as a training run's first step does not; its steady rate is what a pass over a
    real pair file runs at (bench/preference.py holds that one against the FLOP bound). Empty with one
    evaluation."""
    if not rest or elapsed_s <= 0.0:
        return ""
    tokens = sum(int(batch.input_ids.numel()) for batch in rest)
    return f"; after the first evaluation: {tokens} tokens in {elapsed_s:.3f} s ({tokens / elapsed_s:.0f} tok/s)"


def _use_saved(head: PreferenceHead, path: Path, device: torch.device) -> None:
    """Give ``head`` the pass saved at ``path``; a file that is damaged or not this run's pairs' pass (a
    truncated write, another run's file) is one line naming it, not a loader's traceback."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        head.use_reference(saved, device)
    except (OSError, EOFError, RuntimeError, ValueError, TypeError, AttributeError, pickle.UnpicklingError) as error:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"{path} is not a reference pass of this run's pairs ({cause}); it cannot be computed again for a "
            f"resumed run: start the run anew (with {option('overwrite')})"
        ) from None


def prepare_reference(
    head: PreferenceHead,
    path: Path,
    device: torch.device,
    *,
    compute: Callable[[], torch.Tensor],
    resumed: bool,
    group: Collectives | None = None,
) -> bool:
    """Give ``head`` its reference log-probabilities: from ``path`` when a pass of this data and reference
    was saved there, else from ``compute()`` (then saved). Returns whether the pass ran. With data parallel
    (``group``) every rank takes rank 0's answer to whether the file is there, so all run the pass or none
    (it is collective); rank 0 alone writes the file, every rank reads it (a resume: the run directory is
    on a file system every rank sees, as its checkpoints are)."""
    saved_pass = path.is_file()
    # Rank 0 answers after writing any earlier pass's file (--ref-model's): the others read it after that.
    if group is not None:
        saved_pass = group.broadcast_object(saved_pass, f"rank 0's answer whether {path.name} is saved")
    if saved_pass:
        _use_saved(head, path, device)
        log.info("reference log-probabilities of %d pairs from %s", head.pairs, path)
        return False
    if resumed:
        raise UserError(
            f"the reference log-probabilities of these pairs are not in {path.parent}; a resumed run's weights are "
            "no longer the reference's, so they cannot be computed again: resume with the pairs the run started "
            "with, or start the run anew"
        )
    reference = compute()
    if group is None or group.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(reference, partial)
        os.replace(partial, path)
    head.use_reference(reference, device)
    log.info("reference log-probabilities of %d pairs saved to %s", head.pairs, path)
    return True
