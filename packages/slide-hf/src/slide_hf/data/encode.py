"""Examples to (input_ids, labels) documents of at most ``seq_len`` tokens, tokenized in batches.

Per kind:
- text: the tokens ``tokenizer(texts)`` gives, with the tokenizer's special tokens, EOS appended, loss on
  every token. The text is tokenized without its special tokens (a long one in checked pieces,
  :mod:`slide_hf.data.token_runs`) and they are put around it as a probe shows them; a tokenizer whose
  specials do not simply surround a text gets one call over the texts. A text longer than ``seq_len`` in
  tokens is *split* into pieces of at most ``seq_len`` tokens (it is a stream; each piece still teaches),
  each piece after the first starting with the previous piece's last token: a piece's first token is only
  context (nothing in the piece predicts it), so without that one-token overlap the token at every cut
  would never be a target, and a last piece of one token would hold no target at all. Overlapped, every
  token of the text but its first is a target exactly once, and rows hold one extra token per cut;
- chat: :class:`~slide_hf.data.chat.ChatEncoder` (exact masks or a one-line refusal);
- prompt/completion and Alpaca: through the chat template as one user and one assistant turn when there
  is a template, else plain text: the prompt tokenized alone (with the tokenizer's special tokens) then the
  completion alone plus EOS, so the boundary is exact and the prompt's tokens are those a user's prompt
  gets at inference time; loss on the completion;
- input_ids: as given, with ``labels`` when given (else loss on every token).
Everything but text is *truncated* to ``seq_len`` (the end of a conversation is meaningless without its
start), and the targets the cut drops are counted, so a record it leaves with none is blamed on
``--seq-len``. Each document's first label is ``IGNORE``: labels are HF-aligned (the head predicts
``labels[t]`` from position ``t - 1``), so this keeps the previous document in a packed row from predicting
it. A document left with no label to train is skipped; split, truncated and skipped records are counted,
never silent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from slide_hf.data.chat import ChatEncoder, ChatEncoding
from slide_hf.data.options import IGNORE, DataOptions
from slide_hf.data.schemas import ChatExample, Example, PromptExample, TextExample, TokenExample
from slide_hf.data.templates import ChatTemplate
from slide_hf.data.token_runs import tokenize
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = ["Document", "EncodedRecord", "Encoder"]

Pair = tuple[np.ndarray | list[int], np.ndarray | list[int]]  # token ids and labels, before cutting into documents

SPLIT_OVERLAP = 1
"""Tokens each piece of a split text after the first repeats from the end of the previous piece: the one
token whose prediction the cut would otherwise lose (see the module docstring)."""


@dataclass(frozen=True)
class Document:
    """One row-sized piece: int32 token ids and labels of the same length (<= seq_len)."""

    input_ids: np.ndarray
    labels: np.ndarray


@dataclass(frozen=True)
class EncodedRecord:
    """What one record became: its documents (none when skipped), and whether it was cut."""

    index: int  # the record's position in the source, for a split that keeps records whole
    where: str
    documents: list[Document] = field(default_factory=list)
    cut: str | None = None  # "split" (a text longer than a row, in pieces) or "truncated" (its end dropped)
    dropped_reasoning: int = 0  # assistant messages whose reasoning the chat template left out (untrained)
    tokens: int = 0  # the record's length in tokens before any cut: what `slide data` reports and warns about
    truncated_targets: int = 0  # trained tokens the truncation dropped: a skip they cause is --seq-len's doing

    @property
    def skipped(self) -> bool:
        return not self.documents

    @property
    def lost_to_seq_len(self) -> bool:
        """Skipped only because truncation to ``seq_len`` dropped every token it would have trained."""
        return self.skipped and self.truncated_targets > 0

    def stream(self) -> tuple[np.ndarray, np.ndarray]:
        """The record's ids and labels as one sequence, each token once: a split text's pieces with the
        overlap (:data:`SPLIT_OVERLAP`) left out, so `slide data` shows the text as written; the labels are
        those the rows train (an overlap token is a target in the piece it ends, never in the one it starts)."""
        overlap = SPLIT_OVERLAP if self.cut == "split" else 0
        pieces = [
            (doc.input_ids, doc.labels) if i == 0 else (doc.input_ids[overlap:], doc.labels[overlap:])
            for i, doc in enumerate(self.documents)
        ]
        if not pieces:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
        return np.concatenate([ids for ids, _ in pieces]), np.concatenate([labels for _, labels in pieces])


class Encoder:
    """Turns a stream of examples into :class:`EncodedRecord` s, ``batch_size`` examples per tokenizer call."""

    def __init__(
        self, tokenizer: Any, options: DataOptions, template: ChatTemplate | None, *, batch_size: int = 256
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.template = template
        self.batch_size = batch_size
        self.chat = (
            ChatEncoder(
                tokenizer,
                template,
                train_on_inputs=options.train_on_inputs,
                keep_reasoning=options.keep_reasoning,
                system_message=options.system_message,
            )
            if template
            else None
        )
        self.eos = tokenizer.eos_token_id
        self._ends: tuple[np.ndarray, np.ndarray] | None = None  # see _special_ends
        self._ends_found = False

    def encode(self, examples: Iterable[Example]) -> Iterator[EncodedRecord]:
        batch: list[Example] = []
        index = 0
        for example in examples:
            batch.append(example)
            if len(batch) == self.batch_size:
                yield from self._batch(batch, index)
                index += len(batch)
                batch = []
        if batch:
            yield from self._batch(batch, index)

    def _batch(self, batch: list[Example], first_index: int) -> Iterator[EncodedRecord]:
        """One tokenizer call per kind for the whole batch; records come back in their order."""
        # With a chat template, prompt/completion records are conversations too.
        chat_kinds = (ChatExample, PromptExample) if self.chat is not None else (ChatExample,)
        texts = [i for i, ex in enumerate(batch) if isinstance(ex, TextExample)]
        chats = [i for i, ex in enumerate(batch) if isinstance(ex, chat_kinds)]
        prompts = [i for i, ex in enumerate(batch) if isinstance(ex, PromptExample) and self.chat is None]
        pairs: dict[int, Pair] = {}
        dropped: dict[int, int] = {}
        if texts:
            pairs.update(zip(texts, self._texts(cast(list[TextExample], [batch[i] for i in texts])), strict=True))
        if chats:
            for i, chat in zip(
                chats, self._chats(cast(list[ChatExample | PromptExample], [batch[i] for i in chats])), strict=True
            ):
                pairs[i] = (chat.input_ids, chat.labels)
                dropped[i] = chat.dropped_reasoning
        if prompts:
            pairs.update(
                zip(prompts, self._plain_prompts(cast(list[PromptExample], [batch[i] for i in prompts])), strict=True)
            )
        for i, example in enumerate(batch):
            if isinstance(example, TokenExample):
                labels = example.labels if example.labels is not None else example.input_ids
                pairs[i] = (example.input_ids, labels)
            yield self._documents(first_index + i, example, *pairs[i], dropped_reasoning=dropped.get(i, 0))

    def _texts(self, texts: list[TextExample]) -> list[Pair]:
        eos = np.asarray([] if self.eos is None else [self.eos], dtype=np.int32)
        ends = self._special_ends()
        if ends is None:  # specials that do not simply surround a text: one call, as the tokenizer does it
            encoded = self.tokenizer([ex.text for ex in texts], add_special_tokens=True)["input_ids"]
            runs = [np.asarray(row, dtype=np.int32) for row in encoded]
            return [(ids, ids) for ids in (np.concatenate([row, eos]) for row in runs)]
        head, tail = ends
        pairs: list[Pair] = []
        for run in tokenize(self.tokenizer, [ex.text for ex in texts]):
            ids = np.concatenate([head, run.ids, tail, eos])
            pairs.append((ids, ids))  # _documents copies the labels it changes
        return pairs

    def _special_ends(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The ids ``add_special_tokens=True`` puts before and after one text (a BOS, say), found by
        tokenizing a probe with and without them, so long texts can be tokenized in pieces without them;
        None when the probe's bare tokens are not inside its tokens with specials."""
        if not self._ends_found:
            probe = "Hello world"
            bare = list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
            full = list(self.tokenizer(probe, add_special_tokens=True)["input_ids"])
            at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
            if at is not None:
                head, tail = full[:at], full[at + len(bare) :]
                self._ends = (np.asarray(head, dtype=np.int32), np.asarray(tail, dtype=np.int32))
            self._ends_found = True
        return self._ends

    def _chats(self, examples: list[ChatExample | PromptExample]) -> list[ChatEncoding]:
        if self.chat is None:
            raise UserError(
                f"{examples[0].where}: the tokenizer has no chat template for conversations; pass {option('chat_template')} "
                "(a file, or chatml)"
            )
        conversations = []
        for example in examples:
            if isinstance(example, PromptExample):
                turns = [
                    {"role": "user", "content": example.prompt},
                    {"role": "assistant", "content": example.completion},
                ]
                example = ChatExample(example.where, turns)
            conversations.append(example)
        return self.chat.encode(conversations)

    def _plain_prompts(self, prompts: list[PromptExample]) -> list[Pair]:
        ends = self._special_ends()
        if ends is None:
            heads_ids = self.tokenizer([ex.prompt for ex in prompts], add_special_tokens=True)["input_ids"]
            before, after = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
            head_runs = [np.asarray(row, dtype=np.int32) for row in heads_ids]
        else:
            before, after = ends
            head_runs = [run.ids for run in tokenize(self.tokenizer, [ex.prompt for ex in prompts])]
        eos = np.asarray([] if self.eos is None else [self.eos], dtype=np.int32)
        tails = tokenize(self.tokenizer, [ex.completion for ex in prompts])
        pairs: list[Pair] = []
        for head_ids, tail_run in zip(head_runs, tails, strict=True):
            head = np.concatenate([before, head_ids, after])
            tail = np.concatenate([tail_run.ids, eos])
            ids = np.concatenate([head, tail])
            if self.options.train_on_inputs:
                pairs.append((ids, ids))
            else:
                pairs.append((ids, np.concatenate([np.full(len(head), IGNORE, dtype=np.int32), tail])))
        return pairs

    def _documents(
        self,
        index: int,
        example: Example,
        ids: np.ndarray | list[int],
        labels: np.ndarray | list[int],
        *,
        dropped_reasoning: int = 0,
    ) -> EncodedRecord:
        seq_len = self.options.seq_len
        ids_array = np.asarray(ids, dtype=np.int32)
        labels_array = np.asarray(labels, dtype=np.int32)
        longer = len(ids_array) > seq_len
        truncated_targets = 0
        if isinstance(example, TextExample):
            starts = _split_starts(len(ids_array), seq_len)
            cut = "split" if longer else None
        else:
            starts = range(0, min(len(ids_array), 1))
            cut = "truncated" if longer else None
            truncated_targets = int((labels_array[seq_len:] != IGNORE).sum())
        documents = []
        for start in starts:
            piece_ids = ids_array[start : start + seq_len]
            piece_labels = labels_array[start : start + seq_len].copy()
            if len(piece_labels):
                piece_labels[0] = IGNORE  # see the module docstring: no document predicts another's start
            if (piece_labels != IGNORE).any():
                documents.append(Document(piece_ids, piece_labels))
        return EncodedRecord(index, example.where, documents, cut, dropped_reasoning, len(ids_array), truncated_targets)


def _split_starts(length: int, seq_len: int) -> range:
    """Where each piece of a ``length``-token text starts, pieces ``seq_len`` long: a step of
    ``seq_len - SPLIT_OVERLAP``, so each piece after the first begins with its predecessor's last token,
    and none starts at the last token, so every piece holds a target (one piece for a text that fits a row,
    none for a text of one token, which has no target)."""
    return range(0, length - SPLIT_OVERLAP, seq_len - SPLIT_OVERLAP)
