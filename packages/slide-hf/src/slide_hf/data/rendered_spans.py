"""Where each assistant message sits in a conversation's final render, as character spans.

A template that renders an earlier turn differently once later turns exist (Qwen3 drops the reasoning of
every reply before the last user query) defeats masking by prefix renders, but the final render, the
text a run trains on, still holds every reply the template kept. This module finds them in that text:

- a reply opens with the template's *generation prompt*: what rendering ``messages[:i]`` with
  ``add_generation_prompt`` adds to rendering it without (``<|im_start|>assistant\\n`` for ChatML), as far
  as the template also renders it before the reply;
- it closes with the *end of turn*: the last special token of the reply as the template renders it when
  it is the last message, with the text after it there (``<|im_end|>`` and ``\\n``);
- assistant message ``i`` is the text after the next opening (from where the previous reply closed)
  through the next closing, and that text must hold what the message says: its answer (the content
  without inline reasoning, whitespace trimmed) and the name of every tool it calls. Otherwise the
  template lost the message, and the conversation is refused naming it.

The span runs from the first character the model would generate after the opening through the end of
turn, as the bundled marked twins mark it. Reasoning the template leaves out of the render is not in any
span, so it is never trained; :func:`dropped_reasoning` counts such replies so the user is told.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slide_hf.data.options import IGNORE

__all__ = [
    "ReplyNotFound",
    "TurnMarkers",
    "answer_of",
    "dropped_reasoning",
    "label_array",
    "labels_in_spans",
    "locate_replies",
    "reasoning_of",
    "turn_markers",
]

Span = tuple[int, int]  # [start, end) character offsets into the rendered conversation


@dataclass(frozen=True)
class TurnMarkers:
    """How the template opens and closes one reply (see the module docstring)."""

    opening: str
    closing: str
    trailing: str  # what follows ``closing`` when the reply ends the conversation ("\n" for ChatML)


class ReplyNotFound(Exception):
    """Assistant message ``index`` (0-based, into the conversation's messages) is not in the render."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


def turn_markers(
    before: str | None, before_with_prompt: str | None, through: str | None, special_tokens: Sequence[str]
) -> TurnMarkers | None:
    """The markers of one reply from three renders: the messages before it without and with the generation
    prompt, and the messages through it. The opening is the part of the generation prompt the template
    also renders before the reply: all of it for ChatML; for a prompt that prefills reasoning
    (``<｜Assistant｜><think>\\n``) which the rendered reply lacks, the role header before it. None when the
    renders do not show the markers (a render failed, the earlier turns render differently, no generation
    prompt, or the reply ends with no special token)."""
    if before is None or before_with_prompt is None or through is None:
        return None
    if not before_with_prompt.startswith(before) or not through.startswith(before):
        return None
    prompt, reply = before_with_prompt[len(before) :], through[len(before) :]
    shared = next(
        (i for i, (a, b) in enumerate(zip(prompt, reply, strict=False)) if a != b), min(len(prompt), len(reply))
    )
    opening = prompt[:shared]
    if not opening:
        return None
    reply = reply[len(opening) :]
    position, closing = max(((reply.rfind(token), token) for token in special_tokens if token), default=(-1, ""))
    if position < 0:
        return None
    return TurnMarkers(opening, closing, reply[position + len(closing) :])


def answer_of(message: dict[str, Any]) -> str:
    """What a reply says outside its reasoning, trimmed: templates strip and split content around it."""
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    return text.strip()


def reasoning_of(message: dict[str, Any]) -> str:
    """A reply's reasoning, trimmed: ``reasoning_content``, else a ``<think>...</think>`` block in content."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning.strip()
    content = message.get("content")
    if isinstance(content, str) and "</think>" in content:
        return content.split("</think>", 1)[0].split("<think>")[-1].strip()
    return ""


def _tool_names(message: dict[str, Any]) -> list[str]:
    names = []
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            function = call.get("function")
            if not isinstance(function, dict):
                function = call
            name = function.get("name")
            if isinstance(name, str) and name:
                names.append(name)
    return names


def locate_replies(rendered: str, messages: Sequence[dict[str, Any]], markers: dict[int, TurnMarkers]) -> list[Span]:
    """The span of every assistant message of ``messages`` in ``rendered``, in order; ``markers`` holds the
    markers of each assistant message by its index. Raises :class:`ReplyNotFound` naming the first
    message that is not there."""
    spans: list[Span] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        marks = markers.get(index)
        if marks is None:
            raise ReplyNotFound(index, "the template shows no generation prompt or end of turn for it")
        opening = rendered.find(marks.opening, cursor)
        if opening < 0:
            raise ReplyNotFound(index, f"no {marks.opening!r} opens it")
        start = opening + len(marks.opening)
        close = rendered.find(marks.closing, start)
        if close < 0:
            raise ReplyNotFound(index, f"no {marks.closing!r} closes it")
        body = rendered[start:close]
        answer = answer_of(message)
        if answer and answer not in body:
            raise ReplyNotFound(index, "its content is not in the reply found there")
        missing = [name for name in _tool_names(message) if name not in body]
        if missing:
            raise ReplyNotFound(index, f"its call of {missing[0]!r} is not in the reply found there")
        end = close + len(marks.closing)
        if marks.trailing and rendered.startswith(marks.trailing, end):
            end += len(marks.trailing)
        spans.append((start, end))
        cursor = end
    return spans


def dropped_reasoning(rendered: str, messages: Sequence[dict[str, Any]]) -> int:
    """How many assistant messages carry reasoning that the template left out of ``rendered``."""
    count = 0
    for message in messages:
        if message.get("role") == "assistant":
            reasoning = reasoning_of(message)
            if reasoning and reasoning not in rendered:
                count += 1
    return count


def labels_in_spans(ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[int]:
    """Each token's label: itself when the token overlaps a span, else ``IGNORE``. ``offsets`` are the fast
    tokenizer's character offsets of the rendered text the spans index. Overlap, not a start inside, is what
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` trains: a byte-level token such as
    `` Hello`` begins at the space before a ``{% generation %}`` block and is still the reply's first token."""
    pairs = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return label_array(np.asarray(ids, dtype=np.int32), pairs[:, 0], pairs[:, 1], spans).tolist()


def label_array(ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """:func:`labels_in_spans` on arrays (``starts`` and ``ends``: each token's characters, ``[start, end)``),
    in one pass of searches: a conversation of millions of tokens costs arrays, not a Python loop over them.
    Spans may overlap or nest."""
    labels = np.full(len(ids), IGNORE, dtype=np.int32)
    spans = sorted(span for span in spans if span[0] < span[1])
    if not spans or not len(ids):
        return labels
    lows = np.asarray([low for low, _ in spans], dtype=np.int64)
    reach = np.maximum.accumulate(np.asarray([high for _, high in spans], dtype=np.int64))
    # A token overlaps a span when some span opening before the token's end closes after its start: of the
    # spans opening before its end, the furthest end. An empty token counts as its first character.
    which = np.searchsorted(lows, np.maximum(ends, starts + 1), side="left") - 1
    inside = (which >= 0) & (starts < reach[np.maximum(which, 0)])
    labels[inside] = ids[inside]
    return labels
