"""Prepared rows on disk: int32 files mapped lazily, a content key, and atomic writes.

A prepared dataset is a directory: ``meta.json`` plus, per split (``train``, ``eval``), three files of
int32 rows (``input_ids``, ``labels``, ``position_ids``). Rows are read back with ``torch.from_file`` as a
private mapping, so host memory holds only the pages a batch touches, however large the dataset.

With a cache directory, the prepared dataset lives at ``<cache_dir>/<key>/``; the key hashes everything
that changes the rows (:func:`cache_key`), so a second run with the same inputs maps the files and
tokenizes nothing. A build writes into a temporary directory beside it and renames it into place, so a
crash leaves no half-written entry and two runs racing to build the same key both end with a whole one.
Without a cache directory the files go to a temporary directory that is unlinked once mapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from slide_hf.data.packing import Rows
from slide_hf.errors import UserError

__all__ = [
    "FORMAT_VERSION",
    "PreparedStore",
    "RowFiles",
    "RowWriter",
    "cache_key",
    "read_meta",
    "rows_digest",
    "tokenizer_fingerprint",
    "write_meta",
]

FORMAT_VERSION = 3
"""Bumped whenever the rows a given input produces, or what ``meta.json`` records of them, change (layout,
masking, packing rules, statistics)."""

_ARRAYS = ("input_ids", "labels", "position_ids")
log = logging.getLogger("slide.data")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What decides the token ids: the whole fast-tokenizer definition (vocab, merges, added tokens, pre-
    and post-processing), or a slow tokenizer's vocabulary, plus the special ids the data path uses."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    added = {str(index): str(token) for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    specials = {
        "class": type(tokenizer).__name__,
        "added": added,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    digest.update(json.dumps(specials, sort_keys=True).encode("utf-8"))
    return digest.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    payload = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


class RowWriter:
    """Appends blocks of rows to one split's three int32 files and counts what they hold."""

    def __init__(self, directory: Path, seq_len: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.seq_len = seq_len
        self.rows = 0
        self.tokens = 0
        self.loss_tokens = 0
        self._handles: dict[str, BinaryIO] = {name: (directory / f"{name}.int32").open("wb") for name in _ARRAYS}
        self._hashes = {name: hashlib.sha256() for name in _ARRAYS}

    def write(self, block: Rows) -> None:
        for name in _ARRAYS:
            data = np.ascontiguousarray(getattr(block, name), dtype=np.int32).tobytes()
            self._handles[name].write(data)
            self._hashes[name].update(data)
        rows = block.input_ids.shape[0]
        self.rows += rows
        self.tokens += block.tokens
        self.loss_tokens += int((block.labels != -100).sum())

    @property
    def digest(self) -> str:
        """:func:`rows_digest` of what was written, computed as it was written."""
        return _combine({name: hashed.hexdigest() for name, hashed in self._hashes.items()})

    def close(self) -> None:
        for handle in self._handles.values():
            if not handle.closed:
                handle.close()


def _combine(digests: dict[str, str]) -> str:
    return hashlib.sha256("|".join(digests[name] for name in _ARRAYS).encode("ascii")).hexdigest()


def rows_digest(directory: Path) -> str:
    """A SHA-256 over one split's prepared rows (each array file hashed, then the three hashes): what a
    resumed run compares to know it trains on the rows the checkpoint's data position counts in, whatever
    the source file's path or modification time. Builds record it in ``meta.json``; this reads the files
    for an entry prepared before that."""
    digests = {}
    for name in _ARRAYS:
        hashed = hashlib.sha256()
        with (directory / f"{name}.int32").open("rb") as handle:
            while chunk := handle.read(1 << 24):
                hashed.update(chunk)
        digests[name] = hashed.hexdigest()
    return _combine(digests)


class RowFiles:
    """One split's rows, mapped: (rows, seq_len) int32 tensors backed by the files."""

    def __init__(self, directory: Path, rows: int, seq_len: int) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        for name in _ARRAYS:
            path = directory / f"{name}.int32"
            expected = rows * seq_len * 4
            if not path.is_file() or path.stat().st_size != expected:
                raise FileNotFoundError(f"{path} is missing or not {expected} bytes")
            if rows == 0:
                self.tensors[name] = torch.empty((0, seq_len), dtype=torch.int32)
                continue
            flat = torch.from_file(str(path), shared=False, size=rows * seq_len, dtype=torch.int32)
            self.tensors[name] = flat.view(rows, seq_len)


class PreparedStore:
    """Where one key's prepared dataset lives: an existing cache entry, or a build committed atomically."""

    def __init__(self, cache_dir: Path | None, key: str) -> None:
        self.final = Path(cache_dir).expanduser() / key if cache_dir is not None else None

    def existing(self) -> Path | None:
        if self.final is not None and (self.final / "meta.json").is_file():
            return self.final
        return None

    @contextlib.contextmanager
    def build(self, *, replace: bool = False) -> Iterator[Path]:
        """A fresh directory to build in. On a clean exit it is renamed to the cache entry (a concurrent
        run's finished entry wins unless ``replace``); without a cache it is deleted on exit, so the caller
        maps its files inside the block (a mapping outlives the unlinked file)."""
        if self.final is None:
            work = Path(tempfile.mkdtemp(prefix="slide-data-"))
            try:
                yield work
            finally:
                shutil.rmtree(work, ignore_errors=True)
            return
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f".{self.final.name}-", dir=self.final.parent))
        except OSError as error:
            raise UserError(f"cannot write the data cache in {self.final.parent}: {error.strerror or error}") from None
        try:
            yield work
            self._commit(work, replace=replace)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _commit(self, work: Path, *, replace: bool) -> None:
        assert self.final is not None
        if replace and self.final.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{self.final.name}-stale-", dir=self.final.parent))
            os.rename(self.final, stale / "entry")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(work, self.final)
        except OSError:
            if self.existing() is None:
                raise  # not a concurrent run's finished entry: something else is in the way


def read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT_VERSION else None


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    (directory / "meta.json").write_text(json.dumps({"format": FORMAT_VERSION, **meta}, indent=1), encoding="utf-8")
