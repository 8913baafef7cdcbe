"""`slide_hf.data.schemas`: each record's kind by its keys, and one line naming file:line and field for
every malformed one (read through the whole pipeline, as `slide train` reads it)."""

from __future__ import annotations

import json

import pytest

from slide_hf.data import DataOptions, load_dataset, preview
from slide_hf.data.readers import Record
from slide_hf.data.schemas import ChatExample, PromptExample, TextExample, TokenExample, parse_record
from slide_hf.errors import UserError
from slide_hf.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _parse(fields, **kwargs):
    return parse_record(Record("f.jsonl:7", fields), **kwargs)


def test_kinds_by_keys():
    assert _parse({"text": "hi", "id": 3}) == TextExample("f.jsonl:7", "hi")
    assert _parse({"prompt": "p", "completion": "c"}) == PromptExample("f.jsonl:7", "p", "c")
    assert _parse({"instruction": "Do it", "input": "", "output": "Done"}) == PromptExample(
        "f.jsonl:7", "Do it", "Done"
    )
    assert _parse({"instruction": "Sum", "input": "1 2", "output": "3"}).prompt == "Sum\n\n1 2"
    assert _parse({"input_ids": [1, 2]}) == TokenExample("f.jsonl:7", [1, 2], None)
    assert _parse({"input_ids": [1, 2], "labels": [-100, 2]}).labels == [-100, 2]
    chat = _parse({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "name": None}]})
    assert chat == ChatExample("f.jsonl:7", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    # A null column of another kind (a Parquet table mixing kinds) counts as absent.
    assert _parse({"text": None, "prompt": "p", "completion": "c"}) == PromptExample("f.jsonl:7", "p", "c")


def test_openai_content_parts_are_joined():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    chat = _parse({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]})
    assert chat.messages[0]["content"] == "Hello, world"


def test_sharegpt_roles():
    turns = [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]
    turns.append({"from": "tool", "value": "t"})
    chat = _parse({"conversations": turns})
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert [m["content"] for m in chat.messages] == ["s", "h", "g", "t"]


GOOD = {"text": "fine"}
BAD = [
    ({"prompt": "x"}, "expected one of text, messages, conversations (ShareGPT), input_ids, prompt+completion"),
    ({"text": "x", "messages": []}, "holds both messages and text; keep one kind"),
    ({"text": 5}, "'text' must be a string, got an integer"),
    ({"text": None}, "'text' is null"),
    ({"messages": []}, "'messages' must be a non-empty list, got a list"),
    ({"messages": "hi"}, "'messages' must be a non-empty list, got a string"),
    ({"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
    ({"messages": [{"content": "x"}]}, "messages[0] has no 'role'"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role must be a non-empty string, got an integer"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string or a list of text parts"),
    (
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content must be a string or a list of text parts, got null",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0] must be a text part",
    ),
    (
        {"messages": [{"role": "user", "content": "a", "reasoning_content": 3}]},
        "messages[0].reasoning_content must be a string",
    ),
    ({"messages": ["hi"]}, "messages[0] must be an object with 'role' and 'content', got a string"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
        "messages[1].role is 'bot'; accepted roles: system, user, assistant, tool",
    ),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "conversations[0].from must be one of human, user, gpt"),
    ({"conversations": [{"from": "human"}]}, "conversations[0] must be an object with 'from' and 'value'"),
    ({"input_ids": [1, True, 3]}, "input_ids[1] must be an integer, got a boolean True"),
    ({"input_ids": [1, 2.0]}, "input_ids[1] must be an integer, got a number 2.0"),
    ({"input_ids": [1, -2]}, "input_ids[1] is -2; it must be an id >= 0"),
    ({"input_ids": "1 2"}, "'input_ids' must be a list of integers, got a string"),
    ({"input_ids": [1, 259]}, "token id 259 is outside the model's vocabulary of 259 (input_ids[1])"),
    ({"input_ids": [1, 2], "labels": [1]}, "'labels' has 1 entries but 'input_ids' has 2"),
    ({"input_ids": [1, 2], "labels": [-5, 2]}, "labels[0] is -5; it must be an id >= 0 or -100"),
    ({"input_ids": [1, 2], "labels": [False, 2]}, "labels[0] must be an integer, got a boolean False"),
    ({"prompt": "p", "completion": 3}, "'completion' must be a string, got an integer"),
    ({"instruction": "i", "input": 3, "output": "o"}, "'input' must be a string, got an integer"),
]


@pytest.mark.parametrize(("bad", "message"), BAD, ids=[message[:40] for _, message in BAD])
def test_bad_record_is_named_by_file_line_and_field(tmp_path, tok, bad, message):
    # Line 3 is bad: a blank line still counts, so the number is the one an editor shows.
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n" + json.dumps(GOOD) + "\n", encoding="utf-8")
    with pytest.raises(UserError) as info:
        load_dataset(path, tok, DataOptions(seq_len=16, vocab_size=BYTE_VOCAB_SIZE))
    text = str(info.value)
    assert text.startswith(f"{path}:3: "), text
    assert message in text, text
    assert "\n" not in text


def test_every_kind_trains_the_right_tokens(tmp_path, tok):
    """Without a chat template prompt/completion and Alpaca are plain text with loss on the completion;
    with one, they are a user and an assistant turn."""
    rows = [
        {"text": "abc"},
        {"prompt": "Q: 2+2?\nA:", "completion": " 4"},
        {"instruction": "Add", "input": "2 2", "output": "4"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [5, 6, 7]},
    ]
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    def trained(record):
        (document,) = record.documents
        return [int(t) for t, label in zip(document.input_ids, document.labels, strict=True) if label != -100]

    eos = tok.eos_token
    records = preview(path, tok, DataOptions(seq_len=128), len(rows))
    assert [tok.decode(trained(r)) for r in records[:5]] == ["bc" + eos, " 4\n", "4\n", "yo\n", "yo\n"]
    assert trained(records[5]) == [7, 8] and trained(records[6]) == [6, 7]

    plain = byte_tokenizer()
    plain.chat_template = None
    records = preview(path, plain, DataOptions(seq_len=128), 3)
    assert tok.decode(records[1].documents[0].input_ids.tolist()) == "Q: 2+2?\nA: 4" + eos
    assert tok.decode(trained(records[1])) == " 4" + eos
    assert tok.decode(trained(records[2])) == "4" + eos
    assert tok.decode(records[2].documents[0].input_ids.tolist()).startswith("Add\n\n2 2")
    everything = preview(path, plain, DataOptions(seq_len=128, train_on_inputs=True), 2)[1].documents[0]
    assert (everything.labels[1:] == everything.input_ids[1:]).all()
