"""`slide_hf.data.chat`: loss exactly on the assistant's turns as the full conversation renders them.

The expected trained text is parsed from transformers' own render of the whole conversation with the
real template (``assistant_turns``), independently of the masking code. Qwen3's template defeats the
prefix method on every multi-turn conversation; the bundled twin must take over and be exact.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging

import pytest
from test_data_templates import CONVERSATIONS
from test_data_tokenizer import FIXTURES, QWEN3, QWEN25, assistant_turns, chat_tokenizer

from slide_hf.data import IGNORE, DataOptions, preview
from slide_hf.data.chat import ChatEncoder
from slide_hf.data.schemas import ChatExample
from slide_hf.data.templates import resolve_template
from slide_hf.errors import UserError

OPTIONS = DataOptions(seq_len=4096)


def _write(path, *records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _trained(document) -> list[int]:
    return [int(t) for t, label in zip(document.input_ids, document.labels, strict=True) if label != IGNORE]


def _check_exact(tok, template_text, messages, document):
    """Decoded trained tokens == the assistant turns of the full render, at their positions, and labels
    equal the tokens they sit on."""
    rendered = tok.apply_chat_template(copy.deepcopy(messages), chat_template=template_text, tokenize=False)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert document.input_ids.tolist() == ids
    assert tok.decode(_trained(document)) == assistant_turns(rendered)
    for position, (token, label) in enumerate(zip(document.input_ids.tolist(), document.labels.tolist(), strict=True)):
        assert label in (IGNORE, token), position
    # Everything trained lies inside an assistant block: the token before each trained run is not a user's.
    labels = document.labels.tolist()
    for position in range(1, len(labels)):
        if labels[position] != IGNORE and labels[position - 1] == IGNORE:
            head = tok.decode(ids[:position])
            assert head.endswith("<|im_start|>assistant\n"), head[-40:]


CHAT_NAMES = [name for name in sorted(CONVERSATIONS) if name != "ends with a user turn"]


@pytest.mark.parametrize("name", CHAT_NAMES)
def test_qwen3_masks_are_exact(tmp_path, name, caplog):
    tok = chat_tokenizer(QWEN3)
    messages = CONVERSATIONS[name]
    with caplog.at_level(logging.INFO, logger="slide.data"):
        (record,) = preview(_write(tmp_path / "c.jsonl", {"messages": messages}), tok, OPTIONS, 1)
    _check_exact(tok, QWEN3, messages, record.documents[0])
    multi_turn = sum(m["role"] == "assistant" for m in messages) > 1
    # Multi-turn conversations defeat the prefix method: the twin takes over, and says so once.
    assert ("re-renders earlier turns" in caplog.text) == multi_turn
    if multi_turn:
        assert "the bundled chat template 'qwen3'" in caplog.text


def test_qwen3_reasoning_of_earlier_turns_is_dropped_and_the_user_is_never_trained(tmp_path):
    tok = chat_tokenizer(QWEN3)
    messages = CONVERSATIONS["reasoning on every turn"]
    (record,) = preview(_write(tmp_path / "c.jsonl", {"messages": messages}), tok, OPTIONS, 1)
    trained = tok.decode(_trained(record.documents[0]))
    assert trained == "4<|im_end|>\n<think>\nThree and three.\n</think>\n\n6<|im_end|>\n"
    assert "3+3?" not in trained and "Two and two" not in trained
    assert record.dropped_reasoning == 1  # the first reply's, which the template leaves out


@pytest.mark.parametrize("name", CHAT_NAMES)
def test_chatml_qwen25_masks_are_exact_by_verified_prefixes(tmp_path, name, caplog):
    tok = chat_tokenizer(QWEN25)
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CONVERSATIONS[name]]
    with caplog.at_level(logging.INFO, logger="slide.data"):
        (record,) = preview(_write(tmp_path / "c.jsonl", {"messages": messages}), tok, OPTIONS, 1)
    _check_exact(tok, QWEN25, messages, record.documents[0])
    assert "re-renders" not in caplog.text  # Qwen2.5's ChatML keeps the prefix property: no twin needed


@pytest.mark.parametrize(("original", "twin"), [(QWEN25, "qwen2.5"), (QWEN3, "qwen3")])
def test_prefix_method_and_twin_agree_wherever_both_apply(original, twin):
    """Conversations encoded before a switch to the twin keep their masks: both methods must agree."""
    tok = chat_tokenizer(original)
    batch = [ChatExample(f"c:{i}", CONVERSATIONS[name]) for i, name in enumerate(CHAT_NAMES)]
    if twin == "qwen3":
        batch = [ex for ex in batch if sum(m["role"] == "assistant" for m in ex.messages) == 1]
    else:
        batch = [
            ChatExample(ex.where, [{k: v for k, v in m.items() if k != "reasoning_content"} for m in ex.messages])
            for ex in batch
        ]
    assert batch
    by_prefix = ChatEncoder(tok, resolve_template(tok, None), train_on_inputs=False)
    by_twin = ChatEncoder(tok, resolve_template(tok, twin), train_on_inputs=False)
    assert not by_prefix.template.marked and by_twin.template.marked
    assert by_prefix.encode(batch) == by_twin.encode(batch)
    assert not by_prefix.template.marked  # the prefix method held for all of them


def test_unknown_template_that_re_renders_is_masked_from_the_final_render(tmp_path, caplog):
    """An edited Qwen3 template has no twin: each reply is found in the whole render, and the masks equal
    the twin's (generation markers, an independent method) on every conversation, tool calls included."""
    edited = "{#- a fine-tuner's copy #}" + QWEN3  # same behaviour, unknown text: no twin
    tok = chat_tokenizer(edited, name="my-org/qwen3-edit")
    batch = [ChatExample(f"c:{i}", CONVERSATIONS[name]) for i, name in enumerate(CHAT_NAMES)]
    by_render = ChatEncoder(tok, resolve_template(tok, None), train_on_inputs=False)
    assert by_render.template.twin is None
    with caplog.at_level(logging.INFO, logger="slide.data"):
        encoded = by_render.encode(batch)
    assert by_render.final_render and "masking each assistant message where it appears" in caplog.text
    by_twin = ChatEncoder(tok, resolve_template(tok, "qwen3"), train_on_inputs=False)
    assert encoded == by_twin.encode(batch)
    # Through the pipeline too, with the user's turns untrained.
    path = _write(tmp_path / "c.jsonl", *({"messages": CONVERSATIONS[name]} for name in CHAT_NAMES))
    records = preview(path, tok, OPTIONS, len(CHAT_NAMES))
    for name, record in zip(CHAT_NAMES, records, strict=True):
        _check_exact(tok, edited, CONVERSATIONS[name], record.documents[0])


def test_deepseek_r1_template_is_masked_from_the_final_render():
    """A second re-rendering template with no twin: DeepSeek-R1-Distill's drops every reply's reasoning and
    prefills ``<think>\\n`` in its generation prompt, which its rendered replies lack."""
    tok = chat_tokenizer((FIXTURES / "deepseek-r1-distill.jinja").read_text(encoding="utf-8"))
    specials = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
    ]
    encoder = ChatEncoder(tok, resolve_template(tok, None), train_on_inputs=False)
    (encoded,) = encoder.encode([ChatExample("c:1", messages)])
    assert encoder.final_render and encoded.dropped_reasoning == 2
    trained = [
        token if label != IGNORE else None for token, label in zip(encoded.input_ids, encoded.labels, strict=True)
    ]
    runs = [tok.decode(list(run)) for key, run in itertools.groupby(trained, key=lambda t: t is not None) if key]
    assert runs == ["\n\n4<｜end▁of▁sentence｜>", "\n\n6<｜end▁of▁sentence｜>"]


def test_template_that_loses_an_assistant_message_is_refused_naming_it(tmp_path):
    loses_replies = (  # renders a reply only when it ends the conversation
        "{%- for m in messages %}{%- if m.role != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tok = chat_tokenizer(loses_replies, name="my-org/forgetful")
    path = _write(
        tmp_path / "c.jsonl",
        {"messages": CONVERSATIONS["one turn"]},
        {"messages": CONVERSATIONS["system and two turns"]},
    )
    with pytest.raises(UserError) as info:
        preview(path, tok, OPTIONS, 2)
    assert str(info.value) == (
        f"{path}:2: message 3 (assistant) does not appear in the rendered conversation (its content is not in "
        "the reply found there); the chat template of my-org/forgetful loses it: pass --chat-template FILE with "
        "{% generation %} markers, or a bundled one (chatml, qwen2.5, qwen3)"
    )
    # The way out works: the same data with a marked template.
    records = preview(path, tok, DataOptions(seq_len=4096, chat_template="chatml"), 2)
    assert tok.decode(_trained(records[1].documents[0])) == "Red.<|im_end|>\nBlue.<|im_end|>\n"


def test_template_exception_is_one_line_naming_the_record(tmp_path):
    strict = (
        "{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{%- endif %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tok = chat_tokenizer(strict)
    path = _write(
        tmp_path / "c.jsonl",
        {"messages": CONVERSATIONS["one turn"]},
        {"messages": CONVERSATIONS["system and two turns"]},
    )
    with pytest.raises(UserError) as info:  # by default such a system message is folded (test_data_hostile.py)
        preview(path, tok, DataOptions(seq_len=4096, system_message="refuse"), 2)
    assert str(info.value) == (
        f"{path}:2: the chat template of tiny-chatml refused this conversation: System role not supported"
    )


def test_train_on_inputs_trains_every_token_but_the_first(tmp_path):
    tok = chat_tokenizer(QWEN3)
    messages = CONVERSATIONS["system and two turns"]
    options = DataOptions(seq_len=4096, train_on_inputs=True)
    (record,) = preview(_write(tmp_path / "c.jsonl", {"messages": messages}), tok, options, 1)
    document = record.documents[0]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(document.input_ids.tolist()) == rendered
    assert document.labels[0] == IGNORE and (document.labels[1:] == document.input_ids[1:]).all()


def test_conversation_without_template_is_refused_and_chatml_option_works(tmp_path):
    tok = chat_tokenizer(None)
    path = _write(tmp_path / "c.jsonl", {"messages": CONVERSATIONS["one turn"]})
    with pytest.raises(UserError, match=rf"{path}:1: the tokenizer has no chat template for conversations"):
        preview(path, tok, OPTIONS, 1)
    (record,) = preview(path, tok, DataOptions(seq_len=64, chat_template="chatml"), 1)
    assert tok.decode(_trained(record.documents[0])) == "Hello!<|im_end|>\n"


def test_conversation_without_reply_is_skipped(tmp_path):
    tok = chat_tokenizer(QWEN3)
    path = _write(tmp_path / "c.jsonl", {"messages": [{"role": "user", "content": "only a question"}]})
    (record,) = preview(path, tok, OPTIONS, 1)
    assert record.skipped and record.documents == []


_PLAIN_MARKED = (
    "{% for m in messages %}{% if m.role == 'user' %}USER: {{ m.content }}\n"
    "{% else %}ASSISTANT: {% generation %}{{ m.content }}{% endgeneration %}\n{% endif %}{% endfor %}"
)


def test_marked_template_trains_the_tokens_transformers_marks():
    """The byte-level token " the" starts at the space before the generation block: transformers' mask
    trains it (every token from the block's first character's through its last's), and so must ours."""
    tok = chat_tokenizer(_PLAIN_MARKED)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "the answer is there"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "then the end"},
    ]
    expected = tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    first = expected["input_ids"][expected["assistant_masks"].index(1)]
    assert tok.convert_ids_to_tokens(first) == "\u0120the"  # the reply's first token holds the space before it
    encoder = ChatEncoder(tok, resolve_template(tok, None), train_on_inputs=False)
    assert encoder.template.marked
    (encoding,) = encoder.encode([ChatExample("c:1", messages)])
    assert encoding.input_ids.tolist() == expected["input_ids"]
    assert encoding.labels.tolist() == [
        token if mask else IGNORE
        for token, mask in zip(expected["input_ids"], expected["assistant_masks"], strict=True)
    ]


def test_a_marked_template_renders_each_conversation_once(monkeypatch):
    from transformers.utils import chat_template_utils

    tok = chat_tokenizer(_PLAIN_MARKED)
    renders = []
    real = chat_template_utils.render_jinja_template

    def counting(*args, **kwargs):
        renders.append(len(kwargs["conversations"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_template_utils, "render_jinja_template", counting)
    import transformers.tokenization_utils_base as base

    if hasattr(base, "render_jinja_template"):
        monkeypatch.setattr(base, "render_jinja_template", counting)
    encoder = ChatEncoder(tok, resolve_template(tok, None), train_on_inputs=False)
    batch = [
        ChatExample(f"c:{i}", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
        for i in range(3)
    ]
    encoder.encode(batch)
    assert sum(renders) == len(batch)


def test_keep_reasoning_counts_each_conversations_dropped_reasoning_once(monkeypatch):
    from slide_hf.data import chat

    tok = chat_tokenizer(QWEN3, name="Qwen/Qwen3-0.6B")
    calls = []
    real = chat.dropped_reasoning

    def counting(text, messages):
        calls.append(1)
        return real(text, messages)

    monkeypatch.setattr(chat, "dropped_reasoning", counting)
    encoder = ChatEncoder(tok, resolve_template(tok, None), train_on_inputs=False, keep_reasoning=True)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Three and three."},
    ]
    (encoding,) = encoder.encode([ChatExample("c:1", messages)])
    assert encoding.dropped_reasoning == 0 and len(calls) == 1
