"""How a data source becomes training rows: one frozen, validated options object."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slide_hf.data.readers import DEFAULT_MAX_RECORD_BYTES
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = ["IGNORE", "DataOptions", "SystemMessage"]

IGNORE = -100
"""The label of a token that carries no loss (HF convention; the head shifts labels by one)."""


class SystemMessage(enum.StrEnum):
    """What to do with a system message when the chat template refuses one (Gemma's raises)."""

    FOLD = "fold"  # into the first user turn, "system\n\nuser", as TRL and Axolotl do
    REFUSE = "refuse"  # the conversation is refused in one line naming it


@dataclass(frozen=True)
class DataOptions:
    """Everything that changes the prepared rows, and therefore the cache key.

    ``seq_len``: tokens per row. ``packing``: place several examples in one row (position ids restart at
    each document). ``train_on_inputs``: loss on every token, not only on replies and completions.
    ``chat_template``: a template file or a bundled name (``chatml``, ``qwen2.5``, ``qwen3``) used instead
    of the tokenizer's own. ``max_positions`` and ``vocab_size`` are the model's limits, checked here so a
    bad token id is named by its line instead of failing inside an embedding lookup.
    ``max_record_bytes``: the largest record read (docs/data.md); it refuses input, never changes rows.
    ``keep_reasoning``: train every reply's reasoning, with a template variant that renders it (Qwen3's own
    keeps only the replies' after the last user query). ``system_message``: see :class:`SystemMessage`.
    """

    seq_len: int
    packing: bool = True
    train_on_inputs: bool = False
    chat_template: str | None = None
    max_positions: int | None = None
    vocab_size: int | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    keep_reasoning: bool = False
    system_message: SystemMessage = SystemMessage.FOLD

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise UserError(f"{option('seq_len')} must be an integer of at least 2, got {self.seq_len!r}")
        if self.max_positions is not None and self.seq_len > self.max_positions:
            raise UserError(f"{option('seq_len')} {self.seq_len} exceeds the model's {self.max_positions} positions")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise UserError(f"the model's vocabulary size must be positive, got {self.vocab_size}")
        if (
            isinstance(self.max_record_bytes, bool)
            or not isinstance(self.max_record_bytes, int)
            or self.max_record_bytes < 1
        ):
            raise UserError(f"{option('max_record_size')} must be a positive size, got {self.max_record_bytes!r}")
        if self.system_message not in tuple(SystemMessage):
            choices = ", ".join(SystemMessage)
            raise UserError(f"{option('system_message')} must be one of {choices}, got {self.system_message!r}")
        if self.chat_template is not None and not str(self.chat_template).strip():
            raise UserError(f"{option('chat_template')} must not be empty")
