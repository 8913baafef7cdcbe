"""`slide_hf.data.packing`: whole documents per row, position ids restarting at each, no cross-document
labels, little padding, and the same tokens and labels whatever the order of the file."""

from __future__ import annotations

import collections
import json
import random

import numpy as np
import pytest
import torch
from test_data_tokenizer import QWEN3, chat_tokenizer

from slide_hf.data import IGNORE, DataOptions, load_dataset
from slide_hf.data.encode import Document
from slide_hf.data.packing import Packer


def _documents(lengths: list[int]) -> list[Document]:
    """Document ``i`` holds token ``1000 + i`` everywhere, so rows can be read back into documents."""
    out = []
    for index, length in enumerate(lengths):
        ids = np.full(length, 1000 + index, dtype=np.int32)
        labels = ids.copy()
        labels[0] = IGNORE
        out.append(Document(ids, labels))
    return out


def _segments(position_ids: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run where positions count up by one, as HF's packed-sequence detection reads it."""
    starts = [0] + [i for i in range(1, len(position_ids)) if position_ids[i] != position_ids[i - 1] + 1]
    return list(zip(starts, [*starts[1:], len(position_ids)], strict=True))


@pytest.mark.parametrize("window_tokens", [64, 1 << 21])
def test_documents_stay_whole_and_positions_restart(window_tokens):
    rng = random.Random(0)
    seq_len = 32
    lengths = [rng.randint(1, seq_len) for _ in range(200)]
    packer = Packer(seq_len, pad_id=0, packing=True, window_tokens=window_tokens)
    blocks = list(packer.rows(_documents(lengths)))
    ids = np.concatenate([b.input_ids for b in blocks])
    labels = np.concatenate([b.labels for b in blocks])
    positions = np.concatenate([b.position_ids for b in blocks])
    assert ids.dtype == labels.dtype == positions.dtype == np.int32
    seen = collections.Counter()
    for row in range(ids.shape[0]):
        real = int((ids[row] != 0).sum())
        assert (ids[row, real:] == 0).all() and (labels[row, real:] == IGNORE).all()  # padding only at the end
        for start, end in _segments(positions[row]):
            if start >= real:
                continue
            end = min(end, real)  # the padding continues the last document's positions
            document = int(ids[row, start]) - 1000
            assert (ids[row, start:end] == 1000 + document).all()
            assert end - start == lengths[document]  # whole: never split across rows
            assert positions[row, start] == 0 and labels[row, start] == IGNORE
            seen[document] += 1
        # HF's own detection draws the same boundaries.
        from transformers.masking_utils import find_packed_sequence_indices

        found = find_packed_sequence_indices(torch.from_numpy(positions[row : row + 1]).long())
        groups = [0] * seq_len if found is None else found[0].tolist()
        assert [s for s, _ in _segments(positions[row])] == [
            i for i in range(seq_len) if i == 0 or groups[i] != groups[i - 1]
        ]
    assert seen == collections.Counter(range(len(lengths)))  # every document exactly once
    assert sum(b.documents for b in blocks) == len(lengths)
    assert sum(b.tokens for b in blocks) == sum(lengths)
    if window_tokens > sum(lengths):  # one window: best-fit decreasing wastes little
        assert ids.shape[0] <= 1.1 * sum(lengths) / seq_len + 1


def test_one_document_row_keeps_plain_positions_so_hf_sees_no_packing():
    (block,) = Packer(8, pad_id=7, packing=True).rows(_documents([5]))
    assert block.position_ids.tolist() == [list(range(8))]
    assert block.input_ids[0, 5:].tolist() == [7, 7, 7]
    from transformers.masking_utils import find_packed_sequence_indices

    assert find_packed_sequence_indices(torch.from_numpy(block.position_ids).long()) is None


def test_without_packing_each_document_has_its_own_row():
    (block,) = Packer(8, pad_id=0, packing=False).rows(_documents([3, 8, 1]))
    assert block.input_ids.shape == (3, 8)
    assert [int((row != 0).sum()) for row in block.input_ids] == [3, 8, 1]
    assert block.position_ids.tolist() == [list(range(8))] * 3


def test_a_document_longer_than_a_row_is_a_bug_upstream():
    with pytest.raises(ValueError, match="exceeds the row"):
        list(Packer(4, pad_id=0, packing=True).rows(_documents([5])))


def _chats(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "he",
        "for",
        "it",
        "with",
        "as",
        "his",
        "on",
        "be",
        "at",
        "by",
        "had",
        "are",
        "but",
        "from",
    ]
    chats = []
    for _ in range(count):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        chats.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return chats


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_many_short_chats_pack_with_little_padding(tmp_path):
    tok = chat_tokenizer(QWEN3)
    path = _write(tmp_path / "chats.jsonl", _chats(300, seed=1))
    packed = load_dataset(path, tok, DataOptions(seq_len=512))
    assert packed.stats.examples == 300 and packed.stats.truncated_examples == 0
    assert packed.stats.padding_fraction < 0.10, packed.stats
    unpacked = load_dataset(path, tok, DataOptions(seq_len=512, packing=False))
    assert len(unpacked) == 300 and unpacked.stats.padding_fraction > 0.5
    assert packed.stats.tokens == unpacked.stats.tokens and packed.stats.loss_tokens == unpacked.stats.loss_tokens
    # Document starts (position 0) never carry a label: no token learns to predict the next conversation.
    starts = packed.position_ids == 0
    assert (packed.labels[starts] == IGNORE).all()
    assert int(starts.sum()) == 300


def test_packed_set_does_not_depend_on_the_order_of_the_file(tmp_path):
    tok = chat_tokenizer(QWEN3)
    rows = _chats(120, seed=2) + [{"text": "a text document " * k} for k in range(1, 30)]
    shuffled = list(rows)
    random.Random(3).shuffle(shuffled)
    first = load_dataset(_write(tmp_path / "a.jsonl", rows), tok, DataOptions(seq_len=256))
    second = load_dataset(_write(tmp_path / "b.jsonl", shuffled), tok, DataOptions(seq_len=256))
    assert first.stats == second.stats

    def pairs(dataset):
        return collections.Counter(
            zip(dataset.input_ids.flatten().tolist(), dataset.labels.flatten().tolist(), strict=True)
        )

    assert pairs(first) == pairs(second)
    assert sorted(first.position_ids.eq(0).sum(1).tolist()) == sorted(second.position_ids.eq(0).sum(1).tolist())
