"""What `slide data` and the pipeline say about records longer than ``--seq-len`` is what training sees.

A text longer than a row is *split* (every token but its first is a target exactly once: each piece after
the first starts with the previous piece's last token), any other record is *truncated*; the two are
counted apart. A record that loses every trained token to the limit says so and asks for a larger
``--seq-len``. ``--show`` larger than the data shows what exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slide_hf.data import IGNORE, DataOptions, load_dataset
from slide_hf.data.encode import Encoder
from slide_hf.data.schemas import TextExample
from slide_hf.errors import UserError
from slide_hf.tokenizer import byte_tokenizer

SEQ = 8
DISTINCT = "abcdefghijklmnop"
"""16 distinct bytes: with EOS 17 tokens, two full pieces of 8 and one token over under the old cut."""


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_tokenizer()


def _write(path: Path, *rows: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _text_ids(tok: Any, text: str) -> list[int]:
    """A text's tokens as the pipeline encodes it: the tokenizer's own, then EOS."""
    return [*tok(text)["input_ids"], tok.eos_token_id]


def _trained_targets(labels: np.ndarray) -> list[int]:
    return [int(label) for label in np.asarray(labels).reshape(-1) if label != IGNORE]


def test_split_text_trains_every_token_but_the_first_exactly_once(tok: Any) -> None:
    ids = _text_ids(tok, DISTINCT)
    (record,) = Encoder(tok, DataOptions(seq_len=SEQ), None).encode([TextExample("t:1", DISTINCT)])
    assert record.cut == "split" and record.tokens == len(ids) == 17
    targets = [t for document in record.documents for t in _trained_targets(document.labels)]
    assert targets == ids[1:]  # in order, none twice, none missing (the EOS included)
    assert all(len(document.input_ids) <= SEQ for document in record.documents)
    for before, after in zip(record.documents, record.documents[1:], strict=False):
        assert after.input_ids[0] == before.input_ids[-1]  # the cut's context: the previous piece's last token


def test_rows_train_what_the_stats_count(tmp_path: Path, tok: Any) -> None:
    """The rows training reads (load_dataset, as slide_hf/recipe.py prepares them) hold each split text's
    targets once, and the stats count exactly the tokens and targets those rows hold."""
    path = _write(tmp_path / "d.jsonl", {"text": DISTINCT}, {"text": "xy"})
    data = load_dataset(path, tok, DataOptions(seq_len=SEQ, packing=False))
    long_ids, short_ids = _text_ids(tok, DISTINCT), _text_ids(tok, "xy")
    assert _trained_targets(data.labels.numpy()) == long_ids[1:] + short_ids[1:]
    assert data.stats.loss_tokens == int((data.labels != IGNORE).sum()) == len(long_ids) - 1 + len(short_ids) - 1
    real = int(data.stats.rows * SEQ - round(data.stats.padding_fraction * data.stats.rows * SEQ))
    assert data.stats.tokens == real == 8 + 8 + 3 + len(short_ids)  # pieces at 0, 7 and 14


def test_split_and_truncated_examples_are_counted_apart(tmp_path: Path, tok: Any) -> None:
    path = _write(tmp_path / "d.jsonl", {"text": DISTINCT}, {"text": "short"}, {"input_ids": list(range(3, 23))})
    stats = load_dataset(path, tok, DataOptions(seq_len=SEQ)).stats
    assert (stats.split_examples, stats.truncated_examples, stats.longer_than_seq_len) == (1, 1, 2)
    only_text = _write(tmp_path / "t.jsonl", {"text": DISTINCT}, {"text": "short"})
    stats = load_dataset(only_text, tok, DataOptions(seq_len=SEQ)).stats
    assert (stats.split_examples, stats.truncated_examples) == (1, 0)


def test_slide_data_prints_split_texts_apart_from_truncated_ones(tmp_path: Path, tok: Any, slide: Any) -> None:
    path = _write(tmp_path / "long.jsonl", {"text": " ".join(["word"] * 300)}, {"text": "short doc"})
    argv = ("data", "--model", "tiny-llama", "--data", path, "--seq-len", "100", "--no-packing", "--show", "0")
    status, out, err = slide(*argv)
    assert status == 0, err
    assert "  truncated examples  0\n" in out and "  split examples      1 (texts in row-sized pieces" in out
    status, out, err = slide(*argv, "--json")
    assert status == 0, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert (summary["truncated_examples"], summary["split_examples"], summary["longer_than_seq_len"]) == (0, 1, 1)
    data = load_dataset(path, tok, DataOptions(seq_len=100, packing=False))
    assert summary["loss_tokens"] == int((data.labels != IGNORE).sum())
    assert summary["tokens"] == data.stats.tokens


def test_slide_data_shows_a_split_text_once_with_every_target_marked(tmp_path: Path, tok: Any, slide: Any) -> None:
    path = _write(tmp_path / "d.jsonl", {"text": DISTINCT})
    status, out, err = slide("data", "--model", "tiny-llama", "--data", path, "--seq-len", SEQ, "--show", "1", "--json")
    assert status == 0, err
    shown = json.loads(out.splitlines()[0])
    ids = _text_ids(tok, DISTINCT)
    assert shown["text"] == tok.decode(ids)  # the overlap token is shown once
    assert (shown["tokens"], shown["loss_tokens"], shown["cut"]) == (len(ids), len(ids) - 1, "split")
    assert shown["trained_text"] == tok.decode(ids[1:])


def test_a_huge_show_shows_what_exists(tmp_path: Path, slide: Any) -> None:
    path = _write(tmp_path / "d.jsonl", {"text": "one"}, {"text": "two"})
    status, out, err = slide("data", "--model", "tiny-llama", "--data", path, "--show", 10**21, "--json")
    assert status == 0, err
    assert [json.loads(line).get("where") for line in out.splitlines()[:-1]] == [f"{path}:1", f"{path}:2"]


def _no_room(words: int) -> dict[str, Any]:
    """A conversation whose user turn alone is longer than the row: truncation leaves no assistant token."""
    return {
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}, {"role": "assistant", "content": "ok"}]
    }


def test_records_that_lose_every_target_to_seq_len_say_so(tmp_path: Path, slide: Any) -> None:
    path = _write(tmp_path / "chat.jsonl", _no_room(2000))
    argv = ("data", "--model", "tiny-llama", "--data", path, "--seq-len", "256", "--chat-template", "chatml")
    status, out, err = slide(*argv, "--show", "0")
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"slide data: error: {path} holds no example with a token to train (1 record(s) read)")
    assert "1 record(s) lost every trained token to --seq-len 256" in lines[-1]
    assert "raise --seq-len" in lines[-1] and "Traceback" not in err


def test_the_seq_len_hint_counts_only_records_the_limit_emptied(tmp_path: Path) -> None:
    from test_data_tokenizer import QWEN3, chat_tokenizer

    tok = chat_tokenizer(QWEN3)
    path = _write(tmp_path / "c.jsonl", _no_room(200), _no_room(300), {"input_ids": [5]})
    with pytest.raises(UserError) as caught:
        load_dataset(path, tok, DataOptions(seq_len=64))
    message = str(caught.value)
    assert message.startswith(f"{path} holds no example with a token to train (3 record(s) read)")
    assert "2 record(s) lost every trained token to --seq-len 64 (the longest " in message
    no_limit = _write(tmp_path / "n.jsonl", {"input_ids": [5]})
    with pytest.raises(UserError) as caught:
        load_dataset(no_limit, tok, DataOptions(seq_len=64))
    assert "--seq-len" not in str(caught.value)


def test_a_source_of_a_mixture_emptied_by_seq_len_says_so(tmp_path: Path) -> None:
    from test_data_tokenizer import QWEN3, chat_tokenizer

    tok = chat_tokenizer(QWEN3)
    fine = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    first, second = _write(tmp_path / "a.jsonl", fine), _write(tmp_path / "b.jsonl", _no_room(200))
    with pytest.raises(UserError) as caught:
        load_dataset([first, second], tok, DataOptions(seq_len=64))
    assert str(caught.value).startswith(
        f"--data {second} holds no example with a token to train: 1 record(s) lost every trained token to --seq-len 64"
    )
