"""Training data: JSON Lines in, fixed-length (input_ids, labels) examples out, in a seeded order.

Each line is one JSON object with exactly one of:
- ``{"text": ...}``: tokenized, EOS appended, and packed with its neighbours into ``seq_len`` chunks;
- ``{"messages": [...]}``: rendered with the tokenizer's chat template; loss only on assistant tokens;
- ``{"input_ids": [...]}``: used as-is, one sequence each.
Labels follow the HF convention (aligned with ``input_ids``; the head shifts them). Sequences shorter than
``seq_len`` are right-padded with ``-100`` labels, which causal attention makes invisible to real tokens.

The order of examples is a permutation drawn from ``seed + epoch``, so a run resumed at (epoch, index)
sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from slide_hf.errors import UserError

__all__ = ["Batches", "DataPosition", "Dataset", "bundled_text_path", "load_dataset"]

IGNORE = -100

log = logging.getLogger("slide.train")


def bundled_text_path() -> Path:
    return Path(str(resources.files("slide_hf") / "resources" / "tiny_corpus.txt"))


@dataclass
class Dataset:
    input_ids: torch.Tensor  # (N, seq_len) int64
    labels: torch.Tensor  # (N, seq_len) int64
    source: str

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def load_dataset(
    path: Path | None, tokenizer: Any, seq_len: int, max_positions: int | None = None, *, vocab_size: int | None = None
) -> Dataset:
    """Read ``path`` (None: the bundled English text) into fixed-length examples.

    ``vocab_size``, when given, bounds the token ids of ``input_ids`` lines (the model's embedding rows).
    """
    if seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {seq_len}")
    if max_positions is not None and seq_len > max_positions:
        raise UserError(f"--seq-len {seq_len} exceeds the model's {max_positions} positions")
    if path is None:
        text = bundled_text_path().read_text(encoding="utf-8")
        records = [(index + 1, {"text": line}) for index, line in enumerate(text.splitlines()) if line.strip()]
        source = "bundled English text"
    else:
        records = list(_read_jsonl(path))
        source = str(path)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    sequences: list[tuple[list[int], list[int]]] = []
    unlabelled: list[int] = []  # lines whose sequence has no label the head can use (labels[1:])
    stream: list[int] = []
    for line, record in records:
        kind = _kind(record, path, line)
        if kind == "text":
            ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
            stream.extend([*ids, eos] if eos is not None else ids)
        elif kind == "messages":
            ids, labels = _chat(record["messages"], tokenizer, seq_len, path, line)
            if all(label == IGNORE for label in labels[1:]):
                unlabelled.append(line)
            else:
                sequences.append((ids, labels))
        else:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise UserError(f"{path}:{line}: input_ids must be a list of non-negative integers")
            if len(ids) > seq_len:
                raise UserError(f"{path}:{line}: {len(ids)} input_ids exceed --seq-len {seq_len}")
            if vocab_size is not None and ids and max(ids) >= vocab_size:
                raise UserError(f"{path}:{line}: token id {max(ids)} is outside the model's vocabulary of {vocab_size}")
            if len(ids) < 2:
                unlabelled.append(line)
            else:
                sequences.append((ids, list(ids)))
    if unlabelled:
        log.warning(
            "%s: skipped %d sequence(s) with no label token within --seq-len %d (line %s)",
            source,
            len(unlabelled),
            seq_len,
            ", ".join(map(str, unlabelled[:5])) + (", ..." if len(unlabelled) > 5 else ""),
        )
    for start in range(0, len(stream) - seq_len + 1, seq_len):
        chunk = stream[start : start + seq_len]
        sequences.append((chunk, list(chunk)))
    if not sequences:
        raise UserError(f"{source} holds no complete sequence of --seq-len {seq_len} tokens")
    input_ids = torch.full((len(sequences), seq_len), pad, dtype=torch.int64)
    labels = torch.full((len(sequences), seq_len), IGNORE, dtype=torch.int64)
    for row, (ids, lab) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        labels[row, : len(lab)] = torch.tensor(lab, dtype=torch.int64)
    return Dataset(input_ids, labels, source)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise UserError(f"data file {path} does not exist")
    with path.open(encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def _kind(record: dict[str, Any], path: Path | None, line: int) -> str:
    kinds = [key for key in ("text", "messages", "input_ids") if key in record]
    if len(kinds) != 1:
        raise UserError(f"{path}:{line}: expected exactly one of 'text', 'messages' or 'input_ids'")
    if kinds[0] == "text" and not isinstance(record["text"], str):
        raise UserError(f"{path}:{line}: 'text' must be a string")
    return kinds[0]


def _chat(messages: Any, tokenizer: Any, seq_len: int, path: Path | None, line: int) -> tuple[list[int], list[int]]:
    """Tokens of a conversation, with labels only on the assistant's turns.

    The assistant span of turn i is what rendering ``messages[: i + 1]`` adds beyond rendering
    ``messages[:i]`` with a generation prompt; that works with any chat template, including those
    without ``{% generation %}`` markers.
    """
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{path}:{line}: 'messages' must be a non-empty list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{path}:{line}: the tokenizer has no chat template for 'messages' data")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f"{path}:{line}: every message needs 'role' and 'content'")

    def render(upto: list[dict[str, Any]], prompt: bool) -> list[int]:
        if not upto:
            return []
        ids = tokenizer.apply_chat_template(upto, tokenize=True, add_generation_prompt=prompt)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    full = render(messages, False)
    labels = [IGNORE] * len(full)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(messages[:index], True))
        end = len(render(messages[: index + 1], False))
        labels[start:end] = full[start:end]
    return full[:seq_len], labels[:seq_len]


@dataclass
class DataPosition:
    """Where the next step's examples start: the epoch and the index into that epoch's order."""

    epoch: int = 0
    index: int = 0


class Batches:
    """Micro-batches for each optimizer step: ``grad_accum`` micro-batches of ``batch_size`` examples."""

    def __init__(self, dataset: Dataset, batch_size: int, grad_accum: int, *, shuffle: bool, seed: int) -> None:
        if batch_size < 1:
            raise UserError(f"--batch-size must be positive, got {batch_size}")
        if grad_accum < 1:
            raise UserError(f"--grad-accum must be positive, got {grad_accum}")
        per_step = batch_size * grad_accum
        if len(dataset) < per_step:
            raise UserError(
                f"{dataset.source} yields {len(dataset)} sequences; one step needs {per_step} "
                f"(--batch-size {batch_size} x --grad-accum {grad_accum})"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.shuffle = shuffle
        self.seed = seed
        self.position = DataPosition()
        self.steps_per_epoch = len(dataset) // per_step

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches; a partial tail of an epoch is skipped."""
        per_step = self.batch_size * self.grad_accum
        if self.position.index + per_step > len(self.dataset):
            self.position = DataPosition(self.position.epoch + 1, 0)
        order = self._order(self.position.epoch)[self.position.index : self.position.index + per_step]
        self.position = DataPosition(self.position.epoch, self.position.index + per_step)
        micro = []
        for chunk in order.split(self.batch_size):
            micro.append((self.dataset.input_ids[chunk], self.dataset.labels[chunk]))
        return micro
