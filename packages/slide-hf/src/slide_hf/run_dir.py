"""An output directory belongs to one run: a lock, what may be reused, stale leftovers, rollback.

Without these rules a second run on the same ``--output`` replaced the first run's model, pruned its own
fresh checkpoint (the older run's higher step numbers sort after it) and left ``--resume`` pointing at
the other run; two concurrent runs deleted each other's temporary directories. So:

- :class:`RunDir` holds an exclusive ``fcntl`` lock on ``<output>/.slide.lock`` for the whole run; the
  kernel drops it when the process dies (even on ``kill -9``), so a dead run never blocks the next one,
  and a live one is named by its pid.
- A non-empty output is refused unless the run resumes a checkpoint of that same directory or
  ``overwrite`` is given; ``overwrite`` removes only the files the directory's record says a run wrote
  there (slide_hf/run_files.py), never a file the user put there, and refuses before removing anything
  when an input of the run lies among them. The current directory and its ancestors are refused outright.
- Temporary directories a killed run left (``.model.tmp-*``, ``checkpoints/.tmp-*``, NVMe scratch) are
  removed only while holding that lock, so a live run's are never touched.
- Resuming from an older checkpoint moves the later ones to ``checkpoints/abandoned-<time>/``:
  :func:`~slide_core.checkpoint.list_checkpoints` ignores that folder, so the next ``--resume`` continues
  the new line instead of the abandoned one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from slide_core.checkpoint import list_checkpoints
from slide_hf.errors import UserError
from slide_hf.run_files import (
    RECORD_FILE,
    RunFiles,
    overwrite_plan,
    read_record,
    remove_for_overwrite,
    restore_kept,
)
from slide_hf.spelling import option

if TYPE_CHECKING:
    from slide_hf.options import TrainConfig

__all__ = [
    "LOCK_FILE",
    "OWNED_ENTRIES",
    "RECORD_FILE",
    "RunDir",
    "check_overwrite_inputs",
    "clean_if_idle",
    "default_output",
    "exporting_into",
    "inputs_of",
    "locked",
    "run_of",
]

log = logging.getLogger("slide.train")

LOCK_FILE = ".slide.lock"
OWNED_ENTRIES = (
    "model",
    "checkpoints",
    "weights",
    "config",
    "tokenizer",
    "metrics.jsonl",
    "train.log",
    "options.json",
    ".data-cache",
)
"""What ``slide train`` writes into its output directory: what a failed run that created the directory
removes again. ``--overwrite`` removes only the recorded files in them (slide_hf/run_files.py)."""

_STALE_PATTERNS = (
    ".model.tmp-*",
    ".model.old-*",
    "checkpoints/.tmp-*",
    "weights/.step-*.tmp-*",  # a weights-only save being written (slide_hf/run_export.py), or the one it replaces
    "weights/.step-*.old-*",
)
_SCRATCH_PREFIX = "slide-nvme-run-"


def default_output(root: Path = Path("runs")) -> Path:
    """``runs/<date>-<time>-<6 hex>``: two runs started in the same second still get different names."""
    return root / f"{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def inputs_of(cfg: TrainConfig) -> list[tuple[str, Path]]:
    """What a run reads, as ``(option name, path)``: ``--overwrite`` must not remove any of it."""
    from slide_hf.options.sources import data_sources

    found = [("model", Path(cfg.model))] + [("data", path) for path in data_sources(cfg)]
    for name in ("eval_data", "tokenizer", "chat_template", "resume", "init_from", "ref_model"):
        value = getattr(cfg, name, None)
        if value is not None:
            found.append((name, Path(value)))
    return found


def check_overwrite_inputs(cfg: TrainConfig, extra: Sequence[tuple[str, Path]]) -> None:
    """Refuse, before the run starts, an ``overwrite`` that would remove an input the options do not hold
    (``extra``: the ``--config`` TOML file), as :class:`RunDir` refuses it for the others when it claims
    the directory."""
    if not cfg.overwrite or cfg.output is None or not extra:
        return
    output = Path(cfg.output).expanduser()
    if not output.is_dir() or (cfg.resume is not None and run_of(cfg.resume).resolve() == output.resolve()):
        return
    overwrite_plan(output, [*inputs_of(cfg), *extra])


def run_of(path: Path) -> Path:
    """The run directory that ``path`` (a run directory or one of its checkpoints, also one set aside
    in ``checkpoints/abandoned-*``, or its ``checkpoints/`` folder) belongs to."""
    if not (path / "state.json").exists():
        folder = path.name == "checkpoints" and not (path / "checkpoints").is_dir() and any(path.glob("step-*"))
        return path.parent if folder else path
    for parent in path.parents[:2]:
        if parent.name == "checkpoints":
            return parent.parent
    return path.parent


class _Lock:
    """An exclusive, non-blocking ``flock`` on ``directory/.slide.lock`` that records the holder's pid."""

    def __init__(self, directory: Path) -> None:
        self.file = directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; False when another process holds it."""
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            return f"pid {int(self.file.read_text().strip())}"
        return "pid unknown"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _lock_or_refuse(directory: Path, what: str) -> _Lock:
    lock = _Lock(directory)
    try:
        acquired = lock.acquire()
    except OSError as error:
        raise UserError(f"cannot lock {what} {directory}: {error.strerror or error}") from None
    if not acquired:
        raise UserError(
            f"{what} {directory} is in use by another slide run ({lock.holder()}); "
            "wait for it to finish or choose another directory"
        )
    return lock


@contextlib.contextmanager
def locked(directory: Path, what: str = "run directory") -> Iterator[None]:
    """Hold ``directory``'s run lock (refused in one line while a run holds it), removing the stale
    temporary directories of killed runs first. `slide export` takes it to write into a run's folder."""
    lock = _lock_or_refuse(directory, what)
    try:
        _remove_stale(directory)
        restore_kept(directory)
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def exporting_into(run: Path, out: Path) -> Iterator[None]:
    """Hold run directory ``run`` (:func:`locked`) while `slide export` writes ``out`` inside it. When
    ``out`` is the run's ``model/``, which the export replaces whole, the user's files in it move aside and
    back (slide_hf/run_files.py), and the new model's files join the run's record of slide's files."""
    with locked(run):
        if out.resolve() != (run / "model").resolve():
            yield
            return
        recorded = read_record(run) is not None
        files = RunFiles.claim(run, resuming=True) if recorded else RunFiles(run, frozenset(), frozenset())
        with files.keeping_users_entries("model"):
            yield
        if recorded:
            files.record()


def clean_if_idle(directory: Path) -> None:
    """Remove a killed run's temporary directories in ``directory`` unless a live run holds its lock (then
    nothing is touched). A folder with nothing stale is not even locked, so no lock file appears in it."""
    if not any(p for pattern in _STALE_PATTERNS for p in directory.glob(pattern)):
        return
    lock = _Lock(directory)
    try:
        if not lock.acquire():
            return
    except OSError:
        return  # a folder we may read but not write: leave it as it is
    try:
        _remove_stale(directory)
    finally:
        lock.release()


def _remove_stale(directory: Path) -> None:
    for pattern in _STALE_PATTERNS:
        for stale in directory.glob(pattern):
            log.debug("removing %s, left by a run that was killed", stale)
            shutil.rmtree(stale, ignore_errors=True)


class RunDir:
    """The output directory of one training run, held for the run's life (a context manager).

    ``resume_from`` is the checkpoint the run continues (``None`` for a new run): resuming a checkpoint of
    this same directory is what allows reusing it. ``overwrite`` allows a non-empty directory by first
    removing the files an earlier run recorded writing there (slide_hf/run_files.py), refused when one of
    ``inputs`` (``(option name, path)``, :func:`inputs_of`) is among them; it is ignored when the run resumes
    from inside the directory, whose checkpoints it would otherwise delete. A run that fails before writing
    its first checkpoint removes the directory again if it created it, so a retry with the same
    ``--output`` is not refused. The run records what it writes through :meth:`record_outputs`.
    """

    def __init__(
        self,
        path: Path,
        *,
        resume_from: Path | None = None,
        overwrite: bool = False,
        inputs: Sequence[tuple[str, Path]] = (),
    ) -> None:
        self.path = Path(path).expanduser()
        self.resume_from = resume_from
        self.overwrite = overwrite
        self.inputs = tuple(inputs)
        self.created = False
        self.files: RunFiles | None = None
        self._lock: _Lock | None = None
        self._scratch: list[tuple[Path, _Lock]] = []

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> RunDir:
        self._refuse_cwd()
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"{option('output', self.path)} is a file, not a directory")
        self.created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(f"cannot create output directory {self.path}: {error.strerror or error}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            self._discard_if_created()
            raise UserError(f"cannot write to output directory {self.path}: permission denied")
        try:
            self._lock = _lock_or_refuse(self.path, "output directory")
        except UserError:
            self._discard_if_created()
            raise
        try:
            _remove_stale(self.path)
            restore_kept(self.path)
            self._claim()
            resuming = self.resume_from is not None and self._resumes_here()
            self.files = RunFiles.claim(self.path, resuming=resuming)
        except BaseException:
            self.close(failed=True)
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close(failed=error is not None)

    def close(self, *, failed: bool = False) -> None:
        """Remove the NVMe scratch folders, drop an unused directory after a failure, release the lock."""
        for scratch, lock in self._scratch:
            shutil.rmtree(scratch, ignore_errors=True)
            lock.release()
        self._scratch.clear()
        if self._lock is None:
            return
        discard = failed and self.created and not self._holds_results()
        if not discard:
            self.record_outputs()
        if discard:
            for name in (*OWNED_ENTRIES, RECORD_FILE, LOCK_FILE):
                _remove(self.path / name)
            _remove_stale(self.path)
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only if nothing else appeared in it meanwhile
        self._lock.release()
        self._lock = None

    def _refuse_cwd(self) -> None:
        if str(self.path).strip() in ("", "."):
            raise UserError(f"{option('output')} must name a directory for the run, not the current directory")
        here = Path.cwd().resolve()
        target = self.path.resolve()
        if target == here or target in here.parents:
            raise UserError(
                f"{option('output', self.path)} is the current directory or contains it; a run needs its own directory "
                "(e.g. runs/my-run)"
            )

    def _claim(self) -> None:
        """Apply the reuse policy to what the directory already holds."""
        present = sorted(p.name for p in self.path.iterdir() if p.name not in (LOCK_FILE, RECORD_FILE))
        if not present:
            return
        if self.resume_from is not None and self._resumes_here():
            if self.overwrite:
                log.info("--overwrite is ignored: the run resumes from %s inside %s", self.resume_from, self.path)
            return
        if self.overwrite:
            # Every check before the first removal: a refused run leaves the directory as it was.
            remove_for_overwrite(self.path, overwrite_plan(self.path, self.inputs))
            return
        shown = ", ".join(present[:4]) + (f" and {len(present) - 4} more" if len(present) > 4 else "")
        raise UserError(
            f"output directory {self.path} is not empty ({shown}); continue its run with {option('resume', self.path)}, "
            f"replace slide's files in it with {option('overwrite')}, or choose another {option('output')}"
        )

    def _resumes_here(self) -> bool:
        assert self.resume_from is not None
        return run_of(self.resume_from).resolve() == self.path.resolve()

    def _holds_results(self) -> bool:
        """A checkpoint, a model or metrics records: anything a failed run leaves that is worth keeping."""
        metrics = self.path / "metrics.jsonl"
        has_metrics = metrics.is_file() and metrics.stat().st_size > 0
        return bool(list_checkpoints(self.checkpoints)) or (self.path / "model").exists() or has_metrics

    def _discard_if_created(self) -> None:
        if self.created:
            with contextlib.suppress(OSError):
                (self.path / LOCK_FILE).unlink(missing_ok=True)
                self.path.rmdir()

    # -- during the run --------------------------------------------------------------------------------
    def record_outputs(self) -> None:
        """Add what the run wrote since the last call to the directory's record of its files (what a later
        ``--overwrite`` removes). Called after each phase that writes files; a no-op in a process that
        does not hold the directory (another rank). A record that cannot be written (a full disk) is a
        warning, not the run's end: a file missing from it is one that ``--overwrite`` keeps."""
        if self.files is not None and self._lock is not None:
            try:
                self.files.record()
            except UserError as error:
                log.warning("%s", error)

    def keeping_user_files(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A context in which slide may replace folder ``name`` whole (the model export): the user's files
        in it move aside and come back into the new folder (slide_hf/run_files.py)."""
        if self.files is None or self._lock is None:
            return contextlib.nullcontext()
        return self.files.keeping_users_entries(name)

    def scratch(self, nvme_dir: Path) -> Path:
        """A private folder under ``nvme_dir`` for this run's NVMe tiers, locked like the output directory
        and removed when the run ends. Folders that killed runs left there are removed first (their locks
        are free); those of live runs are locked and left alone.

        A folder without its lock file is one another process (another run, or another rank of this one)
        has just created and not yet locked: it is left alone, so no process removes a folder between its
        creation and its lock. (One left by a process killed in that instant is empty, and stays.)"""
        if nvme_dir.exists() and not nvme_dir.is_dir():
            raise UserError(f"{option('nvme_dir', nvme_dir)} is a file, not a directory")
        try:
            nvme_dir.mkdir(parents=True, exist_ok=True)
            for old in nvme_dir.glob(f"{_SCRATCH_PREFIX}*"):
                lock = _Lock(old)
                if old.is_dir() and lock.file.exists() and lock.acquire():
                    log.debug("removing %s, left by a run that was killed", old)
                    shutil.rmtree(old, ignore_errors=True)
                    lock.release()
            folder = nvme_dir / f"{_SCRATCH_PREFIX}{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
            folder.mkdir()
            lock = _Lock(folder)
            lock.acquire()
        except OSError as error:
            raise UserError(f"cannot use {option('nvme_dir', nvme_dir)}: {error.strerror or error}") from None
        self._scratch.append((folder, lock))
        return folder

    def roll_back(self, resumed: Path) -> Path | None:
        """Set aside the checkpoints of this run that are newer than ``resumed`` (and the model exported
        from them) in ``checkpoints/abandoned-<time>/``; return that folder, or ``None`` when ``resumed``
        is the newest checkpoint here or lies elsewhere."""
        if resumed.parent.resolve() != self.checkpoints.resolve():
            return None
        # Every later step folder, also a damaged one without its state.json: a save of the new line must
        # not replace it, and the next --resume must not stop at it.
        later = sorted(
            p for p in self.checkpoints.glob("step-*") if p.is_dir() and not p.is_symlink() and p.name > resumed.name
        )
        if not later:
            return None
        aside = self.checkpoints / f"abandoned-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
        try:
            aside.mkdir()
            for checkpoint in later:
                os.rename(checkpoint, aside / checkpoint.name)
            if (self.path / "model").exists():
                os.rename(self.path / "model", aside / "model")
        except OSError as error:
            raise UserError(f"cannot set aside the checkpoints after {resumed.name}: {error.strerror}") from None
        log.warning(
            "resuming from %s: the later checkpoints (%s) belong to an abandoned line and moved to %s",
            resumed.name,
            ", ".join(p.name for p in later),
            aside,
        )
        return aside


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
