"""Preference pairs (``prompt``, ``chosen``, ``rejected``) to rows that keep each pair together.

A record holds a prompt and two completions, either as strings or in TRL's conversational format (the
prompt a list of messages, each completion a list holding the assistant turn). Each completion becomes
one sequence, prompt + completion, encoded as SFT encodes a conversation (:mod:`slide_hf.data.chat`, loss
exactly on the assistant's tokens) when the tokenizer has a chat template, else as plain text (the prompt
with the tokenizer's special tokens, the completion and EOS); the loss is on the completion alone, never
on the prompt (earlier assistant turns of a conversational prompt included).

Lengths, as TRL's ``max_length`` with ``truncation_mode="keep_start"``: both sequences of a pair go in one
row of ``--seq-len`` tokens, so each may hold ``seq_len // 2`` tokens; a longer one loses the end of its
completion (the pair is counted as truncated, never silently), and a pair either of whose sequences keeps
no completion token within that limit (a long prompt, or turns of its own before the reply) is refused in
one line, as are a missing, null or empty completion and a pair whose two sequences are the same (as
written, once rendered by the chat template, or within the limit).

Rows: a pair's chosen sequence, then its rejected one, each a document of its own (position ids restart,
no attention across them; each document's first label is ``IGNORE``). With packing, pairs fill rows in
file order, a new row when the next pair does not fit; without, one pair per row. Labels carry which
completion they belong to (Note [Tagged preference labels] in slide_hf/preference/tags.py).

Held-out pairs (``--eval-data``, or ``--eval-fraction`` of ``--data`` split by whole records, as SFT splits
them) are rows of their own, their pairs numbered from 0: the evaluation has a head of its own (Note [A
head per pair set] in slide_hf/preference/run.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slide_hf.data.chat import ChatEncoder
from slide_hf.data.dataset import Dataset, DataStats, SourcePart, held_out, open_source, source_list
from slide_hf.data.options import IGNORE, DataOptions
from slide_hf.data.readers import Record
from slide_hf.data.schemas import ChatExample, _content, _messages, _type
from slide_hf.data.templates import resolve_template
from slide_hf.errors import UserError
from slide_hf.preference.tags import tag_labels
from slide_hf.spelling import option

__all__ = [
    "EncodedPair",
    "PairEncoder",
    "PairExample",
    "load_pair_split",
    "load_pairs",
    "parse_pair",
    "preview_pairs",
]

Turns = str | list[dict[str, Any]]


@dataclass(frozen=True)
class PairExample:
    """One record: a prompt and two completions, each a string or a list of messages."""

    where: str
    prompt: Turns
    chosen: Turns
    rejected: Turns


@dataclass(frozen=True)
class EncodedPair:
    """A pair as trained: each sequence's int32 token ids and labels (``IGNORE`` off the completion)."""

    where: str
    chosen: tuple[np.ndarray, np.ndarray]
    rejected: tuple[np.ndarray, np.ndarray]
    prompt_tokens: int
    truncated: bool

    def sequences(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The chosen sequence, then the rejected one: the order they take in a row."""
        yield self.chosen
        yield self.rejected

    @property
    def tokens(self) -> int:
        return len(self.chosen[0]) + len(self.rejected[0])


def parse_pair(record: Record) -> PairExample:
    """The pair ``record`` holds, or one :class:`UserError` line naming the record and the field."""
    where, fields = record.where, record.fields
    for key in ("prompt", "chosen", "rejected"):
        if fields.get(key) is None:
            # A null field is there: listing it among the fields found would contradict "no 'key'".
            why = f"'{key}' is null" if key in fields else f"found: {', '.join(sorted(map(str, fields))) or 'none'}"
            raise UserError(f"{where}: a preference pair needs 'prompt', 'chosen' and 'rejected'; no '{key}' ({why})")
    prompt = _turns(fields["prompt"], where, "prompt", completion=False)
    chosen = _turns(fields["chosen"], where, "chosen", completion=True)
    rejected = _turns(fields["rejected"], where, "rejected", completion=True)
    if isinstance(prompt, str) != isinstance(chosen, str) or isinstance(chosen, str) != isinstance(rejected, str):
        raise UserError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all be message lists")
    if chosen == rejected:
        raise UserError(f"{where}: 'chosen' and 'rejected' are the same; a pair must prefer one completion to another")
    return PairExample(where, prompt, chosen, rejected)


def _turns(value: Any, where: str, key: str, *, completion: bool) -> Turns:
    if isinstance(value, str):
        if completion and not value.strip():
            raise UserError(f"{where}: '{key}' is empty; a completion needs text to train")
        return value
    if not isinstance(value, list):
        raise UserError(f"{where}: '{key}' must be a string or a list of messages, got {_type(value)}")
    if not value:
        raise UserError(f"{where}: '{key}' is empty")
    messages = _messages(value, f"{where}: {key}")
    if completion:
        replies = [m for m in messages if m["role"] == "assistant"]
        if not replies:
            raise UserError(f"{where}: '{key}' holds no assistant message")
        if not any(_content(m["content"], where, key).strip() for m in replies):
            raise UserError(f"{where}: '{key}' is empty; a completion needs text to train")
    return messages


class PairEncoder:
    """Token ids and completion-only labels of pairs, with the chat template when there is one."""

    def __init__(self, tokenizer: Any, options: DataOptions) -> None:
        self.tokenizer = tokenizer
        self.limit = options.seq_len // 2
        template = resolve_template(tokenizer, options.chat_template)
        self.chat = (
            ChatEncoder(
                tokenizer,
                template,
                train_on_inputs=False,
                keep_reasoning=options.keep_reasoning,
                system_message=options.system_message,
            )
            if template
            else None
        )
        self.vocab_size = options.vocab_size

    def encode(self, pair: PairExample) -> EncodedPair:
        """The pair as trained, or one line naming the record when either side would train nothing after the
        cut (the pair's loss would compare a completion with an empty one) or both sides are the same tokens
        (the loss's gradient would be zero, yet the pair would count in the step's mean)."""
        full = {
            "chosen": self._sequence(pair.where, pair.prompt, pair.chosen),
            "rejected": self._sequence(pair.where, pair.prompt, pair.rejected),
        }
        starts = {side: _first_trained(labels) for side, (_, labels) in full.items()}
        prompt_tokens = min(starts.values())
        kept = {side: self._cut(sequence) for side, sequence in full.items()}
        for side, (_, labels) in kept.items():
            if not (labels != IGNORE).any():
                raise UserError(self._nothing_kept(pair.where, side, starts[side], prompt_tokens))
        if _same(kept["chosen"], kept["rejected"]):
            raise UserError(self._same_message(pair.where, cut=not _same(full["chosen"], full["rejected"])))
        truncated = max(len(ids) for ids, _ in full.values()) > self.limit
        return EncodedPair(pair.where, kept["chosen"], kept["rejected"], prompt_tokens, truncated)

    def _nothing_kept(self, where: str, side: str, start: int, prompt_tokens: int) -> str:
        """Why ``side`` keeps no trained token: the shared prompt fills the limit, or the completion's own
        turns before its reply (a system turn inside ``side``) push the reply past it."""
        room = f"each sequence of a pair may hold {self.limit} ({option('seq_len')} / 2)"
        if prompt_tokens >= self.limit:
            return (
                f"{where}: the prompt is {prompt_tokens} tokens, and {room}; shorten the prompt or raise "
                f"{option('seq_len')}"
            )
        if start >= self.limit:
            return (
                f"{where}: '{side}' keeps no token to train: its reply starts after {start} tokens (the prompt "
                f"and the turns of '{side}' before the reply), and {room}; shorten them or raise {option('seq_len')}"
            )
        return (
            f"{where}: '{side}' keeps no token to train: its only one within the limit is its sequence's first, "
            "which nothing in a row predicts"
        )

    def _same_message(self, where: str, *, cut: bool) -> str:
        """The raw-identical refusal of :func:`parse_pair`, saying what made the two sequences the same."""
        if cut:
            how = f"within the {self.limit} tokens each sequence of a pair may hold (raise {option('seq_len')})"
        elif self.chat is not None:
            how = "once rendered by the chat template"
        else:
            how = "once tokenized"
        return f"{where}: 'chosen' and 'rejected' are the same {how}; a pair must prefer one completion to another"

    def _cut(self, sequence: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ids, labels = sequence[0][: self.limit], sequence[1][: self.limit].copy()
        labels[0] = IGNORE  # a document's first token is predicted by nothing in its row
        return ids, labels

    def _sequence(self, where: str, prompt: Turns, completion: Turns) -> tuple[np.ndarray, np.ndarray]:
        if self.chat is not None:
            ids, labels = self._chat(where, prompt, completion)
        else:
            ids, labels = self._plain(where, prompt, completion)
        if self.vocab_size is not None and len(ids) and int(ids.max()) >= self.vocab_size:
            raise UserError(
                f"{where}: token id {int(ids.max())} is outside the model's vocabulary of {self.vocab_size}"
            )
        if not (labels != IGNORE).any():
            raise UserError(f"{where}: the completion renders to no token to train")
        return ids, labels

    def _chat(self, where: str, prompt: Turns, completion: Turns) -> tuple[np.ndarray, np.ndarray]:
        assert self.chat is not None
        prompt_turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        reply_turns = (
            [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        )
        (encoded,) = self.chat.encode([ChatExample(where, prompt_turns + reply_turns)])
        labels = encoded.labels.copy()
        keep = sum(1 for m in reply_turns if m["role"] == "assistant")
        _keep_last_runs(labels, keep)  # the prompt's own assistant turns are context, not trained
        return encoded.input_ids.astype(np.int32), labels.astype(np.int32)

    def _plain(self, where: str, prompt: Turns, completion: Turns) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise UserError(
                f"{where}: a conversational pair needs a chat template; pass {option('chat_template')} (a file, or chatml)"
            )
        head = np.asarray(self.tokenizer(prompt, add_special_tokens=True)["input_ids"], dtype=np.int32)
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        tail_ids = list(self.tokenizer(completion, add_special_tokens=False)["input_ids"]) + eos
        tail = np.asarray(tail_ids, dtype=np.int32)
        ids = np.concatenate([head, tail])
        labels = np.concatenate([np.full(len(head), IGNORE, dtype=np.int32), tail])
        return ids, labels


def _first_trained(labels: np.ndarray) -> int:
    return int(np.argmax(labels != IGNORE))


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether two sequences are the same tokens trained the same way: a pair of them teaches nothing."""
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _keep_last_runs(labels: np.ndarray, keep: int) -> None:
    """Untrain every run of trained labels but the last ``keep`` (in place)."""
    trained = labels != IGNORE
    starts = np.flatnonzero(trained & ~np.concatenate([[False], trained[:-1]]))
    if len(starts) > keep:
        labels[: starts[len(starts) - keep]] = IGNORE


def _pairs(source: Any, tokenizer: Any, options: DataOptions, count: int | None = None) -> Iterator[EncodedPair]:
    reader = open_source(source, max_record_bytes=options.max_record_bytes)
    encoder = PairEncoder(tokenizer, options)
    for index, record in enumerate(reader.records()):
        if count is not None and index >= count:
            return
        yield encoder.encode(parse_pair(record))


def preview_pairs(source: Any, tokenizer: Any, options: DataOptions, count: int) -> list[EncodedPair]:
    """The first ``count`` pairs as trained, for `slide data --objective dpo`; of several sources, the first
    pairs of each in turn until ``count`` are shown."""
    sources = source_list(source)
    share = -(-count // len(sources))
    shown: list[EncodedPair] = []
    for one in sources:
        shown += _pairs(one, tokenizer, options, min(share, count - len(shown)))
    return shown


def load_pairs(source: Any, tokenizer: Any, options: DataOptions, *, what: str = "data") -> Dataset:
    """Every pair of ``source`` in rows (see the module docstring); ``stats.examples`` counts the pairs,
    ``stats.truncated_examples`` those cut to the limit. Prepared in memory: a pair's two sequences are a
    few thousand tokens, and the rows are what the reference pass and every step read. Several sources
    (``--data`` repeated) are prepared one after another, as training text is: no row holds pairs of two
    sources, each source is a part of its own (which ``--data-weights`` samples), and the pairs are
    numbered across all of them, so each completion keeps one number for its reference log-probability.
    ``what``: the option that named ``source`` (``data``, ``eval_data``), for the messages."""
    if source is None:
        raise UserError(f"{option('objective')} dpo and simpo train on pairs: pass {option(what)} FILE")
    rows = _PairRows(options)
    for one in source_list(source):
        for pair in _pairs(one, tokenizer, options):
            rows.add(pair)
        if not rows.end_source(str(one)):
            raise UserError(f"{option(what)} {one} holds no preference pair")
    return rows.dataset(tokenizer)


def load_pair_split(
    source: Any, tokenizer: Any, options: DataOptions, *, eval_fraction: float, seed: int
) -> tuple[Dataset, Dataset]:
    """``(train, eval)``: the pairs of ``source`` (as :func:`load_pairs` reads them) split as SFT splits
    records (slide_hf/data/dataset.py's :func:`held_out`: about ``eval_fraction`` of each source's records,
    chosen by ``seed``), one record a pair, so a pair's chosen and rejected are always on the same side.
    Each side's pairs are numbered from 0 in their own rows: the training rows are those of a file holding
    the training pairs alone. A split that leaves either side without a pair is one line."""
    if source is None:
        raise UserError(f"{option('objective')} dpo and simpo train on pairs: pass {option('data')} FILE")
    train, held = _PairRows(options), _PairRows(options)
    for ordinal, one in enumerate(source_list(source)):
        count = 0
        for index, pair in enumerate(_pairs(one, tokenizer, options)):
            (held if held_out(seed, ordinal, index, eval_fraction) else train).add(pair)
            count += 1
        trained = train.end_source(str(one))
        held.end_source(str(one))
        if not count:
            raise UserError(f"{option('data')} {one} holds no preference pair")
        if not trained:
            raise UserError(
                f"{option('eval_fraction')} {eval_fraction} holds out all {count} pair(s) of {one}, leaving none "
                "to train; lower it"
            )
    if not held.pairs:
        raise UserError(
            f"{option('eval_fraction')} {eval_fraction} holds out none of the {train.pairs} pair(s) of "
            f"{' + '.join(map(str, source_list(source)))}; raise it"
        )
    return train.dataset(tokenizer), held.dataset(tokenizer, suffix=" (eval split)")


class _PairRows:
    """Rows of pairs under construction, in the order they are added: a pair's two sequences side by side
    in one row (packed, or one pair a row), a new row at each source, completions numbered from 0."""

    def __init__(self, options: DataOptions) -> None:
        self.options = options
        self.rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.parts: list[SourcePart] = []
        self.pairs = 0
        self.truncated = 0
        self._used = options.seq_len  # a source starts a row of its own
        self._part_start = (0, 0, 0, 0)  # rows, pairs, tokens, loss tokens when the source began
        self._tokens = self._loss_tokens = 0

    def add(self, pair: EncodedPair) -> None:
        documents = [
            (ids, tag_labels(labels, 2 * self.pairs + side)) for side, (ids, labels) in enumerate(pair.sequences())
        ]
        if not self.options.packing or self._used + pair.tokens > self.options.seq_len:
            self.rows.append([])
            self._used = 0
        self.rows[-1] += documents
        self._used += pair.tokens
        self.pairs += 1
        self.truncated += pair.truncated
        self._tokens += pair.tokens
        self._loss_tokens += sum(int((labels != IGNORE).sum()) for _, labels in pair.sequences())

    def end_source(self, name: str) -> int:
        """Close one source's rows as a part (none when it added no pair); returns its pairs."""
        now = (len(self.rows), self.pairs, self._tokens, self._loss_tokens)
        start = self._part_start
        rows, pairs, tokens, loss_tokens = (b - a for a, b in zip(start, now, strict=True))
        if pairs:
            self.parts.append(SourcePart(name, start[0], rows, pairs, tokens, loss_tokens))
        self._part_start = now
        self._used = self.options.seq_len
        return pairs

    def dataset(self, tokenizer: Any, *, suffix: str = "") -> Dataset:
        seq_len = self.options.seq_len
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        input_ids, labels, positions = _fill(self.rows, seq_len, pad)
        digest = hashlib.sha256()
        for array in (input_ids, labels, positions):
            digest.update(array.tobytes())
        cells = len(self.rows) * seq_len
        stats = DataStats(
            examples=self.pairs,
            rows=len(self.rows),
            tokens=self._tokens,
            loss_tokens=self._loss_tokens,
            padding_fraction=(cells - self._tokens) / cells,
            truncated_examples=self.truncated,
            skipped_examples=0,
        )
        return Dataset(
            torch.from_numpy(input_ids),
            torch.from_numpy(labels),
            torch.from_numpy(positions),
            " + ".join(part.name for part in self.parts) + suffix,
            stats,
            tuple(self.parts),
            digest.hexdigest(),
        )


def _fill(rows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int, pad: int) -> tuple[np.ndarray, ...]:
    """The rows as arrays: documents side by side, positions restarting at each, the padding continuing the
    last document's positions (as slide_hf/data/packing.py lays rows out)."""
    input_ids = np.full((len(rows), seq_len), pad, dtype=np.int32)
    labels = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    positions = np.empty((len(rows), seq_len), dtype=np.int32)
    for row, documents in enumerate(rows):
        cursor = 0
        for ids, tagged in documents:
            length = len(ids)
            input_ids[row, cursor : cursor + length] = ids
            labels[row, cursor : cursor + length] = tagged
            positions[row, cursor : cursor + length] = np.arange(length)
            cursor += length
        start = positions[row, cursor - 1] + 1
        positions[row, cursor:] = np.arange(start, start + seq_len - cursor)
    return input_ids, labels, positions
