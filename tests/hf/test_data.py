"""`slide_hf.data`: JSON Lines -> fixed-length (input_ids, labels) examples, and the seeded batch order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slide_hf.data import IGNORE, Batches, DataPosition, Dataset, bundled_text_path, load_dataset
from slide_hf.errors import UserError
from slide_hf.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _jsonl(path: Path, *records: object) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=True)["input_ids"]


def _numbered(n: int, seq_len: int = 4) -> Dataset:
    """``n`` examples whose first token is their index in the file."""
    ids = torch.arange(n).unsqueeze(1).repeat(1, seq_len)
    return Dataset(ids, ids.clone(), "numbered")


def _rows(micro: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    return [int(row) for ids, _ in micro for row in ids[:, 0]]


# ---- formats ----------------------------------------------------------------------------------------


def test_text_is_packed_with_eos_appended(tmp_path, tok):
    path = _jsonl(tmp_path / "t.jsonl", {"text": "abcde"}, {"text": "fgh"}, {"text": "i"})
    data = load_dataset(path, tok, seq_len=4)
    stream = [*_ids(tok, "abcde"), tok.eos_token_id, *_ids(tok, "fgh"), tok.eos_token_id]
    stream += [*_ids(tok, "i"), tok.eos_token_id]  # 12 tokens: exactly three sequences of 4
    assert len(stream) == 12
    assert data.input_ids.tolist() == [stream[0:4], stream[4:8], stream[8:12]]
    assert torch.equal(data.labels, data.input_ids)  # packed text: every token is a label
    assert data.input_ids.dtype == torch.int64
    # An incomplete tail of the packed stream is dropped, not padded.
    assert len(load_dataset(path, tok, seq_len=5)) == 2
    assert data.source == str(path)


def test_bundled_text_when_no_path(tok):
    data = load_dataset(None, tok, seq_len=32)
    assert data.source == "bundled English text"
    assert len(data) > 50
    assert bundled_text_path().is_file()
    assert (data.labels != IGNORE).all()


def test_messages_label_only_the_assistant_reply(tmp_path, tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao."},
    ]
    path = _jsonl(tmp_path / "m.jsonl", {"messages": messages})
    data = load_dataset(path, tok, seq_len=128)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full.startswith("<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\nHello!\n")
    expected_ids = _ids(tok, full)
    n = len(expected_ids)
    assert data.input_ids[0, :n].tolist() == expected_ids
    assert (data.input_ids[0, n:] == tok.pad_token_id).all()
    # The labelled tokens, in order, spell exactly the assistant replies (with their newline).
    labels = data.labels[0]
    labelled = [int(t) for t in labels if t != IGNORE]
    assert tok.decode(labelled) == "Hello!\nCiao.\n"
    # ... at the positions of those replies; everything else (system, user, role headers, padding) is -100.
    want = torch.full_like(labels, IGNORE)
    for reply in ("Hello!\n", "Ciao.\n"):
        start = len(_ids(tok, full[: full.index("<|assistant|>\n" + reply) + len("<|assistant|>\n")]))
        want[start : start + len(_ids(tok, reply))] = torch.tensor(_ids(tok, reply))
    assert torch.equal(labels, want)
    user_start = len(_ids(tok, "<|system|>\nBe brief.\n"))
    assert (labels[: user_start + len(_ids(tok, "<|user|>\nHi there\n"))] == IGNORE).all()


def test_messages_are_truncated_to_seq_len(tmp_path, tok):
    messages = [{"role": "user", "content": "x" * 10}, {"role": "assistant", "content": "y" * 100}]
    data = load_dataset(_jsonl(tmp_path / "m.jsonl", {"messages": messages}), tok, seq_len=64)
    assert data.input_ids.shape == (1, 64)
    prompt = len(_ids(tok, "<|user|>\n" + "x" * 10 + "\n<|assistant|>\n"))
    assert (data.labels[0, :prompt] == IGNORE).all()
    assert data.labels[0, prompt:].tolist() == _ids(tok, "y" * (64 - prompt))


def test_sequences_without_a_usable_label_are_skipped_with_a_warning(tmp_path, tok, caplog):
    # A reply cut off by --seq-len, and a one-token line, would give a step with no loss tokens.
    cut = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"}]
    kept = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    path = _jsonl(tmp_path / "m.jsonl", {"messages": cut}, {"input_ids": [7]}, {"messages": kept})
    with caplog.at_level("WARNING", logger="slide.train"):
        data = load_dataset(path, tok, seq_len=32)
    assert len(data) == 1
    assert (data.labels[0, 1:] != IGNORE).any()
    assert "skipped 2 sequence(s) with no label token within --seq-len 32 (line 1, 2)" in caplog.text
    with pytest.raises(UserError, match="holds no complete sequence"):
        load_dataset(_jsonl(tmp_path / "none.jsonl", {"messages": cut}), tok, seq_len=32)


def test_input_ids_used_as_is_and_right_padded(tmp_path, tok):
    path = _jsonl(tmp_path / "i.jsonl", {"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]})
    data = load_dataset(path, tok, seq_len=4)
    pad = tok.pad_token_id
    assert data.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, pad, pad]]
    assert data.labels.tolist() == [[5, 6, 7, 8], [9, 10, IGNORE, IGNORE]]
    # No EOS is added to input_ids lines, and one line is one sequence (no packing).
    assert len(load_dataset(path, tok, seq_len=8)) == 2


def test_mixed_formats_in_one_file(tmp_path, tok):
    path = _jsonl(
        tmp_path / "mix.jsonl",
        {"input_ids": [1, 2, 3]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"text": "x" * 31},
    )
    data = load_dataset(path, tok, seq_len=32)
    assert len(data) == 3  # one input_ids, one conversation, one packed chunk of 31 text tokens + EOS
    assert data.input_ids[0, :3].tolist() == [1, 2, 3]
    assert data.input_ids[2, -1] == tok.eos_token_id


# ---- errors: file name and line number --------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"text": "unterminated', "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object, got list"),
        ('"just a string"', "expected a JSON object, got str"),
        ('{"prompt": "x"}', "expected exactly one of 'text', 'messages' or 'input_ids'"),
        ('{"text": "x", "input_ids": [1]}', "expected exactly one of 'text', 'messages' or 'input_ids'"),
        ('{"text": 5}', "'text' must be a string"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "every message needs 'role' and 'content'"),
        ('{"input_ids": [1, -2]}', "input_ids must be a list of non-negative integers"),
        ('{"input_ids": "1 2"}', "input_ids must be a list of non-negative integers"),
        ('{"input_ids": [1, 2, 3, 4, 5]}', "5 input_ids exceed --seq-len 4"),
        ('{"input_ids": [1, 259]}', "token id 259 is outside the model's vocabulary of 259"),
    ],
)
def test_bad_line_is_named_by_file_and_line(tmp_path, tok, bad_line, message):
    # Line 3 is bad: a blank line still counts, so the number is the one an editor shows.
    path = _jsonl(tmp_path / "bad.jsonl", {"text": "fine"}, "", bad_line, {"text": "never read"})
    with pytest.raises(UserError) as info:
        load_dataset(path, tok, seq_len=4, vocab_size=BYTE_VOCAB_SIZE)
    text = str(info.value)
    assert text.startswith(f"{path}:3: "), text
    assert message in text
    assert "\n" not in text


def test_missing_file(tmp_path, tok):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match=rf"data file {path} does not exist"):
        load_dataset(path, tok, seq_len=4)
    with pytest.raises(UserError, match="does not exist"):
        load_dataset(tmp_path, tok, seq_len=4)  # a directory is not a data file


def test_seq_len_beyond_max_positions(tok):
    with pytest.raises(UserError, match="--seq-len 65 exceeds the model's 64 positions"):
        load_dataset(None, tok, seq_len=65, max_positions=64)
    assert len(load_dataset(None, tok, seq_len=64, max_positions=64)) > 0
    with pytest.raises(UserError, match="--seq-len must be at least 2"):
        load_dataset(None, tok, seq_len=1)


def test_no_complete_sequence(tmp_path, tok):
    path = _jsonl(tmp_path / "short.jsonl", {"text": "ab"})
    with pytest.raises(UserError, match=r"holds no complete sequence of --seq-len 32 tokens"):
        load_dataset(path, tok, seq_len=32)


def test_too_few_sequences_for_one_step():
    data = _numbered(5)
    with pytest.raises(UserError) as info:
        Batches(data, batch_size=3, grad_accum=2, shuffle=True, seed=0)
    assert "numbered yields 5 sequences; one step needs 6 (--batch-size 3 x --grad-accum 2)" in str(info.value)
    assert Batches(data, batch_size=5, grad_accum=1, shuffle=True, seed=0).steps_per_epoch == 1
    with pytest.raises(UserError, match="--batch-size must be positive"):
        Batches(data, batch_size=0, grad_accum=1, shuffle=True, seed=0)
    with pytest.raises(UserError, match="--grad-accum must be positive"):
        Batches(data, batch_size=1, grad_accum=0, shuffle=True, seed=0)


# ---- order --------------------------------------------------------------------------------------------


def _epoch_order(seed: int, *, shuffle: bool = True, n: int = 32) -> list[int]:
    batches = Batches(_numbered(n), batch_size=2, grad_accum=2, shuffle=shuffle, seed=seed)
    return [row for _ in range(batches.steps_per_epoch) for row in _rows(batches.next_step())]


def test_shuffle_is_seeded():
    first = _epoch_order(seed=7)
    assert first == _epoch_order(seed=7)
    assert first != _epoch_order(seed=8)
    assert sorted(first) == list(range(32))  # a permutation: every example once per epoch
    assert first != list(range(32))


def test_no_shuffle_keeps_file_order():
    batches = Batches(_numbered(10), batch_size=2, grad_accum=2, shuffle=False, seed=123)
    step = batches.next_step()
    assert len(step) == 2  # grad_accum micro-batches of batch_size
    assert [ids.shape[0] for ids, _ in step] == [2, 2]
    assert _rows(step) == [0, 1, 2, 3]
    assert _rows(batches.next_step()) == [4, 5, 6, 7]
    assert torch.equal(step[0][1], step[0][0])  # labels travel with their examples
    assert _epoch_order(seed=1, shuffle=False) == _epoch_order(seed=2, shuffle=False) == list(range(32))


def test_epoch_rollover_skips_the_partial_tail():
    batches = Batches(_numbered(10), batch_size=2, grad_accum=2, shuffle=False, seed=0)
    assert batches.steps_per_epoch == 2
    assert _rows(batches.next_step()) == [0, 1, 2, 3]
    assert _rows(batches.next_step()) == [4, 5, 6, 7]
    assert batches.position == DataPosition(0, 8)
    # Examples 8 and 9 cannot fill a step: the next step starts epoch 1 from the beginning.
    assert _rows(batches.next_step()) == [0, 1, 2, 3]
    assert batches.position == DataPosition(1, 4)


def test_each_epoch_reshuffles_and_resume_position_replays():
    batches = Batches(_numbered(8), batch_size=2, grad_accum=2, shuffle=True, seed=5)
    steps = [_rows(batches.next_step()) for _ in range(6)]  # three epochs of two steps
    epochs = [steps[0] + steps[1], steps[2] + steps[3], steps[4] + steps[5]]
    assert all(sorted(epoch) == list(range(8)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1  # the order is drawn from seed + epoch
    # A fresh Batches at a saved position continues exactly where the first left off.
    again = Batches(_numbered(8), batch_size=2, grad_accum=2, shuffle=True, seed=5)
    again.position = DataPosition(1, 4)
    assert _rows(again.next_step()) == steps[3]
    assert _rows(again.next_step()) == steps[4]
