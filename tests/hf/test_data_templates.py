"""`slide_hf.data.templates`: the bundled generation-marked twins render exactly what the originals render.

The originals are Qwen's own templates, stored as fixtures byte for byte (Qwen/Qwen3-0.6B and
Qwen/Qwen2.5-7B-Instruct ``tokenizer_config.json``). Each twin is rendered by transformers beside its
original over many conversations, with and without the generation prompt, and must give identical text.
"""

from __future__ import annotations

import copy

import pytest
from test_data_tokenizer import QWEN3, QWEN3_CURRENT, QWEN25, chat_tokenizer

from slide_hf.data.templates import (
    BUNDLED_TEMPLATES,
    bundled_template_text,
    has_generation_markers,
    resolve_template,
    template_digest,
)
from slide_hf.errors import UserError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    "system and two turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another."},
        {"role": "assistant", "content": "Blue."},
    ],
    "reasoning on every turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "\nThree and three.\n"},
    ],
    "reasoning inline in content": [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "<think>\nBecause.\n</think>\n\nIt is so."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "<think>\nYes.\n</think>\n\nYes."},
    ],
    "reasoning only after the last query": [
        {"role": "system", "content": "Think."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "r"},
    ],
    "ends with a user turn": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
    "system not first": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "Now formal."},
        {"role": "assistant", "content": "Indeed."},
    ],
    "tool calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "21 and clear."},
    ],
    "tool calls with text": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ],
    "empty reply": [{"role": "user", "content": "..."}, {"role": "assistant", "content": ""}],
}


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer(None)


def _render(tok, template, messages, **kwargs):
    return tok.apply_chat_template(copy.deepcopy(messages), chat_template=template, tokenize=False, **kwargs)


@pytest.mark.parametrize(("original", "twin"), [(QWEN3, "qwen3"), (QWEN25, "qwen2.5")], ids=["qwen3", "qwen2.5"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_twin_renders_the_same_text(tok, original, twin, name):
    marked = bundled_template_text(twin)
    assert has_generation_markers(marked) and not has_generation_markers(original)
    messages = CONVERSATIONS[name]
    if twin == "qwen2.5" and any(m.get("reasoning_content") for m in messages):
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    variants = [
        {"add_generation_prompt": False},
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "enable_thinking": False},
        {"add_generation_prompt": False, "tools": TOOLS},
    ]
    for kwargs in variants:
        for upto in range(1, len(messages) + 1):  # every prefix too: the prefix method renders those
            expected = _render(tok, original, messages[:upto], **kwargs)
            assert _render(tok, marked, messages[:upto], **kwargs) == expected, (kwargs, upto)


def test_known_templates_are_recognised_by_their_exact_text(tok):
    for original, twin in ((QWEN3, "qwen3"), (QWEN25, "qwen2.5")):
        tok.chat_template = original
        template = resolve_template(tok, None)
        assert template is not None and not template.marked
        assert template.twin is not None and template.twin.text == bundled_template_text(twin)
        assert template.twin.marked
        # One changed character and it is an unknown template: never guessed to be the known one.
        tok.chat_template = original.replace("<|im_start|>system", "<|im_start|>system ", 1)
        assert resolve_template(tok, None).twin is None
    assert template_digest(QWEN3) != template_digest(QWEN3 + "\n")
    # Qwen3's current revision is not the bundled twin's original: it is masked from the final render.
    tok.chat_template = QWEN3_CURRENT
    assert resolve_template(tok, None).twin is None


def test_option_names_a_bundled_template_or_a_file(tok, tmp_path):
    tok.chat_template = QWEN3
    for name in BUNDLED_TEMPLATES:
        template = resolve_template(tok, name)
        assert template.text == bundled_template_text(name) and template.marked
        assert repr(name) in template.name
    path = tmp_path / "mine.jinja"
    path.write_text(QWEN3, encoding="utf-8")
    from_file = resolve_template(tok, str(path))
    assert from_file.text == QWEN3 and str(path) in from_file.name and from_file.twin is not None
    with pytest.raises(UserError, match=r"--chat-template nope.jinja: not a file, nor a bundled template \(chatml"):
        resolve_template(tok, "nope.jinja")
    (tmp_path / "latin1.jinja").write_bytes(b"{{ '\xe9' }}")
    with pytest.raises(UserError, match="not UTF-8"):
        resolve_template(tok, str(tmp_path / "latin1.jinja"))


def test_no_template(tok):
    tok.chat_template = None
    assert resolve_template(tok, None) is None
    tok.chat_template = QWEN3
    assert "tiny-chatml" in resolve_template(tok, None).name


def test_chatml_bundle_marks_only_replies(tok):
    messages = CONVERSATIONS["system and two turns"]
    out = tok.apply_chat_template(
        messages,
        chat_template=bundled_template_text("chatml"),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(trained) == "Red.<|im_end|>\nBlue.<|im_end|>\n"
    rendered = _render(tok, bundled_template_text("chatml"), messages, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n")
