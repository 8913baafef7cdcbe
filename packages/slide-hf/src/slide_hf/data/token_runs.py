"""Texts to int32 token ids (and each token's character span), in time and memory linear in the text.

A fast tokenizer given one very long text builds, for the whole of it at once, per-character alignment
tables, a string and an offset pair per token, and Python lists of every id; some of its steps also grow
faster than the text. One 50 MB record took minutes and about 10 GB that way. So a text longer than
:data:`LONG_CHARS` is tokenized in pieces of about :data:`PIECE_CHARS` characters, a few pieces per call,
each piece's ids turned into an int32 array at once: memory holds the arrays (4 bytes a token, 8 more with
offsets) and one call's worth of tokenizer state.

Note: [A cut keeps the tokens]. A cut goes just before a space between two non-space characters, where the
byte-level BPE and SentencePiece (Metaspace) pre-tokenizers all begin a new word; failing such a space near
the target, after a newline, then anywhere. Each cut is *checked*, never assumed: the text around it
(:data:`WINDOW_CHARS` on each side) is tokenized whole and as its two halves, and in the middle half of that
window both must give the same ids at the same characters. The check is made twice, from left edges one character
apart: inside a run that tokenizes by its alignment (a long run of ``l`` that BPE pairs from the run's start,
say), a window that starts inside the run pairs from its own edge, so one edge alone may agree with the cut
while the whole text does not; two edges of different parity cannot both agree with it. A cut that fails
is dropped (its pieces become one); a tokenizer that no cut suits (one that prepends a marker to every call, say) tokenizes the text in
one call, as before. Short texts are tokenized together in one call, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LONG_CHARS", "PIECE_CHARS", "WINDOW_CHARS", "TokenRun", "tokenize"]

PIECE_CHARS = 1 << 16
"""Characters per piece of a long text: a piece's tokenizer state is a few megabytes."""
LONG_CHARS = 2 * PIECE_CHARS
"""A text longer than this is tokenized in pieces."""
WINDOW_CHARS = 1 << 10
"""Characters on each side of a cut that the check of the cut tokenizes."""
_PIECES_PER_CALL = 8
_CANDIDATES = 3  # cut positions tried near each target before the pieces are left joined
_CUTS_PER_CALL = 32  # cuts checked per tokenizer call, each from both edges: a few hundred kilobytes of windows
_WINDOW_SHIFTS = (0, 1)  # where each cut's check windows start, relative to WINDOW_CHARS before it (odd apart)


@dataclass(frozen=True)
class TokenRun:
    """One text's token ids (int32) and, when asked for, the character each token starts at and the one
    after its last (int64): a token may start before a span it runs into."""

    ids: np.ndarray
    starts: np.ndarray | None = None
    ends: np.ndarray | None = None


def tokenize(tokenizer: Any, texts: Sequence[str], *, offsets: bool = False) -> list[TokenRun]:
    """The tokens of each text without special tokens, as ``tokenizer(texts, add_special_tokens=False)``
    gives them; a long text in checked pieces (see the module docstring). ``offsets`` asks for each token's
    character span (a fast tokenizer's offset mapping)."""
    runs: list[TokenRun | None] = [None] * len(texts)
    chunked = getattr(tokenizer, "is_fast", False)
    short = [i for i, text in enumerate(texts) if not chunked or len(text) <= LONG_CHARS]
    for i, run in zip(short, _call(tokenizer, [texts[i] for i in short], offsets=offsets), strict=True):
        runs[i] = run
    for i, text in enumerate(texts):
        if runs[i] is None:
            runs[i] = _long(tokenizer, text, offsets=offsets)
    return [run for run in runs if run is not None]


def _call(tokenizer: Any, texts: list[str], *, offsets: bool) -> list[TokenRun]:
    """One tokenizer call over ``texts``, each result converted to arrays before the next."""
    if not texts:
        return []
    out = tokenizer(
        texts,
        add_special_tokens=False,
        return_offsets_mapping=offsets,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    ids = out["input_ids"]
    runs = []
    for row in range(len(texts)):
        starts = ends = None
        if offsets:
            pairs = np.asarray(out["offset_mapping"][row], dtype=np.int64).reshape(-1, 2)
            starts, ends = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
        runs.append(TokenRun(np.asarray(ids[row], dtype=np.int32), starts, ends))
        ids[row] = None  # the row's list is no longer needed: let it go before the next is converted
        if offsets:
            out["offset_mapping"][row] = None
    return runs


def _long(tokenizer: Any, text: str, *, offsets: bool) -> TokenRun:
    cuts = _checked_cuts(tokenizer, text)
    bounds = [0, *cuts, len(text)]
    pieces = list(itertools.pairwise(bounds))
    ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    for first in range(0, len(pieces), _PIECES_PER_CALL):
        group = pieces[first : first + _PIECES_PER_CALL]
        for (begin, _), run in zip(
            group, _call(tokenizer, [text[a:b] for a, b in group], offsets=offsets), strict=True
        ):
            ids.append(run.ids)
            if run.starts is not None and run.ends is not None:
                starts.append(run.starts + begin)
                ends.append(run.ends + begin)
    joined_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
    if not offsets:
        return TokenRun(joined_ids)
    empty = np.zeros(0, dtype=np.int64)
    return TokenRun(joined_ids, np.concatenate(starts) if starts else empty, np.concatenate(ends) if ends else empty)


def _checked_cuts(tokenizer: Any, text: str) -> list[int]:
    """Cut positions about :data:`PIECE_CHARS` apart that pass the check of the module docstring's note."""
    targets = range(PIECE_CHARS, len(text) - PIECE_CHARS // 2, PIECE_CHARS)
    pending = {index: _candidates(text, target) for index, target in enumerate(targets)}
    chosen: list[int] = []
    for attempt in range(_CANDIDATES):
        # One round checks, for every target still without a cut, its next candidate.
        trying = [(index, options[attempt]) for index, options in pending.items() if len(options) > attempt]
        for first in range(0, len(trying), _CUTS_PER_CALL):
            batch = trying[first : first + _CUTS_PER_CALL]
            for (index, cut), holds in zip(batch, _cuts_hold(tokenizer, text, [cut for _, cut in batch]), strict=True):
                if holds:
                    chosen.append(cut)
                    del pending[index]
    return sorted(chosen)


def _candidates(text: str, target: int) -> list[int]:
    """Where to try cutting near ``target`` (earlier first): before a space between non-spaces, after a
    newline, then at ``target`` itself; each far enough from the text's ends for its window."""
    low = max(target - PIECE_CHARS // 2, WINDOW_CHARS)
    high = min(target, len(text) - WINDOW_CHARS)
    found: list[int] = []
    position = high
    while len(found) < _CANDIDATES - 1:
        position = text.rfind(" ", low, position)
        if position <= low:
            break
        if not text[position - 1].isspace() and not text[position + 1].isspace():
            found.append(position)
    newline = text.rfind("\n", low, high)
    if newline > low and newline + 1 < high:
        found.append(newline + 1)
    if low < high:
        found.append(high)
    return found[:_CANDIDATES]


def _cuts_hold(tokenizer: Any, text: str, cuts: list[int]) -> list[bool]:
    """For each cut, whether the windows around it tokenize alike whole and cut, from both left edges (the
    module's note)."""
    lefts = [(cut - WINDOW_CHARS + shift, cut) for cut in cuts for shift in _WINDOW_SHIFTS]
    windows, halves = [], []
    for left, cut in lefts:
        windows.append(text[left : cut + WINDOW_CHARS])
        halves += [text[left:cut], text[cut : cut + WINDOW_CHARS]]
    whole = _call(tokenizer, windows, offsets=True)
    parts = _call(tokenizer, halves, offsets=True)
    agree = []
    for index, (left, cut) in enumerate(lefts):
        one, first, second = whole[index], parts[2 * index], parts[2 * index + 1]
        assert first.starts is not None and second.starts is not None and one.starts is not None  # offsets=True
        ids = np.concatenate([first.ids, second.ids])
        starts = np.concatenate([first.starts, second.starts + (cut - left)])
        agree.append(_middle_equal(one.ids, one.starts, ids, starts))
    shifts = len(_WINDOW_SHIFTS)
    return [all(agree[index : index + shifts]) for index in range(0, len(agree), shifts)]


def _middle_equal(ids_a: np.ndarray, starts_a: np.ndarray, ids_b: np.ndarray, starts_b: np.ndarray) -> bool:
    """Whether the tokens starting in the window's middle half are the same ids at the same characters."""
    low, high = WINDOW_CHARS // 2, WINDOW_CHARS + WINDOW_CHARS // 2
    in_a = (starts_a >= low) & (starts_a < high)
    in_b = (starts_b >= low) & (starts_b < high)
    return bool(
        np.array_equal(ids_a[in_a], ids_b[in_b]) and np.array_equal(starts_a[in_a], starts_b[in_b]) and in_a.any()
    )
