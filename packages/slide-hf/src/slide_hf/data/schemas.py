"""Which kind of example a record is, decided by its keys, and the checks that make it safe to tokenize.

Kinds (exactly one per record; other keys, such as an ``id`` column, are ignored):

====================================  ============================================================
keys                                  becomes
====================================  ============================================================
``text``                              :class:`TextExample` (EOS appended; loss on every token)
``messages`` (role/content)           :class:`ChatExample`; roles are system, user, assistant and
                                      tool; content may be a string or a list of OpenAI text parts
                                      ``{"type": "text", "text": ...}``, joined
``conversations`` (ShareGPT from/value)  :class:`ChatExample`; human/gpt/system/tool become roles
``input_ids`` (+ optional ``labels``)    :class:`TokenExample`, used as given
``prompt`` + ``completion``           :class:`PromptExample` (loss on the completion)
``instruction`` + ``output`` (+ ``input``)  :class:`PromptExample` (Alpaca; loss on the output)
====================================  ============================================================

A key whose value is null counts as absent, so a Parquet table mixing kinds (null where a row has no such
column value) works. Every error names the record (``file:line`` or ``file row N``) and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slide_hf.data.options import IGNORE
from slide_hf.data.readers import Record
from slide_hf.errors import UserError

__all__ = ["CHAT_ROLES", "ChatExample", "Example", "PromptExample", "TextExample", "TokenExample", "parse_record"]

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a ``messages`` record may use: what chat templates render. Any other (``bot``, ``gpt``) would
render as nothing, or as text no reply is found in, and the record would silently train on nothing."""
_KINDS = (
    ("messages",),
    ("conversations",),
    ("input_ids",),
    ("prompt", "completion"),
    ("instruction", "output"),
    ("text",),
)
_KIND_NAMES = "text, messages, conversations (ShareGPT), input_ids, prompt+completion, instruction+output (Alpaca)"


@dataclass(frozen=True)
class TextExample:
    where: str
    text: str


@dataclass(frozen=True)
class ChatExample:
    where: str
    messages: list[dict[str, Any]]  # role and content strings, plus keys a template may read


@dataclass(frozen=True)
class TokenExample:
    where: str
    input_ids: list[int]
    labels: list[int] | None


@dataclass(frozen=True)
class PromptExample:
    where: str
    prompt: str
    completion: str


Example = TextExample | ChatExample | TokenExample | PromptExample


def parse_record(record: Record, *, vocab_size: int | None = None) -> Example:
    """The example ``record`` holds; one :class:`UserError` line naming the record and field otherwise."""
    where, fields = record.where, record.fields
    present = {key for key, value in fields.items() if value is not None}
    matches = [kind for kind in _KINDS if all(key in present for key in kind)]
    if not matches:
        nulls = sorted(key for kind in _KINDS for key in kind if key in fields and fields[key] is None)
        if nulls:
            raise UserError(f"{where}: '{nulls[0]}' is null")
        keys = ", ".join(sorted(map(str, fields))) or "none"
        raise UserError(f"{where}: expected one of {_KIND_NAMES}; found keys: {keys}")
    if len(matches) > 1:
        names = " and ".join("+".join(kind) for kind in matches)
        raise UserError(f"{where}: holds both {names}; keep one kind of example per record")
    kind = matches[0]
    if kind == ("text",):
        return TextExample(where, _string(fields, "text", where))
    if kind == ("messages",):
        return ChatExample(where, _messages(fields["messages"], where))
    if kind == ("conversations",):
        return ChatExample(where, _sharegpt(fields["conversations"], where))
    if kind == ("input_ids",):
        return _tokens(fields, where, vocab_size)
    if kind == ("prompt", "completion"):
        return PromptExample(where, _string(fields, "prompt", where), _string(fields, "completion", where))
    instruction = _string(fields, "instruction", where)
    extra = fields.get("input")
    if extra is not None and not isinstance(extra, str):
        raise UserError(f"{where}: 'input' must be a string, got {_type(extra)}")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return PromptExample(where, prompt, _string(fields, "output", where))


def _string(fields: dict[str, Any], key: str, where: str) -> str:
    value = fields[key]
    if not isinstance(value, str):
        raise UserError(f"{where}: '{key}' must be a string, got {_type(value)}")
    return value


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: 'messages' must be a non-empty list, got {_type(value)}")
    messages = []
    for index, message in enumerate(value):
        field = f"messages[{index}]"
        if not isinstance(message, dict):
            raise UserError(f"{where}: {field} must be an object with 'role' and 'content', got {_type(message)}")
        if "role" not in message or "content" not in message:
            missing = "role" if "role" not in message else "content"
            raise UserError(f"{where}: {field} has no '{missing}' (every message needs 'role' and 'content')")
        role = message["role"]
        if not isinstance(role, str) or not role:
            raise UserError(f"{where}: {field}.role must be a non-empty string, got {_type(role)}")
        if role not in CHAT_ROLES:
            hint = ' (ShareGPT turns, from "human"/"gpt", go in "conversations")' if role in ("human", "gpt") else ""
            raise UserError(f"{where}: {field}.role is {role!r}; accepted roles: {', '.join(CHAT_ROLES)}{hint}")
        normal = {key: item for key, item in message.items() if item is not None}
        normal["role"] = role
        normal["content"] = _content(message["content"], where, f"{field}.content")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise UserError(f"{where}: {field}.reasoning_content must be a string, got {_type(reasoning)}")
        messages.append(normal)
    return messages


def _content(value: Any, where: str, field: str) -> str:
    """A string, or OpenAI content parts whose text parts are joined with nothing between them."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _type(part)
                raise UserError(
                    f'{where}: {field}[{index}] must be a text part {{"type": "text", "text": ...}}, got {kind!r}'
                )
            texts.append(part["text"])
        return "".join(texts)
    raise UserError(f"{where}: {field} must be a string or a list of text parts, got {_type(value)}")


def _sharegpt(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: 'conversations' must be a non-empty list, got {_type(value)}")
    messages = []
    for index, turn in enumerate(value):
        field = f"conversations[{index}]"
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise UserError(f"{where}: {field} must be an object with 'from' and 'value'")
        source = turn["from"]
        if not isinstance(source, str) or source not in _SHAREGPT_ROLES:
            known = ", ".join(_SHAREGPT_ROLES)
            raise UserError(f"{where}: {field}.from must be one of {known}, got {source!r}")
        messages.append({"role": _SHAREGPT_ROLES[source], "content": _content(turn["value"], where, f"{field}.value")})
    return messages


def _tokens(fields: dict[str, Any], where: str, vocab_size: int | None) -> TokenExample:
    ids = _id_list(fields["input_ids"], "input_ids", where, vocab_size, allow_ignore=False)
    labels = fields.get("labels")
    if labels is None:
        return TokenExample(where, ids, None)
    labels = _id_list(labels, "labels", where, vocab_size, allow_ignore=True)
    if len(labels) != len(ids):
        raise UserError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
    return TokenExample(where, ids, labels)


def _id_list(value: Any, key: str, where: str, vocab_size: int | None, *, allow_ignore: bool) -> list[int]:
    if not isinstance(value, list):
        raise UserError(f"{where}: '{key}' must be a list of integers, got {_type(value)}")
    for index, token in enumerate(value):
        # bool is an int subclass: true/false would silently train as token ids 1 and 0
        if type(token) is not int:
            raise UserError(f"{where}: {key}[{index}] must be an integer, got {_type(token)} {token!r}")
        if token < 0 and not (allow_ignore and token == IGNORE):
            allowed = f"an id >= 0 or {IGNORE}" if allow_ignore else "an id >= 0"
            raise UserError(f"{where}: {key}[{index}] is {token}; it must be {allowed}")
        if vocab_size is not None and token >= vocab_size:
            raise UserError(
                f"{where}: token id {token} is outside the model's vocabulary of {vocab_size} ({key}[{index}])"
            )
    return list(value)


def _type(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)
