"""Which files of a run directory `slide train` wrote: the record that ``--overwrite`` trusts.

``--overwrite`` once removed whole folders by name (``model/``, ``checkpoints/``, ...), so it deleted the
model a run was told to train from (``--model RUN/model``), a data file the user kept in ``checkpoints/``
and the user's own notes beside the model. Now a run keeps ``<output>/.slide-files.json``: the paths
(relative to the output directory) of every file it wrote there, rewritten atomically (a temporary file,
fsync, rename) after each phase that writes files -- the tokenizer and config, every checkpoint, the
model, and the end of the run. ``--overwrite`` removes exactly those files, then the folders that removal
left empty; anything else stays where it is.

Note [Whose file]: a file under the paths slide writes (:func:`_written_files`) is slide's when it is
recorded, unless it was already there, unrecorded, when the run claimed the directory: such a file is the
user's, known by its device and inode, so it stays the user's when slide moves it (a rollback, the model
export) and when the user edits it in place, and becomes slide's only when slide replaces it (slide writes
its files through a temporary file and a rename, which gives a new inode). Slide's append-only files
(``train.log``, ``metrics.jsonl``), the one kind it writes in place, are also known by their mtime: one
that was there becomes slide's once the run appends to it. A resumed run takes its own checkpoint
directories (``checkpoints/step-*``, ``checkpoints/abandoned-*``, ``weights/step-*``) as written by slide
even when they are unrecorded (a run killed between a save and its record, or one of a slide that kept no record).

A directory that holds a run of a slide from before the record, or whose record is damaged, is refused by
``--overwrite`` (:func:`overwrite_plan`): nothing says which of its files are slide's, so nothing is
removed and the user is told to remove them or to choose another ``--output``. Before removing anything,
``--overwrite`` refuses a run whose input (model, data, tokenizer, chat template, TOML file, checkpoint)
lies in what it would remove.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "EXPORT_STAMP",
    "RECORD_FILE",
    "RunFiles",
    "exported_step",
    "overwrite_plan",
    "read_record",
    "remove_for_overwrite",
    "restore_kept",
    "stamp_export",
]

log = logging.getLogger("slide.train")

RECORD_FILE = ".slide-files.json"
_FORMAT = 1
_TOP_FILES = ("options.json", "metrics.jsonl", "train.log")
_WHOLE_DIRS = ("model", "config", "tokenizer", ".data-cache")
_STEP_DIRS = {"checkpoints": ("step-", "abandoned-"), "weights": ("step-",)}
"""Folders whose step folders slide writes whole; a file directly in one of them is never slide's."""
EXPORT_STAMP = "slide-export.json"
"""In a run's ``model/``: the step it was exported from (:func:`stamp_export`)."""
_APPENDED = ("metrics.jsonl", "train.log")
"""Slide's files that a run appends to in place rather than replaces (Note [Whose file])."""
_MODEL_FILES = ("config.json", "generation_config.json", EXPORT_STAMP)
_MODEL_SUFFIXES = (".safetensors", ".safetensors.index.json")

Identity = tuple[int, ...]
"""A file's device and inode, and for an appended file its mtime in nanoseconds (Note [Whose file])."""


def _identity(path: Path, relative: str) -> Identity | None:
    try:
        stat = path.lstat()
    except OSError:
        return None
    if relative in _APPENDED:
        return (stat.st_dev, stat.st_ino, stat.st_mtime_ns)
    return (stat.st_dev, stat.st_ino)


def _walk(directory: Path) -> Iterator[Path]:
    """Every file (and symlink) under ``directory``; symlinks to folders are not followed."""
    if directory.is_symlink() or not directory.is_dir():
        if directory.is_symlink() or directory.is_file():
            yield directory
        return
    for top, _dirs, files in os.walk(directory):
        for name in files:
            yield Path(top) / name
        for name in _dirs:  # os.walk lists a symlink to a folder as a folder and does not enter it
            if (Path(top) / name).is_symlink():
                yield Path(top) / name


def _is_checkpoint_file(relative: str) -> bool:
    """A file in a step folder of ``checkpoints/`` or ``weights/`` (or in a line set aside)."""
    parts = relative.split("/")
    return len(parts) > 2 and parts[0] in _STEP_DIRS and parts[1].startswith(_STEP_DIRS[parts[0]])


def _written_files(root: Path) -> Iterator[Path]:
    """The files under the paths `slide train` writes in ``root``: its logs and options, ``model/``,
    ``config/``, ``tokenizer/``, ``.data-cache/``, ``checkpoints/best.json`` and the step folders of
    ``checkpoints/`` and ``weights/`` (a file the user keeps in ``checkpoints/`` itself is never slide's)."""
    for name in _TOP_FILES:
        if (root / name).is_file() or (root / name).is_symlink():
            yield root / name
    for name in _WHOLE_DIRS:
        yield from _walk(root / name)
    if (root / "checkpoints" / "best.json").is_file():
        yield root / "checkpoints" / "best.json"
    for name, prefixes in _STEP_DIRS.items():
        folder = root / name
        if folder.is_dir() and not folder.is_symlink():
            for child in sorted(folder.iterdir()):
                if child.name.startswith(prefixes) and child.is_dir() and not child.is_symlink():
                    yield from _walk(child)


def read_record(root: Path) -> frozenset[str] | None:
    """The files ``root``'s record lists (relative POSIX paths), ``None`` when it has none; a damaged
    record is a :class:`UserError` (the caller must not guess which files are slide's)."""
    file = root / RECORD_FILE
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise UserError(f"cannot read {file}: {error.strerror or error}") from None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        record = None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and _is_inside(f) for f in files):
        raise UserError(
            f"{file}, slide's record of the files it wrote in {root}, is damaged; remove the old run's files "
            f"yourself, or choose another {option('output')}"
        )
    return frozenset(files)


def _is_inside(relative: str) -> bool:
    """A path that stays inside the run directory: relative, no ``..``, not empty."""
    parts = relative.split("/")
    return bool(relative) and not relative.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _write_record(root: Path, files: frozenset[str]) -> None:
    """Replace ``root``'s record with ``files`` at once: a reader sees the old list or the new one."""
    temp = root / f"{RECORD_FILE}.tmp-{uuid.uuid4().hex[:12]}"
    body = json.dumps({"format": _FORMAT, "files": sorted(files)}, indent=0) + "\n"
    try:
        with temp.open("w", encoding="utf-8") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, root / RECORD_FILE)
    except OSError as error:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise UserError(f"cannot write {root / RECORD_FILE}: {error.strerror or error}") from None


def stamp_export(model: Path, step: int) -> None:
    """Write ``model/slide-export.json``, ``{"step": N}``, once the run's export of step ``step`` is
    complete: without it nothing says which checkpoint ``model/`` came from, and a run extended with
    ``--resume --steps`` whose export failed would keep (and push) the old model as the new one. Written
    atomically; a write error is an ``OSError`` for the caller to report."""
    temp = model / f".{EXPORT_STAMP}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with temp.open("w", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, model / EXPORT_STAMP)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def exported_step(model: Path) -> int | None:
    """The step ``model`` was exported from (:func:`stamp_export`), ``None`` when it does not say (no
    stamp, a damaged one, or an export of a slide that wrote none)."""
    try:
        stamp = json.loads((model / EXPORT_STAMP).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    step = stamp.get("step") if isinstance(stamp, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class RunFiles:
    """The record of one run directory while a run holds it (its lock): what it wrote, and whose the other
    files are (Note [Whose file]). Created by :meth:`claim`; :meth:`record` adds what the run wrote since."""

    def __init__(self, root: Path, files: frozenset[str], users: frozenset[Identity]) -> None:
        self.root = root
        self.files = files
        self.users = users

    @classmethod
    def claim(cls, root: Path, *, resuming: bool) -> RunFiles:
        """Read ``root``'s record (none: an empty one) and note the files there that are not in it as the
        user's; a ``resuming`` run takes its unrecorded checkpoint directories as its own. Writes the
        record, so the directory is known to keep one from now on."""
        files = read_record(root) or frozenset()
        users = set()
        for path in _written_files(root):
            relative = path.relative_to(root).as_posix()
            if relative in files or (resuming and _is_checkpoint_file(relative)):
                continue
            found = _identity(path, relative)
            if found is not None:
                users.add(found)
        claimed = cls(root, files, frozenset(users))
        claimed.record(force=True)
        return claimed

    def record(self, *, force: bool = False) -> None:
        """Add every file slide wrote under its paths since the last record, drop the recorded files whose
        folder is gone (a pruned checkpoint), and rewrite the record when it changed. A file missing from a
        folder that is still there stays listed: the record does not follow damage, and a resume refused
        for a missing file leaves the record as it was."""
        found = {relative for relative in self.files if (self.root / relative).parent.is_dir()}
        for path in _written_files(self.root):
            relative = path.relative_to(self.root).as_posix()
            identity = _identity(path, relative)
            if relative in self.files or (identity is not None and identity not in self.users):
                found.add(relative)
        files = frozenset(found)
        if files != self.files or force:
            _write_record(self.root, files)
            self.files = files

    def users_entries(self, name: str) -> list[Path]:
        """The entries directly in folder ``name`` that are the user's: not recorded, and not named as a
        model's own files are (a model folder written before the record keeps its weights, config and
        tokenizer files under those names, and the export replaces them)."""
        folder = self.root / name
        if not folder.is_dir() or folder.is_symlink():
            return []
        tokenizer = self.root / "tokenizer"
        kept = []
        for entry in sorted(folder.iterdir()):
            relative = entry.relative_to(self.root).as_posix()
            if entry.is_dir() and not entry.is_symlink():
                if not any(p.relative_to(self.root).as_posix() in self.files for p in _walk(entry)):
                    kept.append(entry)
                continue
            if relative in self.files:
                continue
            model_file = entry.name in _MODEL_FILES or entry.name.endswith(_MODEL_SUFFIXES)
            if not model_file and not (tokenizer / entry.name).is_file():
                kept.append(entry)
        return kept

    @contextlib.contextmanager
    def keeping_users_entries(self, name: str) -> Iterator[None]:
        """The user's entries in folder ``name`` (:meth:`users_entries`) survive slide replacing that folder
        whole (the model export swaps a new folder in and deletes the old): they wait in
        ``.<name>.keep-<hex>/`` beside it and move into the new folder afterwards, or back into the old one
        when the export fails. A run killed meanwhile leaves them there; the next run on the directory
        moves them back (:func:`restore_kept`)."""
        entries = self.users_entries(name)
        if not entries:
            yield
            return
        hold = self.root / f".{name}.keep-{uuid.uuid4().hex[:12]}"
        hold.mkdir()
        for entry in entries:
            os.rename(entry, hold / entry.name)
        try:
            yield
        finally:
            restore_kept(self.root, hold)


def restore_kept(root: Path, hold: Path | None = None) -> None:
    """Move the entries waiting in ``hold`` (by default every ``.<name>.keep-*`` folder in ``root``) back
    into their folder; one whose name the folder now holds stays waiting, which a warning says."""
    holds = [hold] if hold is not None else sorted(root.glob(".*.keep-*"))
    for folder in holds:
        if not folder.is_dir():
            continue
        name = folder.name[1:].rsplit(".keep-", 1)[0]
        target = root / name
        target.mkdir(exist_ok=True)
        clashes = []
        for entry in sorted(folder.iterdir()):
            if os.path.lexists(target / entry.name):
                clashes.append(entry.name)
            else:
                os.rename(entry, target / entry.name)
        if clashes:
            log.warning("%s kept in %s: %s/ now holds files of the same name", ", ".join(clashes), folder, name)
        else:
            folder.rmdir()


def _legacy_run(root: Path) -> bool:
    """Whether ``root`` holds a `slide train` run that kept no record (its options, logs or checkpoints)."""
    checkpoints = root / "checkpoints"
    has_checkpoints = checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir())
    return has_checkpoints or any((root / name).exists() for name in _TOP_FILES)


def overwrite_plan(root: Path, inputs: Sequence[tuple[str, Path]]) -> list[Path]:
    """The files ``--overwrite`` removes from ``root``: those its record lists. Refused in one line, before
    anything is removed, when ``root`` holds a run without a record, when an input of the run
    (``(option name, path)`` in ``inputs``) is or holds one of those files, or when a checkpoint would
    stay behind (a later ``--resume`` would follow it instead of the new run)."""
    recorded = read_record(root)
    if recorded is None:
        if _legacy_run(root):
            raise UserError(
                f"{option('overwrite')}: {root} holds a run of a slide that kept no record of the files it "
                f"wrote ({RECORD_FILE}), so none is removed; remove that run's files yourself, or choose another "
                f"{option('output')}"
            )
        return []
    real_root = root.resolve()
    victims = []
    for relative in sorted(recorded):
        path = root / relative
        if not os.path.lexists(path) or (path.is_dir() and not path.is_symlink()):
            continue
        if not path.parent.resolve().is_relative_to(real_root):  # a folder of the record became a symlink
            continue
        victims.append(path)
    _refuse_inputs_inside(root, victims, inputs)
    _refuse_checkpoints_left(root, {path.relative_to(root).as_posix() for path in victims})
    return victims


def _refuse_inputs_inside(root: Path, victims: list[Path], inputs: Sequence[tuple[str, Path]]) -> None:
    """An input that is one of ``victims`` or a folder holding one, compared where the files really are
    (symlinks resolved), so neither ``RUN/model`` nor a link to it is removed under the run."""
    places = [(path.parent.resolve() / path.name, path) for path in victims]
    for name, given in inputs:
        where = {Path(os.path.abspath(given.expanduser())), given.expanduser().resolve()}
        for place, path in places:
            if any(place == spot or place.is_relative_to(spot) for spot in where):
                raise UserError(
                    f"{option(name, given)} is in {root}, whose files from an earlier run {option('overwrite')} "
                    f"would remove ({path.relative_to(root).as_posix()}); copy it elsewhere first, or choose "
                    f"another {option('output')}"
                )


def _refuse_checkpoints_left(root: Path, removed: set[str]) -> None:
    checkpoints = root / "checkpoints"
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return
    for step in sorted(checkpoints.glob("step-*")):
        if (step / "state.json").is_file() and f"checkpoints/{step.name}/state.json" not in removed:
            raise UserError(
                f"{option('overwrite')}: checkpoint {step} is not in slide's record of the files it wrote in "
                f"{root}, so it would stay and a later {option('resume')} would continue it; remove it yourself, "
                f"or choose another {option('output')}"
            )


def remove_for_overwrite(root: Path, victims: list[Path]) -> None:
    """Remove ``victims`` (:func:`overwrite_plan`), then every folder that removal left empty. A folder
    that still holds the user's files stays, and one log line names it."""
    folders: set[Path] = set()
    for path in victims:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            raise UserError(f"{option('overwrite')}: cannot remove {path}: {error.strerror or error}") from None
        parent = path.parent
        while parent != root and parent.is_relative_to(root):
            folders.add(parent)
            parent = parent.parent
    kept = []
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            if folder.parent == root:
                left = sorted(p.relative_to(folder).as_posix() for p in _walk(folder))
                shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
                kept.append(f"{folder.name}/ ({shown or 'empty folders'})")
    if victims:
        log.info("%s: removed %d file(s) of the earlier run from %s", option("overwrite"), len(victims), root)
    if kept:
        log.info("%s: kept %s in %s: files slide did not write", option("overwrite"), "; ".join(kept), root)
    with contextlib.suppress(FileNotFoundError):
        (root / RECORD_FILE).unlink()
