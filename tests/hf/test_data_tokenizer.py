"""A real fast tokenizer for the data tests, built offline: BPE trained on the bundled text, ChatML specials.

Other ``test_data_*`` modules import :func:`chat_tokenizer` and :func:`assistant_turns` from here; the
tests below check that the tokenizer is what they rely on (special tokens whole, a lossless round trip,
ids stable through ``save_pretrained`` and ``AutoTokenizer``).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from slide_hf.data import bundled_text_path

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3 = (FIXTURES / "qwen3-0.6b.jinja").read_text(encoding="utf-8")
QWEN25 = (FIXTURES / "qwen2.5-7b-instruct.jinja").read_text(encoding="utf-8")
# Qwen3's current template (the revision that checks ``message.content is string``): no twin is bundled for
# it, so multi-turn conversations are masked from the final render.
QWEN3_CURRENT = (FIXTURES / "qwen3-current.jinja").read_text(encoding="utf-8")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<think>", "</think>")  # added but not special, as in Qwen3's tokenizer


@functools.lru_cache(maxsize=1)
def _saved_tokenizer() -> str:
    """Train once per process and save; every caller reloads its own copy from this directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(bundled_text_path().read_text(encoding="utf-8").splitlines(), trainer)
    core.add_tokens(list(ADDED))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIALS[1:]),
    )
    directory = tempfile.mkdtemp(prefix="slide-test-tokenizer-")
    fast.save_pretrained(directory)
    return directory


def chat_tokenizer(template: str | None = QWEN3, name: str = "tiny-chatml") -> Any:
    """A fresh ``AutoTokenizer`` of the tiny BPE, with ``template`` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_saved_tokenizer())
    tokenizer.chat_template = template
    tokenizer.name_or_path = name
    return tokenizer


def assistant_turns(rendered: str) -> str:
    """The assistant turns of a ChatML render as they appear in it: after ``<|im_start|>assistant\\n``,
    through ``<|im_end|>`` and its newline. Parsed from text, independently of the code under test."""
    turns = []
    for block in rendered.split("<|im_start|>")[1:]:
        if block.startswith("assistant\n"):
            body = block[len("assistant\n") :]
            end = body.index("<|im_end|>") + len("<|im_end|>")
            turns.append(body[: end + 1] if body[end : end + 1] == "\n" else body[:end])
    return "".join(turns)


def test_special_tokens_are_single_tokens_and_text_round_trips():
    tok = chat_tokenizer()
    text = "<|im_start|>user\nWhy? é 😀<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nYes.<|im_end|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    for token in (*SPECIALS, *ADDED):
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1, token
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_ids_survive_save_and_reload(tmp_path):
    tok = chat_tokenizer()
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert len(again) == len(tok)
    sample = "<|im_start|>assistant\n<think>\n</think>\n\nok<|im_end|>"
    assert again(sample)["input_ids"] == tok(sample)["input_ids"]
    assert again.chat_template == QWEN3


def test_assistant_turns_parser():
    rendered = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n<|im_start|>assistant\na2<|im_end|>"
    assert assistant_turns(rendered) == "a1<|im_end|>\na2<|im_end|>"
