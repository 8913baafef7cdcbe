"""Conversations to token ids with loss exactly on the assistant's turns, or refused in one line.

Three ways to find the assistant's tokens, tried in this order:

1. **Generation markers.** A template with ``{% generation %}`` blocks says itself which text the assistant
   wrote: each conversation is rendered once, with those blocks as character spans of the text, and every
   token overlapping a block is trained, through the fast tokenizer's character offsets (the tokens
   ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks, without one call over the whole
   text: a long conversation is tokenized in pieces, :mod:`slide_hf.data.token_runs`).
2. **Verified prefix renders.** The tokens of assistant turn ``i`` are what rendering ``messages[: i + 1]``
   adds to rendering ``messages[:i]`` with the generation prompt. That holds only if each prefix render is a
   true prefix of the full render, as text *and* as tokens, so both are checked for every turn of every
   conversation. Qwen3's template breaks it: an earlier reply loses its reasoning once a later user turn
   exists, and the last reply alone gains an empty think block, so a naive prefix mask trains on the
   wrong tokens (the user's included). When a check fails, a known template switches to its bundled
   marked twin (:mod:`slide_hf.data.templates`).
3. **The final render.** Any other template that breaks the check is masked from the whole conversation
   rendered once: each assistant message's span is found in that text (:mod:`slide_hf.data.rendered_spans`)
   and mapped to tokens through the fast tokenizer's character offsets. A conversation is refused, naming
   the message, only when the template lost an assistant message from the render.

Reasoning a template drops (Qwen3: every reply's before the last user query) is in no render, so it is
never trained; each conversation's count of such replies travels with its tokens so ``slide data`` and the
training log can say so. ``--keep-reasoning`` swaps in a bundled variant of the template that renders every
reply's reasoning, and refuses a conversation whose template still drops some. With ``train_on_inputs`` every
rendered token carries loss and no mask is needed.

A template that raises on a system message but renders the conversation without one (Gemma's) gets the
leading system messages folded into the first user turn, a blank line between, as TRL and Axolotl do;
``--system-message refuse`` keeps the template's refusal instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slide_hf.data.options import IGNORE, SystemMessage
from slide_hf.data.readers import first_line
from slide_hf.data.rendered_spans import (
    ReplyNotFound,
    TurnMarkers,
    dropped_reasoning,
    label_array,
    locate_replies,
    turn_markers,
)
from slide_hf.data.schemas import ChatExample
from slide_hf.data.templates import BUNDLED_TEMPLATES, ChatTemplate, keeping_reasoning
from slide_hf.data.token_runs import TokenRun, tokenize
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = ["ChatEncoder", "ChatEncoding"]

log = logging.getLogger("slide.data")

Encoded = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True, eq=False)
class ChatEncoding:
    """One conversation's token ids and labels (int32 arrays), and how many of its assistant messages carry
    reasoning the template left out of the render (untrained, and reported)."""

    input_ids: np.ndarray
    labels: np.ndarray
    dropped_reasoning: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChatEncoding):
            return NotImplemented
        return (
            np.array_equal(self.input_ids, other.input_ids)
            and np.array_equal(self.labels, other.labels)
            and self.dropped_reasoning == other.dropped_reasoning
        )

    __hash__ = None  # type: ignore[assignment]


class _PrefixBroken(Exception):
    """A prefix render that is not a prefix of the full render (``reason`` says how)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason)
        self.where = where
        self.reason = reason


class ChatEncoder:
    """Token ids and labels for batches of conversations under one chat template.

    The encoder may switch, once, from the prefix method to the template's marked twin, or to the final
    render when it has none, at the first conversation that defeats the prefix method; conversations
    encoded before the switch were verified, and the other methods mark the same text for them (the tests
    hold the methods equal wherever both apply).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate,
        *,
        train_on_inputs: bool,
        keep_reasoning: bool = False,
        system_message: SystemMessage = SystemMessage.FOLD,
    ) -> None:
        self.tokenizer = tokenizer
        self.keep_reasoning = keep_reasoning
        if keep_reasoning:
            variant = keeping_reasoning(template)
            if variant is not None:
                log.info(
                    "keeping every reply's reasoning: %s instead of %s",
                    variant.name,
                    template.name,
                    extra={"once": ("keep reasoning", template.name)},
                )
                template = variant
        self.template = template
        self.train_on_inputs = train_on_inputs
        self.system_message = system_message
        self.final_render = False  # set once the prefix method failed on a template with no twin
        self._refuses_system: bool | None = None  # probed at the first conversation with a system message

    def encode(self, batch: Sequence[ChatExample]) -> list[ChatEncoding]:
        if not batch:
            return []
        folds = self.system_message == SystemMessage.FOLD
        if folds and any(_opens_with_system(ex.messages) for ex in batch) and self._template_refuses_system():
            batch = [ChatExample(ex.where, _fold_system(ex.messages)) for ex in batch]
        conversations = [example.messages for example in batch]
        blocks = None  # a marked template's generation spans, from the one render it makes
        if self.template.marked and not self.train_on_inputs:
            texts, blocks = self._render_marked(batch)
        else:
            texts = self._render(batch, conversations, generation_prompt=False)
        dropped = [dropped_reasoning(text, messages) for text, messages in zip(texts, conversations, strict=True)]
        if self.keep_reasoning:
            self._check_reasoning_kept(batch, dropped)
        if self.train_on_inputs:
            pairs: list[Encoded] = [(run.ids, run.ids) for run in tokenize(self.tokenizer, texts)]
        elif blocks is not None:
            pairs = self._marked(texts, blocks)
        elif self.final_render:
            pairs = self._final_render(batch, texts)
        else:
            pairs = self._prefix_or_fallback(batch, texts)
        return [ChatEncoding(ids, labels, count) for (ids, labels), count in zip(pairs, dropped, strict=True)]

    def _template_refuses_system(self) -> bool:
        """Whether the template raises on a system message but renders the same conversation without it
        (Gemma's); said once, as the fold it causes."""
        if self._refuses_system is None:
            user = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
            refuses = (
                self._try_one([{"role": "system", "content": "Be brief."}, *user], False) is None
                and self._try_one(user, False) is not None
            )
            if refuses:
                log.info(
                    "%s refuses a system message: each is folded into its conversation's first user turn "
                    "(%s refuse to refuse such conversations instead)",
                    self.template.name,
                    option("system_message"),
                    extra={"once": ("fold", self.template.name)},
                )
            self._refuses_system = refuses
        return self._refuses_system

    def _check_reasoning_kept(self, batch: Sequence[ChatExample], dropped: list[int]) -> None:
        for example, count in zip(batch, dropped, strict=True):
            if count:
                raise UserError(
                    f"{example.where}: {option('keep_reasoning')}: {self.template.name} leaves out the reasoning "
                    f"of earlier replies and no variant that keeps it is bundled for it; pass {option('chat_template')} "
                    "FILE with a template that renders every reply's reasoning"
                )

    def _prefix_or_fallback(self, batch: Sequence[ChatExample], texts: list[str]) -> list[Encoded]:
        """Prefix renders; where they break, the known template's twin, else the final render (from then on)."""
        try:
            return self._prefix(batch, texts)
        except _PrefixBroken as broken:
            twin = self.template.twin
            if twin is None:
                log.info(
                    "%s %s (%s); masking each assistant message where it appears in the whole rendered "
                    "conversation instead",
                    self.template.name,
                    broken.reason,
                    broken.where,
                    extra={"once": ("final render", self.template.name)},
                )
                self.final_render = True
                return self._final_render(batch, texts)
            log.info(
                "%s %s (%s); using %s, which renders the same text and marks the assistant's turns",
                self.template.name,
                broken.reason,
                broken.where,
                twin.name,
                extra={"once": ("twin", self.template.name)},
            )
            self.template = twin
            return self._marked(*self._render_marked(batch))

    # ---- generation markers -------------------------------------------------------------------------------

    def _render_marked(self, batch: Sequence[ChatExample]) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """Each conversation's render (the text ``apply_chat_template`` gives) and its ``{% generation %}``
        blocks as character spans of it, from one render."""
        if not getattr(self.tokenizer, "is_fast", False):
            raise UserError(f"{self.template.name} marks turns with {{% generation %}}, which needs a fast tokenizer")
        from transformers.utils.chat_template_utils import render_jinja_template

        conversations = [example.messages for example in batch]
        try:
            rendered: Any = render_jinja_template(  # (texts, generation spans per text); annotated as str
                conversations=conversations,
                chat_template=self.template.text,
                return_assistant_tokens_mask=True,
                **self.tokenizer.special_tokens_map,
            )
            texts: list[str] = rendered[0]
            blocks: list[list[tuple[int, int]]] = rendered[1]
        except Exception:
            self._name_failure(batch, generation_prompt=False)
            raise
        return texts, blocks

    def _marked(self, texts: list[str], blocks: list[list[tuple[int, int]]]) -> list[Encoded]:
        """The blocks mapped to tokens by their offsets: a token is trained when it overlaps a block, as
        ``apply_chat_template(..., return_assistant_tokens_mask=True)`` trains it (and as for the final
        render)."""
        runs = tokenize(self.tokenizer, texts, offsets=True)
        return [(run.ids, _labels(run, spans)) for run, spans in zip(runs, blocks, strict=True)]

    # ---- verified prefix renders ----------------------------------------------------------------------------

    def _prefix(self, batch: Sequence[ChatExample], fulls: list[str]) -> list[Encoded]:
        # Per conversation and assistant turn i: the render of messages[:i] with the generation prompt (where
        # the turn starts) and of messages[: i + 1] (where it ends).
        turns = _assistant_turns(batch)
        starts = self._render_parts(batch, turns, lambda messages, index: messages[:index], generation_prompt=True)
        ends = self._render_parts(batch, turns, lambda messages, index: messages[: index + 1], generation_prompt=False)
        texts = list(fulls)
        for example, full, indices, start_texts, end_texts in zip(batch, fulls, turns, starts, ends, strict=True):
            for index, start, end in zip(indices, start_texts, end_texts, strict=True):
                if start is None or end is None:
                    raise _PrefixBroken(example.where, f"cannot render turn {index + 1} without the turns after it")
                if not (full.startswith(end) and end.startswith(start)):
                    raise _PrefixBroken(
                        example.where,
                        f"re-renders earlier turns (turn {index + 1} differs between the prefix and the full "
                        "conversation)",
                    )
                texts.extend((start, end))
        ids = self._token_ids(texts)
        encoded = []
        cursor = len(batch)
        for row, (example, indices) in enumerate(zip(batch, turns, strict=True)):
            full_ids = ids[row]
            labels = np.full(len(full_ids), IGNORE, dtype=np.int32)
            for index in indices:
                start_ids, end_ids = ids[cursor], ids[cursor + 1]
                cursor += 2
                if not (
                    np.array_equal(full_ids[: len(end_ids)], end_ids)
                    and np.array_equal(end_ids[: len(start_ids)], start_ids)
                ):
                    raise _PrefixBroken(
                        example.where,
                        f"renders turn {index + 1} to text whose tokens differ from the same text inside the full "
                        "conversation (the tokenizer merges across the turn boundary)",
                    )
                labels[len(start_ids) : len(end_ids)] = full_ids[len(start_ids) : len(end_ids)]
            encoded.append((full_ids, labels))
        return encoded

    def _token_ids(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, tokenizing each distinct text once: the render through the last reply is most
        often the whole conversation, which for a long one is most of the work."""
        distinct: dict[str, int] = {}
        for text in texts:
            distinct.setdefault(text, len(distinct))
        runs = tokenize(self.tokenizer, list(distinct))
        return [runs[distinct[text]].ids for text in texts]

    def _render_parts(
        self, batch: Sequence[ChatExample], turns: list[list[int]], cut: Any, *, generation_prompt: bool
    ) -> list[list[str | None]]:
        """Renders of ``cut(messages, i)`` for every assistant turn; None where the template refuses a part."""
        jobs = [(row, cut(example.messages, index)) for row, example in enumerate(batch) for index in turns[row]]
        rendered: list[str | None]
        nonempty = [messages for _, messages in jobs if messages]
        try:
            texts = iter(self._apply(nonempty, generation_prompt) if nonempty else [])
            rendered = [next(texts) if messages else self._render_empty(generation_prompt) for _, messages in jobs]
        except Exception:
            rendered = [self._try_one(messages, generation_prompt) for _, messages in jobs]
        out: list[list[str | None]] = [[] for _ in batch]
        for (row, _), text in zip(jobs, rendered, strict=True):
            out[row].append(text)
        return out

    def _render_empty(self, generation_prompt: bool) -> str | None:
        return self._try_one([], generation_prompt)

    def _try_one(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str | None:
        try:
            return self._apply([messages], generation_prompt)[0]
        except Exception:  # any failure of a part render makes that turn unverifiable, named by the caller
            return None

    # ---- the final render -----------------------------------------------------------------------------------

    def _final_render(self, batch: Sequence[ChatExample], fulls: list[str]) -> list[Encoded]:
        if not getattr(self.tokenizer, "is_fast", False):
            raise UserError(
                f"{self.template.name} renders earlier turns differently once later ones exist; masking it from "
                "the final render needs a fast tokenizer (character offsets)"
            )
        turns = _assistant_turns(batch)
        befores = self._render_parts(batch, turns, lambda messages, index: messages[:index], generation_prompt=False)
        prompts = self._render_parts(batch, turns, lambda messages, index: messages[:index], generation_prompt=True)
        throughs = self._render_parts(
            batch, turns, lambda messages, index: messages[: index + 1], generation_prompt=False
        )
        specials = [str(token) for token in self.tokenizer.all_special_tokens]
        runs = tokenize(self.tokenizer, list(fulls), offsets=True)
        encoded = []
        for row, example in enumerate(batch):
            markers: dict[int, TurnMarkers | None] = {
                index: turn_markers(before, prompt, through, specials)
                for index, before, prompt, through in zip(
                    turns[row], befores[row], prompts[row], throughs[row], strict=True
                )
            }
            # A reply whose own renders show no markers (the template cannot render the turns before it
            # alone, say) takes another reply's: one template opens and closes its replies alike.
            known = next((marks for marks in markers.values() if marks is not None), None)
            filled = {index: found for index, marks in markers.items() if (found := marks or known) is not None}
            try:
                spans = locate_replies(fulls[row], example.messages, filled)
            except ReplyNotFound as missing:
                names = ", ".join(BUNDLED_TEMPLATES)
                raise UserError(
                    f"{example.where}: message {missing.index + 1} (assistant) does not appear in the rendered "
                    f"conversation ({missing.reason}); {self.template.name} loses it: pass {option('chat_template')} FILE "
                    f"with {{% generation %}} markers, or a bundled one ({names})"
                ) from None
            run = runs[row]
            encoded.append((run.ids, _labels(run, spans)))
        return encoded

    # ---- rendering -----------------------------------------------------------------------------------------

    def _apply(self, conversations: list[list[dict[str, Any]]], generation_prompt: bool) -> list[str]:
        return self.tokenizer.apply_chat_template(
            conversations, chat_template=self.template.text, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _render(
        self, batch: Sequence[ChatExample], conversations: list[list[dict[str, Any]]], *, generation_prompt: bool
    ) -> list[str]:
        try:
            return self._apply(conversations, generation_prompt)
        except Exception:
            self._name_failure(batch, generation_prompt=generation_prompt)
            raise

    def _name_failure(self, batch: Sequence[ChatExample], *, generation_prompt: bool) -> None:
        """Render one by one to name the conversation a batch failed on, as a one-line UserError."""
        for example in batch:
            try:
                self._apply([example.messages], generation_prompt)
            except Exception as error:  # raise_exception, undefined fields, type errors in the template
                raise UserError(
                    f"{example.where}: {self.template.name} refused this conversation: {first_line(error)}"
                ) from None


def _opens_with_system(messages: Sequence[dict[str, Any]]) -> bool:
    return bool(messages) and messages[0].get("role") == "system"


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading system messages joined in front of the first user turn, a blank line between (what
    TRL, Axolotl and Gemma 3's own template do); unchanged when no user turn follows them."""
    count = next((i for i, message in enumerate(messages) if message.get("role") != "system"), len(messages))
    if count == len(messages) or messages[count].get("role") != "user":
        return messages
    system = "\n\n".join(str(message.get("content") or "") for message in messages[:count])
    user = dict(messages[count])
    user["content"] = f"{system}\n\n{user.get('content') or ''}" if system else user.get("content")
    return [user, *messages[count + 1 :]]


def _labels(run: TokenRun, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    assert run.starts is not None and run.ends is not None  # tokenized with offsets
    return label_array(run.ids, run.starts, run.ends, spans)


def _assistant_turns(batch: Sequence[ChatExample]) -> list[list[int]]:
    """Per conversation, the indices of its assistant messages."""
    return [[index for index, message in enumerate(ex.messages) if message["role"] == "assistant"] for ex in batch]
