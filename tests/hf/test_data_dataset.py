"""`slide_hf.data.dataset` and `storage`: the whole pipeline, its statistics, the evaluation split and the
content-keyed cache (a hit tokenizes nothing)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from test_data_tokenizer import QWEN3, chat_tokenizer

from slide_hf.data import IGNORE, DataOptions, load_dataset, load_split
from slide_hf.errors import UserError
from slide_hf.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _write(path, *rows):
    path.write_text(
        "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows), encoding="utf-8"
    )
    return path


class CountingTokenizer:
    """The real tokenizer, counting every call that tokenizes or renders."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_text_rows_hold_documents_with_eos_and_int32_storage(tmp_path, tok):
    path = _write(tmp_path / "t.jsonl", {"text": "abcde"}, {"text": "fgh"}, {"text": "x" * 20})
    data = load_dataset(path, tok, DataOptions(seq_len=8))
    assert data.input_ids.dtype == data.labels.dtype == data.position_ids.dtype == torch.int32
    assert data.input_ids.shape[1] == 8 and len(data) == data.stats.rows
    eos = tok.eos_token_id
    rows = [row.tolist() for row in data.input_ids]
    assert [*tok("abcde")["input_ids"], eos] in [row[:6] for row in rows] or any(
        row[i : i + 6] == [*tok("abcde")["input_ids"], eos] for row in rows for i in range(3)
    )
    # 20 tokens of x + EOS are split into pieces of 8, 8 and 7 starting at 0, 7 and 14 (a text is a stream;
    # each piece after the first repeats the previous one's last token, so no target is lost at a cut).
    assert data.stats.split_examples == 1 and data.stats.truncated_examples == 0 and data.stats.examples == 3
    assert data.stats.tokens == 6 + 4 + 23
    assert data.stats.loss_tokens == data.stats.tokens - 5  # every piece's first token carries no label
    assert (data.labels[data.position_ids == 0] == IGNORE).all()


def test_bundled_text_by_default(tok):
    data = load_dataset(None, tok, DataOptions(seq_len=64))
    assert data.source == "bundled English text"
    assert len(data) > 50 and data.stats.padding_fraction < 0.05


def test_options_are_checked():
    with pytest.raises(UserError, match="--seq-len 65 exceeds the model's 64 positions"):
        DataOptions(seq_len=65, max_positions=64)
    with pytest.raises(UserError, match="--seq-len must be an integer of at least 2, got 1"):
        DataOptions(seq_len=1)
    with pytest.raises(UserError, match="--seq-len must be an integer of at least 2, got True"):
        DataOptions(seq_len=True)


def test_truncated_and_skipped_examples_are_counted_and_named(tmp_path, caplog):
    tok = chat_tokenizer(QWEN3)
    long_reply = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 200}]}
    no_room = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "a"}]}
    fine = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = _write(tmp_path / "c.jsonl", long_reply, no_room, fine, {"input_ids": [5]})
    with caplog.at_level(logging.INFO, logger="slide.data"):
        data = load_dataset(path, tok, DataOptions(seq_len=64))
    assert data.stats.examples == 2 and data.stats.truncated_examples == 1 and data.stats.skipped_examples == 2
    assert f"{path}: truncated 1 example(s) longer than --seq-len 64: {path}:1" in caplog.text
    assert f"{path}: skipped 2 example(s) with no token to train within --seq-len 64: {path}:2, {path}:4" in caplog.text
    with pytest.raises(UserError, match=r"holds no example with a token to train \(2 record\(s\) read\)"):
        load_dataset(_write(tmp_path / "none.jsonl", no_room, {"input_ids": [5]}), tok, DataOptions(seq_len=64))
    with pytest.raises(UserError, match=r"holds no example with a token to train \(0 record\(s\) read\)"):
        load_dataset(_write(tmp_path / "empty.jsonl", ""), tok, DataOptions(seq_len=64))


def test_cache_hit_tokenizes_nothing(tmp_path, caplog):
    path = _write(tmp_path / "c.jsonl", *[{"text": f"document number {i}"} for i in range(50)])
    options = DataOptions(seq_len=32)
    first_tok = CountingTokenizer(byte_tokenizer())
    first = load_dataset(path, first_tok, options, cache_dir=tmp_path / "cache")
    assert first_tok.calls > 0
    entries = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(entries) == 1 and not entries[0].startswith(".")  # committed, no temporary left behind
    again_tok = CountingTokenizer(byte_tokenizer())
    with caplog.at_level(logging.INFO, logger="slide.data"):
        again = load_dataset(path, again_tok, options, cache_dir=tmp_path / "cache")
    assert again_tok.calls == 0
    assert "(cache)" in caplog.text
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert first.stats == again.stats


def test_cache_key_follows_what_changes_the_rows(tmp_path):
    cache = tmp_path / "cache"
    path = _write(tmp_path / "c.jsonl", {"text": "some text"}, {"text": "more text"})

    def entries():
        return len([p for p in cache.iterdir() if not p.name.startswith(".")])

    def tokenizer(chat_template=None):
        counting = CountingTokenizer(byte_tokenizer())
        if chat_template is not None:
            counting._inner.chat_template = chat_template
        return counting

    load_dataset(path, tokenizer(), DataOptions(seq_len=32), cache_dir=cache)
    assert entries() == 1
    unchanged = tokenizer()
    load_dataset(path, unchanged, DataOptions(seq_len=32, max_positions=64), cache_dir=cache)
    assert entries() == 1 and unchanged.calls == 0  # a model limit that changes no row
    load_dataset(path, tokenizer(), DataOptions(seq_len=16), cache_dir=cache)
    assert entries() == 2
    load_dataset(path, tokenizer(), DataOptions(seq_len=32, packing=False), cache_dir=cache)
    assert entries() == 3
    load_dataset(path, tokenizer("{{ messages[0].content }}"), DataOptions(seq_len=32), cache_dir=cache)
    assert entries() == 4
    _write(path, {"text": "changed text"})
    counting = tokenizer()
    changed = load_dataset(path, counting, DataOptions(seq_len=32), cache_dir=cache)
    assert entries() == 5 and counting.calls > 0
    assert byte_tokenizer().decode(changed.input_ids[0, :12].tolist()) == "changed text"


def test_damaged_cache_entry_is_rebuilt(tmp_path, caplog):
    cache = tmp_path / "cache"
    path = _write(tmp_path / "c.jsonl", {"text": "some text"})
    first = load_dataset(path, CountingTokenizer(byte_tokenizer()), DataOptions(seq_len=16), cache_dir=cache)
    expected = first.labels.clone()  # the mapping would see the damage below
    (entry,) = cache.iterdir()
    (entry / "train" / "labels.int32").write_bytes(b"\0\0")
    counting = CountingTokenizer(byte_tokenizer())
    with caplog.at_level(logging.WARNING, logger="slide.data"):
        again = load_dataset(path, counting, DataOptions(seq_len=16), cache_dir=cache)
    assert "rebuilding the prepared data" in caplog.text and counting.calls > 0
    assert torch.equal(expected, again.labels)
    hit = CountingTokenizer(byte_tokenizer())
    load_dataset(path, hit, DataOptions(seq_len=16), cache_dir=cache)
    assert hit.calls == 0 and len(list(cache.iterdir())) == 1  # the rebuilt entry replaced the damaged one


def test_unwritable_cache_is_one_line(tmp_path, tok):
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    with pytest.raises(UserError, match="cannot write the data cache in"):
        load_dataset(None, tok, DataOptions(seq_len=32), cache_dir=blocker / "cache")


def test_full_disk_while_writing_rows_is_one_line(tmp_path, tok, monkeypatch):
    import errno

    from slide_hf.data import storage

    def full(self, block):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / "input_ids.int32"))

    monkeypatch.setattr(storage.RowWriter, "write", full)
    with pytest.raises(UserError, match=r"input_ids\.int32: No space left on device") as info:
        load_dataset(None, tok, DataOptions(seq_len=32), cache_dir=tmp_path / "cache")
    assert "\n" not in str(info.value)
    assert [p for p in (tmp_path / "cache").iterdir()] == []  # the half-built entry is gone


def test_eval_split_is_per_record_seeded_and_disjoint(tmp_path, tok):
    rows = [{"text": f"record {i:03d} " + "z" * (i % 7)} for i in range(200)]
    path = _write(tmp_path / "c.jsonl", *rows)
    options = DataOptions(seq_len=64)
    train, held_out = load_split(path, tok, options, eval_fraction=0.2, seed=1)

    def records(dataset):
        text = tok.decode(dataset.input_ids.flatten().tolist())
        return {int(part[:3]) for part in text.split("record ")[1:]}

    train_ids, eval_ids = records(train), records(held_out)
    assert train_ids.isdisjoint(eval_ids) and train_ids | eval_ids == set(range(200))
    assert 20 <= len(eval_ids) <= 60
    assert held_out.stats.examples == len(eval_ids) and train.stats.examples == len(train_ids)
    assert "(eval split)" in held_out.source
    again_train, again_eval = load_split(path, tok, options, eval_fraction=0.2, seed=1)
    assert torch.equal(again_eval.input_ids, held_out.input_ids) and torch.equal(again_train.input_ids, train.input_ids)
    assert records(load_split(path, tok, options, eval_fraction=0.2, seed=2)[1]) != eval_ids
    with pytest.raises(UserError, match="--eval-fraction must be between 0 and 1"):
        load_split(path, tok, options, eval_fraction=1.0)
    with pytest.raises(UserError, match=r"--eval-fraction 0\.001 holds out none of the 3 record"):
        load_split(_write(tmp_path / "few.jsonl", *rows[:3]), tok, options, eval_fraction=0.001)


# ---- mixtures: several sources -------------------------------------------------------------------------------


def _source_rows(dataset, tok) -> list[str]:
    """The source letter of each row (every record below starts with its source's letter)."""
    return [tok.decode(row.tolist())[0] for row in dataset.input_ids]


def test_several_sources_are_prepared_into_one_dataset_with_a_part_each(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", *({"text": f"a{i:02d} " + "x" * 20} for i in range(30)))
    b = _write(tmp_path / "b.jsonl", *({"text": f"b{i:02d} " + "y" * 20} for i in range(10)))
    options = DataOptions(seq_len=32, packing=False)
    mixed = load_dataset([a, b], tok, options, cache_dir=tmp_path / "cache")
    assert mixed.source == f"{a} + {b}"
    assert [(p.name, p.first_row, p.rows, p.examples) for p in mixed.parts] == [
        (str(a), 0, 30, 30),
        (str(b), 30, 10, 10),
    ]
    assert _source_rows(mixed, tok) == ["a"] * 30 + ["b"] * 10  # no row mixes two sources
    assert sum(p.tokens for p in mixed.parts) == mixed.stats.tokens
    assert mixed.stats.examples == 40
    again = load_dataset([a, b], tok, options, cache_dir=tmp_path / "cache")  # from the cache, parts and all
    assert again.parts == mixed.parts
    assert load_dataset(a, tok, options).parts[0].rows == 30


def test_packed_sources_never_share_a_row(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", *({"text": "a" * 5} for _ in range(3)))  # 3 short docs: one packed row
    b = _write(tmp_path / "b.jsonl", *({"text": "b" * 5} for _ in range(3)))
    mixed = load_dataset([a, b], tok, DataOptions(seq_len=64))
    assert [p.rows for p in mixed.parts] == [1, 1]
    assert set(tok.decode(mixed.input_ids[0].tolist())) & {"b"} == set()


def test_eval_split_of_a_mixture_is_disjoint_per_source(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", *({"text": f"a{i:03d}"} for i in range(100)))
    b = _write(tmp_path / "b.jsonl", *({"text": f"b{i:03d}"} for i in range(100)))
    options = DataOptions(seq_len=16, packing=False)
    train, held_out = load_split([a, b], tok, options, eval_fraction=0.25, seed=3)

    def records(dataset):
        return {tok.decode(row.tolist())[:4] for row in dataset.input_ids}

    train_ids, eval_ids = records(train), records(held_out)
    assert train_ids.isdisjoint(eval_ids) and len(train_ids | eval_ids) == 200
    for letter in "ab":  # each source holds out about its own quarter
        held = {r for r in eval_ids if r[0] == letter}
        assert 10 <= len(held) <= 45, (letter, len(held))
    assert [p.rows for p in held_out.parts] == [len({r for r in eval_ids if r[0] == s}) for s in "ab"]
    # The first source keeps the split it has alone; the second is drawn apart (not the same indices).
    alone = records(load_split(a, tok, options, eval_fraction=0.25, seed=3)[1])
    assert alone == {r for r in eval_ids if r[0] == "a"}
    assert {r[1:] for r in eval_ids if r[0] == "b"} != {r[1:] for r in alone}


def test_an_empty_source_of_a_mixture_is_named(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", {"text": "hello"})
    b = _write(tmp_path / "b.jsonl", "")
    with pytest.raises(UserError, match=rf"--data {b} holds no example with a token to train"):
        load_dataset([a, b], tok, DataOptions(seq_len=16))
