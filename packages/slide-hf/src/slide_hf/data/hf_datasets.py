"""Records out of the optional ``datasets`` library: a directory written by ``save_to_disk``, or a Hub name.

``datasets`` is an extra (``pip install 'slide-hf[datasets]'``), imported only here and only when such a
source is named. Hub names go through ``datasets.load_dataset``, which honours ``HF_DATASETS_OFFLINE`` /
``HF_HUB_OFFLINE`` and reads its local cache; the table it returns is memory-mapped Arrow, so rows stream
from disk. A split other than ``train`` is chosen with ``org/name:split``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slide_hf.data.readers import DEFAULT_MAX_RECORD_BYTES, Record, check_record_size, first_line
from slide_hf.errors import UserError
from slide_hf.hub import is_hub_id

__all__ = ["HubDataset", "SavedDataset", "is_hub_name", "is_saved_dataset"]

_SPLIT = re.compile(r"^[\w.-]+$")
_OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def is_hub_name(text: str) -> bool:
    """``org/name`` or ``org/name:split``, not an existing path, and not a data file's name."""
    repo, colon, split = text.partition(":")
    if colon and not _SPLIT.match(split):
        return False
    return is_hub_id(repo) and not repo.lower().endswith((".json", ".jsonl", ".gz", ".parquet"))


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json"))


def _import_datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{what} needs the datasets library: pip install 'slide-hf[datasets]'") from None
    return datasets


def _rows(dataset: Any, name: str, max_record_bytes: int) -> Iterator[Record]:
    for index, fields in enumerate(dataset):
        where = f"{name} row {index}"
        check_record_size(fields, where, max_record_bytes)
        yield Record(where, dict(fields))


def _one_split(datasets: Any, loaded: Any, name: str, split: str) -> Any:
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(loaded.keys())
        if split in splits:
            return loaded[split]
        if len(splits) == 1:
            return loaded[splits[0]]
        raise UserError(f"{name} has splits {', '.join(splits)} but no {split!r}; name one as {name}:SPLIT")
    return loaded


class SavedDataset:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (its ``train`` split)."""

    def __init__(self, path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.path = path
        self.name = str(path)
        self.max_record_bytes = max_record_bytes

    def fingerprint(self) -> str:
        parts = []
        for file in sorted(self.path.rglob("*")):
            if file.is_file():
                stat = file.stat()
                parts.append(f"{file.relative_to(self.path)}|{stat.st_size}|{stat.st_mtime_ns}")
        return f"{self.path.resolve()}|" + ";".join(parts)

    def records(self) -> Iterator[Record]:
        datasets = _import_datasets(f"reading the datasets directory {self.path}")
        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as error:  # FileNotFoundError, ArrowInvalid, ... from a damaged directory
            raise UserError(f"{self.path}: not a readable datasets directory ({first_line(error)})") from None
        yield from _rows(_one_split(datasets, loaded, self.name, "train"), self.name, self.max_record_bytes)


class HubDataset:
    """``org/name`` (optionally ``:split``, default ``train``) through ``datasets.load_dataset``."""

    def __init__(self, spec: str, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.spec = spec
        self.max_record_bytes = max_record_bytes
        self.name = spec
        repo, _, split = spec.partition(":")
        self.repo = repo
        self.split = split or "train"
        self._dataset: Any = None

    def _load(self) -> Any:
        if self._dataset is None:
            datasets = _import_datasets(f"loading the Hub dataset {self.repo}")
            try:
                loaded = datasets.load_dataset(self.repo)
            except Exception as error:  # no network, unknown name, offline without a cache, ...
                offline = [name for name in _OFFLINE if os.environ.get(name, "").strip() not in ("", "0")]
                hint = f" ({' and '.join(offline)} set: only the local cache is read)" if offline else ""
                raise UserError(
                    f"{self.repo} is not a local file, and loading it as a Hub dataset failed{hint}: "
                    f"{first_line(error)}"
                ) from None
            self._dataset = _one_split(datasets, loaded, self.repo, self.split)
        return self._dataset

    def fingerprint(self) -> str:
        return f"{self.spec}|{getattr(self._load(), '_fingerprint', '')}"

    def records(self) -> Iterator[Record]:
        yield from _rows(self._load(), self.repo, self.max_record_bytes)
