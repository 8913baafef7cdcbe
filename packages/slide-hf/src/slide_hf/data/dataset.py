"""From a data source to packed rows on disk: the one pipeline behind `slide train` and `slide data`.

records (:mod:`~slide_hf.data.readers`) -> examples (:mod:`~slide_hf.data.schemas`) -> documents with labels,
tokenized in batches (:mod:`~slide_hf.data.encode`, :mod:`~slide_hf.data.chat`) -> rows
(:mod:`~slide_hf.data.packing`) -> int32 files (:mod:`~slide_hf.data.storage`), streamed end to end so host
memory stays bounded. An evaluation split is drawn per *record*, before packing, so no document is in
both sets; membership hashes the record's index with the seed, which is deterministic and needs no second
pass over the data.

Several sources (a mixture) are prepared into one set of files, one after another: each source's rows are
packed on their own (no row mixes two sources), and the rows each source holds are recorded as a
:class:`SourcePart`, which is what weighted sampling (:mod:`~slide_hf.data.mixture`) and `slide data`'s
per-source shares read. The evaluation split is drawn per source, by each record's index in its source.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slide_hf.data.encode import EncodedRecord, Encoder
from slide_hf.data.hf_datasets import HubDataset, SavedDataset, is_hub_name, is_saved_dataset
from slide_hf.data.options import DataOptions
from slide_hf.data.packing import Packer
from slide_hf.data.readers import DEFAULT_MAX_RECORD_BYTES, BundledText, Source, open_file_source
from slide_hf.data.schemas import parse_record
from slide_hf.data.storage import (
    PreparedStore,
    RowFiles,
    RowWriter,
    cache_key,
    read_meta,
    rows_digest,
    tokenizer_fingerprint,
    write_meta,
)
from slide_hf.data.templates import resolve_template
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "DataSource",
    "DataStats",
    "Dataset",
    "SourcePart",
    "dropped_reasoning_line",
    "held_out",
    "load_dataset",
    "load_split",
    "open_source",
    "preview",
    "source_list",
]

DataSource = str | Path | None | Sequence[str | Path]
"""One source (a file, a datasets directory, a Hub name; None: the bundled text) or several, a mixture."""

log = logging.getLogger("slide.data")

_NAMED = 5  # records named in a warning before "..."
_PREVIEW_BATCH = 256  # records per tokenizer call in a preview: a huge --show must not gather a file first


@dataclass(frozen=True)
class DataStats:
    """What a prepared split holds. ``examples`` counts records kept; ``tokens`` and ``loss_tokens`` the
    tokens and targets the rows hold (a split text's overlap tokens are in two rows, a target in one);
    ``truncated_examples`` the kept records whose end was dropped to fit ``seq_len``; ``split_examples``
    the texts split into row-sized pieces instead, which lose no target, so the two are apart (a reader of
    ``truncated_examples`` must not take a split text for lost data); ``skipped_examples`` those left with
    no token to train; ``dropped_reasoning_turns`` the assistant messages of kept records whose reasoning
    the chat template leaves out of the render (Qwen3 keeps only the replies' after the last user query),
    so it is not trained."""

    examples: int
    rows: int
    tokens: int
    loss_tokens: int
    padding_fraction: float
    truncated_examples: int
    skipped_examples: int
    dropped_reasoning_turns: int = 0
    example_tokens_min: int = 0
    example_tokens_median: int = 0
    example_tokens_max: int = 0
    """The kept records' lengths in tokens before any cut (a text split into pieces counts whole)."""
    longer_than_seq_len: int = 0
    """Kept records longer than ``seq_len``: texts split into row-sized pieces, the others truncated."""
    split_examples: int = 0
    """Kept texts longer than ``seq_len``, split into row-sized pieces (see ``truncated_examples``)."""


@dataclass(frozen=True)
class SourcePart:
    """The rows one source of a split holds: rows ``[first_row, first_row + rows)``, and what they carry."""

    name: str
    first_row: int
    rows: int
    examples: int
    tokens: int
    loss_tokens: int


@dataclass(frozen=True)
class Dataset:
    """Prepared rows: ``input_ids``, ``labels`` and ``position_ids`` are (N, seq_len) int32 tensors mapped
    from disk (batches convert the rows they take to int64). ``parts``: each source's rows, in order
    (one part for one source)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    source: str
    stats: DataStats
    parts: tuple[SourcePart, ...] = ()
    digest: str = ""
    """SHA-256 of the prepared rows (storage.rows_digest): equal digests, equal training data."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def open_source(source: str | Path | None, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Source:
    """The reader for ``source``: None (the bundled text), a file, a datasets directory, or ``org/name``."""
    if source is None:
        return BundledText()
    path = Path(source).expanduser()
    if path.is_dir():
        if is_saved_dataset(path):
            return SavedDataset(path, max_record_bytes=max_record_bytes)
        raise UserError(
            f"data directory {path} was not written by datasets' save_to_disk (no dataset_info.json or "
            "dataset_dict.json); pass a file"
        )
    if path.is_file():
        return open_file_source(path, max_record_bytes=max_record_bytes)
    text = str(source)
    if is_hub_name(text) and not text.startswith((".", "/", "~")):
        return HubDataset(text, max_record_bytes=max_record_bytes)
    raise UserError(f"data file {path} does not exist")


def source_list(source: DataSource) -> list[str | Path | None]:
    """``--data`` as a list of sources: one (None: the bundled text), or several, in order."""
    if isinstance(source, str | Path) or source is None:
        return [source]
    sources: list[str | Path | None] = list(source)
    if not sources:
        raise UserError(f"{option('data')} names no source")
    return sources


def _open_all(source: DataSource, options: DataOptions) -> list[Source]:
    return [open_source(one, max_record_bytes=options.max_record_bytes) for one in source_list(source)]


def load_dataset(source: DataSource, tokenizer: Any, options: DataOptions, *, cache_dir: Path | None = None) -> Dataset:
    """Every record of ``source`` as training rows (None: the bundled English text; several sources are
    prepared one after another, see the module notes)."""
    train, _ = _prepare(source, tokenizer, options, cache_dir=cache_dir, eval_fraction=0.0, seed=0)
    return train


def load_split(
    source: DataSource,
    tokenizer: Any,
    options: DataOptions,
    *,
    eval_fraction: float,
    seed: int = 0,
    cache_dir: Path | None = None,
) -> tuple[Dataset, Dataset]:
    """``(train, eval)``: about ``eval_fraction`` of the records of each source, chosen by ``seed``, go to
    ``eval``."""
    if not 0.0 < eval_fraction < 1.0:
        raise UserError(f"{option('eval_fraction')} must be between 0 and 1 (exclusive), got {eval_fraction}")
    train, held = _prepare(source, tokenizer, options, cache_dir=cache_dir, eval_fraction=eval_fraction, seed=seed)
    assert held is not None
    return train, held


def preview(source: DataSource, tokenizer: Any, options: DataOptions, count: int) -> list[EncodedRecord]:
    """The first ``count`` records as documents (before packing), for showing which tokens carry loss; of
    several sources, the first records of each in turn until ``count`` are shown."""
    count = min(count, sys.maxsize)  # more than a source can hold (islice's limit) shows every record
    readers = _open_all(source, options)
    template = resolve_template(tokenizer, options.chat_template)
    encoder = Encoder(tokenizer, options, template, batch_size=max(min(count, _PREVIEW_BATCH), 1))
    shown: list[EncodedRecord] = []
    share = -(-count // len(readers))
    for reader in readers:
        examples = (parse_record(record, vocab_size=options.vocab_size) for record in reader.records())
        with _os_errors_named(reader.name):
            shown += encoder.encode(itertools.islice(examples, min(share, count - len(shown))))
    return shown


# ---- building -------------------------------------------------------------------------------------------------


def _prepare(
    source: DataSource,
    tokenizer: Any,
    options: DataOptions,
    *,
    cache_dir: Path | None,
    eval_fraction: float,
    seed: int,
) -> tuple[Dataset, Dataset | None]:
    readers = _open_all(source, options)
    name = " + ".join(reader.name for reader in readers)
    template = resolve_template(tokenizer, options.chat_template)
    fingerprints = [reader.fingerprint() for reader in readers]
    key = cache_key(
        {
            "source": fingerprints[0] if len(fingerprints) == 1 else fingerprints,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "template": template.text if template else None,
            "options": asdict(options) | {"max_positions": None, "chat_template": None, "max_record_bytes": None},
            "split": [eval_fraction, seed] if eval_fraction > 0 else None,
        }
    )
    store = PreparedStore(cache_dir, key)
    replace = False
    directory = store.existing()
    if directory is not None:
        meta = read_meta(directory)
        try:
            if meta is None:
                raise FileNotFoundError(f"{directory}/meta.json is unreadable")
            result = _open(directory, meta, name)
        except (FileNotFoundError, KeyError, TypeError, ValueError) as error:
            log.warning("rebuilding the prepared data in %s: %s", directory, error)
            replace = True
        else:
            log.info("data: %s prepared in %s (cache)", name, directory)
            for note in meta.get("notes", []):
                log.warning("%s", note)
            return result
    with _os_errors_named(name), store.build(replace=replace) as work:
        meta = _build(readers, tokenizer, options, template, work, eval_fraction=eval_fraction, seed=seed)
        if store.final is None:
            return _open(work, meta, name)
    assert store.final is not None
    return _open(store.final, meta, name)


@contextlib.contextmanager
def _os_errors_named(fallback: str) -> Iterator[None]:
    """A full disk or an unreadable file becomes one line naming the file, not a traceback."""
    try:
        yield
    except OSError as error:
        raise UserError(f"{error.filename or fallback}: {error.strerror or error}") from None


def _open(directory: Path, meta: dict[str, Any], name: str) -> tuple[Dataset, Dataset | None]:
    seq_len = int(meta["seq_len"])
    splits = {}
    for split, stats in meta["splits"].items():
        files = RowFiles(directory / split, int(stats["rows"]), seq_len)
        source = name if split == "train" else f"{name} (eval split)"
        digest = meta.get("digests", {}).get(split) or rows_digest(directory / split)
        parts = tuple(SourcePart(**part) for part in meta.get("parts", {}).get(split, []))
        if not parts:  # one source
            whole = SourcePart(name, 0, stats["rows"], stats["examples"], stats["tokens"], stats["loss_tokens"])
            parts = (whole,)
        if sum(part.rows for part in parts) != stats["rows"]:
            raise ValueError(f"the sources' rows do not add up to the {stats['rows']} rows of {split}")
        splits[split] = Dataset(
            files.tensors["input_ids"],
            files.tensors["labels"],
            files.tensors["position_ids"],
            source,
            DataStats(**stats),
            parts,
            digest,
        )
    return splits["train"], splits.get("eval")


class _Split:
    """One split under construction: a packer feeding a row writer, and the counts for its stats."""

    def __init__(self, directory: Path, tokenizer: Any, options: DataOptions) -> None:
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.packer = Packer(options.seq_len, pad, packing=options.packing)
        self.writer = RowWriter(directory, options.seq_len)
        self.seq_len = options.seq_len
        self.examples = 0
        self.cut: dict[str, list[str]] = {"split": [], "truncated": []}  # the first few records of each
        self.cut_count = {"split": 0, "truncated": 0}
        self.skipped: list[str] = []
        self.skipped_count = 0
        self.lost_per_part: list[_LostToSeqLen] = []  # each ended source's records that --seq-len emptied
        self._part_lost = _LostToSeqLen()
        self.dropped_reasoning = 0
        self.lengths = array("I")  # each kept record's tokens before any cut, for the stats' min/median/max
        self.longest = {"split": 0, "truncated": 0}
        self.parts: list[SourcePart] = []
        self._part_start = (0, 0, 0, 0)  # rows, examples, tokens, loss tokens when the source began

    def end_source(self, name: str) -> None:
        """Close one source's rows (its last row is not shared with the next source) and record its part."""
        block = self.packer.finish()
        if block is not None:
            self.writer.write(block)
        now = (self.writer.rows, self.examples, self.writer.tokens, self.writer.loss_tokens)
        start = self._part_start
        self.parts.append(SourcePart(name, start[0], *(b - a for a, b in zip(start, now, strict=True))))
        self._part_start = now
        self.lost_per_part.append(self._part_lost)
        self._part_lost = _LostToSeqLen()

    def add(self, record: EncodedRecord) -> None:
        if record.skipped:
            self.skipped_count += 1
            if len(self.skipped) < _NAMED:
                self.skipped.append(record.where)
            if record.lost_to_seq_len:
                self._part_lost.add(record.tokens)
            return
        self.examples += 1
        self.dropped_reasoning += record.dropped_reasoning
        self.lengths.append(record.tokens)
        if record.cut is not None:
            self.cut_count[record.cut] += 1
            self.longest[record.cut] = max(self.longest[record.cut], record.tokens)
            if len(self.cut[record.cut]) < _NAMED:
                self.cut[record.cut].append(record.where)
        for document in record.documents:
            block = self.packer.add(document)
            if block is not None:
                self.writer.write(block)

    def finish(self) -> DataStats:
        block = self.packer.finish()
        if block is not None:
            self.writer.write(block)
        self.writer.close()
        cells = self.writer.rows * self.seq_len
        return DataStats(
            examples=self.examples,
            rows=self.writer.rows,
            tokens=self.writer.tokens,
            loss_tokens=self.writer.loss_tokens,
            padding_fraction=(cells - self.writer.tokens) / cells if cells else 0.0,
            truncated_examples=self.cut_count["truncated"],
            skipped_examples=self.skipped_count,
            dropped_reasoning_turns=self.dropped_reasoning,
            **_length_stats(self.lengths),
            longer_than_seq_len=sum(self.cut_count.values()),
            split_examples=self.cut_count["split"],
        )

    def notes(self, name: str) -> tuple[list[str], list[str]]:
        """``(warnings, infos)``: every record longer than a row warns, with the count and the longest, as do
        skips. A text split into pieces still trains every token but its first (each piece after the first
        repeats the previous one's last token as context), but no token attends across a cut."""
        warnings, infos = [], []
        if self.cut_count["truncated"]:
            count = self.cut_count["truncated"]
            warnings.append(
                f"{name}: truncated {count} example(s) longer than {option('seq_len')} {self.seq_len}: "
                f"{_named(self.cut['truncated'], count)} (the longest {self.longest['truncated']:,} tokens)"
            )
        if self.skipped_count:
            warnings.append(
                f"{name}: skipped {self.skipped_count} example(s) with no token to train within {option('seq_len')} "
                f"{self.seq_len}: {_named(self.skipped, self.skipped_count)}"
            )
        if self.cut_count["split"]:
            count = self.cut_count["split"]
            warnings.append(
                f"{name}: split {count} text(s) longer than {option('seq_len')} {self.seq_len} into row-sized pieces "
                f"(the longest {self.longest['split']:,} tokens): {_named(self.cut['split'], count)}"
            )
        if self.dropped_reasoning:
            infos.append(f"{name}: {dropped_reasoning_line(self.dropped_reasoning)}")
        return warnings, infos


def _build(
    readers: list[Source],
    tokenizer: Any,
    options: DataOptions,
    template: Any,
    directory: Path,
    *,
    eval_fraction: float,
    seed: int,
) -> dict[str, Any]:
    splits = {"train": _Split(directory / "train", tokenizer, options)}
    if eval_fraction > 0:
        splits["eval"] = _Split(directory / "eval", tokenizer, options)
    encoder = Encoder(tokenizer, options, template)
    records = 0
    try:
        for ordinal, reader in enumerate(readers):
            log.info("data: tokenizing %s", reader.name)
            examples = (parse_record(record, vocab_size=options.vocab_size) for record in reader.records())
            for record in encoder.encode(examples):
                records += 1
                to_eval = eval_fraction > 0 and held_out(seed, ordinal, record.index, eval_fraction)
                splits["eval" if to_eval else "train"].add(record)
            for split in splits.values():
                split.end_source(reader.name)
    except BaseException:
        for split in splits.values():
            split.writer.close()
        raise
    name = " + ".join(reader.name for reader in readers)
    stats = {split_name: split.finish() for split_name, split in splits.items()}
    train = splits["train"]
    if stats["train"].rows == 0:
        raise UserError(
            f"{name} holds no example with a token to train ({records} record(s) read)"
            f"{_LostToSeqLen.of(train.lost_per_part).blame(options.seq_len)}"
        )
    for part, lost in zip(train.parts, train.lost_per_part, strict=True) if len(readers) > 1 else []:
        if part.rows == 0:
            raise UserError(
                f"{option('data')} {part.name} holds no example with a token to train{lost.blame(options.seq_len)}"
            )
    if "eval" in stats and stats["eval"].rows == 0:
        raise UserError(
            f"{option('eval_fraction')} {eval_fraction} holds out none of the {records} record(s) of {name}; raise it"
        )
    notes: list[str] = []
    for split_name, split in splits.items():
        warnings, infos = split.notes(name if split_name == "train" else f"{name} (eval)")
        notes += warnings
        for info in infos:
            log.info("%s", info)
    for note in notes:
        log.warning("%s", note)
    meta = {
        "seq_len": options.seq_len,
        "source": name,
        "splits": {split_name: asdict(value) for split_name, value in stats.items()},
        "digests": {split_name: split.writer.digest for split_name, split in splits.items()},
        "parts": {split_name: [asdict(part) for part in split.parts] for split_name, split in splits.items()},
        "notes": notes,
    }
    write_meta(directory, meta)
    return meta


class _LostToSeqLen:
    """The skipped records that truncation to ``--seq-len`` left with no target, and the longest of them:
    when nothing is left to train, they are why, and the longest says how large a ``--seq-len`` fits."""

    def __init__(self) -> None:
        self.count = 0
        self.longest = 0

    @classmethod
    def of(cls, parts: Sequence[_LostToSeqLen]) -> _LostToSeqLen:
        """The sources' together."""
        together = cls()
        together.count = sum(part.count for part in parts)
        together.longest = max((part.longest for part in parts), default=0)
        return together

    def add(self, tokens: int) -> None:
        self.count += 1
        self.longest = max(self.longest, tokens)

    def blame(self, seq_len: int) -> str:
        """The clause that puts an empty split on ``--seq-len`` ("" when the limit emptied no record)."""
        if not self.count:
            return ""
        return (
            f": {self.count} record(s) lost every trained token to {option('seq_len')} {seq_len} "
            f"(the longest {self.longest:,} tokens); raise {option('seq_len')}"
        )


def held_out(seed: int, source: int, index: int, fraction: float) -> bool:
    """Whether record ``index`` of the ``source``-th source is held out (the first source keys by the
    record alone, as a single source always has, so its split does not change when sources are added).
    Preference pairs are split by the same rule (slide_hf/data/preference.py), one record a pair."""
    key = f"{seed}:{index}" if source == 0 else f"{seed}:{source}:{index}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def dropped_reasoning_line(turns: int) -> str:
    """The one line that says how much reasoning the chat template drops (and so is never trained)."""
    noun = "assistant turn's reasoning is" if turns == 1 else "assistant turns' reasoning is"
    return f"{turns} {noun} dropped by the chat template and not trained"


def _length_stats(lengths: array) -> dict[str, int]:
    """The min, median and max of ``lengths`` (0 for none), as :class:`DataStats` fields."""
    if not lengths:
        return {}
    values = np.frombuffer(lengths, dtype=np.uint32)
    return {
        "example_tokens_min": int(values.min()),
        "example_tokens_median": int(np.median(values)),
        "example_tokens_max": int(values.max()),
    }


def _named(wheres: list[str], count: int) -> str:
    return ", ".join(wheres) + (", ..." if count > len(wheres) else "")
