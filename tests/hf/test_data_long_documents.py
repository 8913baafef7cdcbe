"""Documents longer than ``--seq-len`` are never cut silently: the data pipeline counts them and names the
longest (slide_hf/data/dataset.py), `slide data` prints the examples' lengths (min, median, max), and `slide
train` warns with the same line. A text is split into row-sized pieces that keep every token (each piece
after the first repeats its predecessor's last token, so every token but the first is trained once);
anything else is truncated."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from slide_hf.data import DataOptions, load_dataset
from slide_hf.tokenizer import byte_tokenizer

SEQ = 32
TEXTS = ["a" * 10, "b" * 30, "c" * 100, "d" * 40]
"""Two texts that fit a row of 32 tokens and two that do not (EOS included)."""


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_tokenizer()


def _lengths(tok: Any) -> list[int]:
    """Each text's tokens as the pipeline encodes it: the tokenizer's own, then EOS (test_data_dataset.py)."""
    return [len(tok(text)["input_ids"]) + 1 for text in TEXTS]


def _data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS), encoding="utf-8")
    return path


def test_long_texts_are_counted_named_and_kept_whole_in_pieces(tmp_path: Path, tok: Any, caplog) -> None:
    path = _data(tmp_path / "long.jsonl")
    lengths = _lengths(tok)
    with caplog.at_level(logging.INFO, logger="slide.data"):
        data = load_dataset(path, tok, DataOptions(seq_len=SEQ))
    stats = data.stats
    assert stats.longer_than_seq_len == sum(n > SEQ for n in lengths) == 2
    assert (stats.example_tokens_min, stats.example_tokens_max) == (min(lengths), max(lengths))
    assert stats.example_tokens_median == int(sorted(lengths)[1] + sorted(lengths)[2]) // 2
    cuts = sum(-(-(n - 1) // (SEQ - 1)) - 1 for n in lengths)  # pieces step by SEQ - 1 tokens
    assert stats.tokens == sum(lengths) + cuts  # every token of the split texts is in a row, each cut's twice
    assert stats.loss_tokens == sum(n - 1 for n in lengths)  # every token but a text's first, once
    assert (stats.split_examples, stats.truncated_examples) == (2, 0)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    line = (
        f"{path}: split 2 text(s) longer than --seq-len {SEQ} into row-sized pieces (the longest {max(lengths)} tokens)"
    )
    assert any(message.startswith(line) for message in warnings), warnings


def test_truncated_examples_name_the_longest(tmp_path: Path, tok: Any, caplog) -> None:
    path = tmp_path / "ids.jsonl"
    path.write_text(
        json.dumps({"input_ids": list(range(3, 3 + 50))}) + "\n" + json.dumps({"input_ids": [5, 6, 7]}) + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="slide.data"):
        data = load_dataset(path, tok, DataOptions(seq_len=SEQ))
    assert data.stats.longer_than_seq_len == 1 and data.stats.example_tokens_max == 50
    assert f"truncated 1 example(s) longer than --seq-len {SEQ}: {path}:1 (the longest 50 tokens)" in caplog.text


def test_slide_data_prints_the_lengths_and_the_long_ones(tmp_path: Path, tok: Any, slide: Any, caplog) -> None:
    path = _data(tmp_path / "long.jsonl")
    lengths = _lengths(tok)
    argv = ("data", "--model", "tiny-llama", "--data", str(path), "--seq-len", str(SEQ), "--show", "0")
    status, out, err = slide(*argv)
    assert status == 0, err
    median = sorted(lengths)[1:3]
    assert f"example tokens      min {min(lengths)}, median {sum(median) // 2}, max {max(lengths)}" in out
    assert f"longer than seq-len 2 (split into row-sized pieces or truncated; the longest {max(lengths)} tokens)" in out
    assert f"split 2 text(s) longer than --seq-len {SEQ}" in caplog.text  # the warning, logged
    status, out, err = slide(*argv, "--json")
    assert status == 0, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["longer_than_seq_len"] == 2 and summary["example_tokens_max"] == max(lengths)


def test_slide_train_warns_of_the_long_documents(tmp_path: Path, slide: Any, caplog) -> None:
    path = _data(tmp_path / "long.jsonl")
    argv = ("train", "--model", "tiny-llama", "--device", "cpu", "--data", str(path), "--seq-len", str(SEQ))
    status, _, err = slide(*argv, "--batch-size", "1", "--steps", "1", "--output", str(tmp_path / "run"))
    assert status == 0, err
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(f"split 2 text(s) longer than --seq-len {SEQ} into row-sized pieces (the longest" in w for w in warnings)
