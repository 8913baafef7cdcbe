"""Hostile data: one enormous record, system messages a template refuses, and reasoning kept on every turn.

A single multi-megabyte record must cost time and memory in proportion to its size: every tokenizer call
sees a bounded piece of it (``slide_hf.data.token_runs``), and the pieces' tokens are the whole text's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_data_tokenizer import QWEN3, chat_tokenizer

from slide_hf.data import DataOptions, bundled_text_path
from slide_hf.data.chat import ChatEncoder
from slide_hf.data.encode import Encoder
from slide_hf.data.schemas import ChatExample, TextExample
from slide_hf.data.templates import resolve_template
from slide_hf.data.token_runs import LONG_CHARS, tokenize

REPO = Path(__file__).resolve().parents[2]


def _long_text(chars: int) -> str:
    corpus = bundled_text_path().read_text(encoding="utf-8")
    return (corpus * (chars // len(corpus) + 1))[:chars]


class _Spy:
    """Wraps a tokenizer's ``__call__`` to record the longest text any call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, **kwargs):
        texts = [text] if isinstance(text, str) else text
        self.longest = max([self.longest, *(len(t) for t in texts)])
        return self.tokenizer(text, **kwargs)


def test_a_long_text_is_tokenized_in_bounded_calls_to_the_same_tokens():
    tok = chat_tokenizer(QWEN3)
    text = _long_text(900_000)
    whole = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spy = _Spy(tok)
    (run,) = tokenize(spy, [text], offsets=True)
    assert spy.longest <= LONG_CHARS
    assert run.ids.tolist() == whole["input_ids"]
    assert run.starts is not None and run.starts.tolist() == [begin for begin, _ in whole["offset_mapping"]]


@pytest.mark.parametrize(
    "text",
    [
        "x" + "l" * 200_000,  # one pre-token whose pairs ("ll") align from its odd start
        "=" + "l" * 200_001,
        "x" + "l" * 150_000 + " " + "l" * 150_001,
        "é" + "l" * 200_000 + "\n" + "ll\n" * 40_000,
        "x" + "=" * 200_000,
        ("日本語のテキスト" + "l" * 3001 + "€") * 50,
    ],
    ids=["odd run", "odd run after punctuation", "two runs", "unicode then newlines", "equals", "mixed unicode"],
)
def test_pieces_of_a_text_with_no_safe_cut_are_the_whole_texts_tokens(text):
    """A cut inside a run that BPE pairs from its start can agree with a check window that starts inside the
    run too; the pieces must still give the whole text's tokens."""
    tok = chat_tokenizer(QWEN3)
    assert len(text) > LONG_CHARS
    whole = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    (run,) = tokenize(tok, [text], offsets=True)
    assert run.ids.tolist() == whole["input_ids"]
    assert run.starts is not None and run.ends is not None
    assert np.stack([run.starts, run.ends], axis=1).tolist() == [list(pair) for pair in whole["offset_mapping"]]


def test_a_tokenizer_that_no_cut_suits_tokenizes_the_text_whole():
    """A normalizer that prepends a marker to every call changes the tokens at every cut: the checks
    refuse each cut, and the text is tokenized in one call, as before (same tokens, never wrong ones)."""
    from tokenizers import normalizers

    tok = chat_tokenizer(QWEN3)
    tok.backend_tokenizer.normalizer = normalizers.Prepend("#")
    text = _long_text(300_000)
    spy = _Spy(tok)
    (run,) = tokenize(spy, [text])
    assert run.ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert spy.longest == len(text)


def test_text_record_through_the_encoder_calls_the_tokenizer_on_pieces_only():
    tok = chat_tokenizer(QWEN3)
    text = _long_text(700_000)
    spy = _Spy(tok)
    encoder = Encoder(spy, DataOptions(seq_len=512), None)
    (record,) = encoder.encode([TextExample("t:1", text)])
    assert spy.longest <= LONG_CHARS
    ids = record.stream()[0].tolist()  # the pieces, each cut's overlap token once
    assert ids == [*tok(text, add_special_tokens=True)["input_ids"], tok.eos_token_id]
    assert record.cut == "split"


@pytest.mark.parametrize("method", ["prefix", "marked", "final render"])
def test_a_long_conversation_is_masked_alike_by_every_method_in_bounded_calls(method):
    """One enormous reply: the prefix method (Qwen3's own template, one turn), its marked twin, and the final
    render (an edited copy with no twin) give the same ids and labels, and no tokenizer call sees it all."""
    template = {"prefix": QWEN3, "marked": QWEN3, "final render": "{#- edited #}" + QWEN3}[method]
    tok = chat_tokenizer(template, name="my-org/qwen3")
    reply = _long_text(600_000)
    messages = [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": reply}]
    reference = ChatEncoder(tok, resolve_template(tok, "qwen3"), train_on_inputs=False)
    spy = _Spy(tok)
    encoder = ChatEncoder(spy, resolve_template(tok, "qwen3" if method == "marked" else None), train_on_inputs=False)
    if method == "final render":
        encoder.final_render = True
    (encoded,) = encoder.encode([ChatExample("c:1", messages)])
    assert spy.longest <= LONG_CHARS
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert encoded.input_ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
    trained = encoded.labels[encoded.labels != -100]
    assert tok.decode(trained.tolist()).startswith("<think>\n\n</think>\n\n" + reply[:100])
    assert encoded == reference.encode([ChatExample("c:1", messages)])[0]


_MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    from slide_hf.cli.main import main
    main(["data", "--data", sys.argv[1] + ".missing.jsonl", "--show", "0"])  # imports done: time the data
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.monotonic()
    code = main(["data", "--data", sys.argv[1], "--show", "0", "--max-record-size", "64MiB", "--seq-len", "256"])
    seconds = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"code": code, "seconds": seconds, "growth": peak - before}), file=sys.stderr)
    """
)


def _measure(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    return json.loads(done.stderr.strip().splitlines()[-1])


def _measure_best(path: Path, runs: int = 2) -> dict:
    """:func:`_measure` ``runs`` times: the quickest run's seconds, with the worst exit code and memory
    growth of them all."""
    measured = [_measure(path) for _ in range(runs)]
    best = min(measured, key=lambda run: run["seconds"])
    return {**best, "code": max(run["code"] for run in measured), "growth": max(run["growth"] for run in measured)}


def _record(tmp_path: Path, kind: str, megabytes: int) -> Path:
    body = "word " * (megabytes * 200_000)
    if kind == "text":
        record: dict = {"text": body}
    else:
        record = {"messages": [{"role": "user", "content": "Repeat a word."}, {"role": "assistant", "content": body}]}
    path = tmp_path / f"{kind}-{megabytes}.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_huge_text_record_costs_time_and_memory_in_proportion(tmp_path):
    """`slide data` on one 2 MB and one 8 MB text (`--max-record-size 64MiB`): one whole-record tokenizer
    call held ~200 bytes of memory per byte of record (10 GB for 50 MB) and grew faster than the record;
    in pieces the time grows about linearly and the memory stays a small multiple of the record. Each
    size is timed twice and its quicker run kept: a test worker beside it on a 2-core machine once made
    one run 12x the other."""
    small, large = (_measure_best(_record(tmp_path, "text", megabytes)) for megabytes in (2, 8))
    assert small["code"] == large["code"] == 0, (small, large)
    assert large["seconds"] / small["seconds"] < 8, (small, large)  # 4 times the bytes; 16 if quadratic
    assert large["growth"] < 40 * 8_000_000, (small, large)  # bytes per byte of record, ids and labels included


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_huge_reply_costs_memory_in_proportion(tmp_path):
    result = _measure(_record(tmp_path, "messages", 8))
    assert result["code"] == 0 and result["growth"] < 40 * 8_000_000, result


# ---- reasoning of every reply: --keep-reasoning ------------------------------------------------------------


def _write(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _trained_text(tok, record) -> str:
    document = record.documents[0]
    return tok.decode(document.input_ids[document.labels != -100].tolist())


REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
]


@pytest.mark.parametrize("chat_template", [None, "qwen3"], ids=["own template", "bundled qwen3"])
def test_keep_reasoning_trains_every_replys_think_block_with_qwen3(tmp_path, chat_template, caplog):
    import logging

    from slide_hf.data import preview

    tok = chat_tokenizer(QWEN3, name="Qwen/Qwen3-0.6B")
    path = _write(tmp_path / "c.jsonl", {"messages": REASONING})
    default = DataOptions(seq_len=4096, chat_template=chat_template)
    (dropped,) = preview(path, tok, default, 1)
    assert "Two and two." not in _trained_text(tok, dropped) and dropped.dropped_reasoning == 1
    keep = DataOptions(seq_len=4096, chat_template=chat_template, keep_reasoning=True)
    with caplog.at_level(logging.INFO, logger="slide.data"):
        (kept,) = preview(path, tok, keep, 1)
    assert "qwen3-keep-reasoning" in caplog.text
    assert kept.dropped_reasoning == 0
    assert _trained_text(tok, kept) == (
        "<think>\nTwo and two.\n</think>\n\n4<|im_end|>\n<think>\nThree and three.\n</think>\n\n6<|im_end|>\n"
    )
    # The user's turns stay untrained, and the text is Qwen3's own render but for the earlier reasoning.
    text = tok.decode(kept.documents[0].input_ids.tolist())
    assert text == tok.apply_chat_template(REASONING, tokenize=False).replace(
        "<|im_start|>assistant\n4", "<|im_start|>assistant\n<think>\nTwo and two.\n</think>\n\n4"
    )


def test_keep_reasoning_with_a_template_that_drops_it_and_has_no_variant_is_refused(tmp_path):
    from slide_hf.data import preview
    from slide_hf.errors import UserError

    tok = chat_tokenizer("{#- edited #}" + QWEN3, name="my-org/qwen3-edit")
    path = _write(tmp_path / "c.jsonl", {"messages": REASONING})
    with pytest.raises(UserError, match=rf"^{path}:1: --keep-reasoning: the chat template of my-org/qwen3-edit leaves"):
        preview(path, tok, DataOptions(seq_len=4096, keep_reasoning=True), 1)


def test_keep_reasoning_is_a_cli_and_toml_option(tmp_path, capsys):
    from slide_hf.options import TrainConfig

    assert TrainConfig.for_command("data", keep_reasoning=True).keep_reasoning is True
    assert TrainConfig.for_command("data", system_message="refuse").system_message == "refuse"


# ---- a system message the template refuses: --system-message ----------------------------------------------

GEMMA = (Path(__file__).parent / "fixtures" / "chat_templates" / "gemma-2-9b-it.jinja").read_text(encoding="utf-8")
WITH_SYSTEM = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Sky colour?"},
    {"role": "assistant", "content": "Blue."},
]


def _gemma_tokenizer():
    tok = chat_tokenizer(GEMMA, name="google/gemma-2-9b-it")
    tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return tok


def test_gemma_refuses_a_system_message_so_it_is_folded_into_the_first_user_turn(tmp_path, caplog):
    import logging

    from slide_hf.data import preview

    tok = _gemma_tokenizer()
    path = _write(tmp_path / "c.jsonl", *({"messages": WITH_SYSTEM} for _ in range(3)))
    with caplog.at_level(logging.INFO, logger="slide.data"):
        records = preview(path, tok, DataOptions(seq_len=512), 3)
    folded = [{"role": "user", "content": "Answer in one word.\n\nSky colour?"}, WITH_SYSTEM[2]]
    expected = tok.apply_chat_template(folded, tokenize=False)
    for record in records:
        assert tok.decode(record.documents[0].input_ids.tolist()) == expected
        assert _trained_text(tok, record) == "Blue.<end_of_turn>\n"
    said = [r.getMessage() for r in caplog.records if "refuses a system message" in r.getMessage()]
    assert len(said) == 1 and "--system-message refuse" in said[0], said


def test_system_message_refuse_keeps_the_one_line_refusal(tmp_path):
    from slide_hf.data import preview
    from slide_hf.errors import UserError

    tok = _gemma_tokenizer()
    path = _write(tmp_path / "c.jsonl", {"messages": WITH_SYSTEM})
    with pytest.raises(UserError, match=rf"^{path}:1: the chat template of google/gemma-2-9b-it refused this "):
        preview(path, tok, DataOptions(seq_len=512, system_message="refuse"), 1)


def test_a_template_that_takes_system_messages_renders_them_unchanged(tmp_path):
    from slide_hf.data import preview

    tok = chat_tokenizer(QWEN3)
    (record,) = preview(_write(tmp_path / "c.jsonl", {"messages": WITH_SYSTEM}), tok, DataOptions(seq_len=512), 1)
    assert tok.decode(record.documents[0].input_ids.tolist()) == tok.apply_chat_template(WITH_SYSTEM, tokenize=False)
