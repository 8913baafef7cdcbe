"""Which chat template renders conversations, and whether it marks the assistant's tokens itself.

The template is the ``chat_template`` option (a file, or a bundled name) or else the tokenizer's own.
A template with ``{% generation %}`` markers names the assistant's text exactly; one without them is
masked by prefix renders (see :mod:`slide_hf.data.chat`), which some templates defeat by rendering an
earlier turn differently once later turns exist (Qwen3 drops earlier reasoning, and adds an empty
think block only to the last reply). For such templates that we know, a generation-marked *twin* is
bundled under ``resources/chat_templates``: the same template with markers added, rendering byte for
byte the same text (the tests render many conversations through both to hold that). Known templates
are recognised by the SHA-256 of their exact text, so an edited copy is never mistaken for one; an
unknown template that defeats the prefix method is masked from its final render instead.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from slide_hf import spelling
from slide_hf.errors import UserError

__all__ = [
    "BUNDLED_TEMPLATES",
    "ChatTemplate",
    "bundled_template_text",
    "has_generation_markers",
    "keeping_reasoning",
    "resolve_template",
]

BUNDLED_TEMPLATES = ("chatml", "qwen2.5", "qwen3")
"""``chatml``: plain ChatML with no default system prompt; ``qwen2.5`` and ``qwen3``: twins of Qwen's own."""

_TWINS = {
    # Qwen2.5 Instruct (ChatML, a default system prompt, tool calls)
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "qwen2.5",
    # Qwen3 (hybrid thinking: reasoning kept only after the last user query)
    "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": "qwen3",
}
_KEEPS_REASONING = {"qwen3": "qwen3-keep-reasoning"}
"""Bundled variants that keep every reply's reasoning, for templates that drop it before the last query."""
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(text: str) -> bool:
    return bool(_GENERATION.search(text))


def bundled_template_text(name: str) -> str:
    return (resources.files("slide_hf") / "resources" / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def template_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ChatTemplate:
    """A template's text, how messages name it, and its bundled marked twin when it is a known one."""

    text: str
    name: str
    twin: ChatTemplate | None = None
    bundled: str | None = None  # the bundled name of this template, or of its twin

    @property
    def marked(self) -> bool:
        return has_generation_markers(self.text)


def resolve_template(tokenizer: Any, option: str | None) -> ChatTemplate | None:
    """The template conversations render with: ``option`` (a file or a bundled name) or the tokenizer's."""
    if option is not None:
        if option in BUNDLED_TEMPLATES:
            return ChatTemplate(bundled_template_text(option), f"the bundled chat template {option!r}", bundled=option)
        path = Path(option).expanduser()
        if not path.is_file():
            raise UserError(
                f"{spelling.option('chat_template')} {option}: not a file, nor a bundled template "
                f"({', '.join(BUNDLED_TEMPLATES)})"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{spelling.option('chat_template')} {path}: not UTF-8 text") from None
        return _with_twin(text, f"the chat template {path}")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # a tokenizer with named templates: the one apply_chat_template uses
        own = own.get("default")
    if not own:
        return None
    owner = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return _with_twin(str(own), f"the chat template of {owner}")


def _with_twin(text: str, name: str) -> ChatTemplate:
    twin_name = _TWINS.get(template_digest(text))
    twin = None
    if twin_name is not None:
        twin = ChatTemplate(
            bundled_template_text(twin_name), f"the bundled chat template {twin_name!r}", bundled=twin_name
        )
    return ChatTemplate(text, name, twin, bundled=twin_name)


def keeping_reasoning(template: ChatTemplate) -> ChatTemplate | None:
    """The bundled variant of ``template`` that renders every reply's reasoning, as TRL's and Axolotl's
    training templates for Qwen3 do (its own keeps only the replies' after the last user query); None when
    none is bundled for it."""
    variant = _KEEPS_REASONING.get(template.bundled or "")
    if variant is None:
        return None
    return ChatTemplate(bundled_template_text(variant), f"the bundled chat template {variant!r}", bundled=variant)
