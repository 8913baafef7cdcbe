"""`slide_hf.data.batches`: seeded micro-batches of (input_ids, labels, position_ids) as int64, resumable at
any step, and every row once for evaluation."""

from __future__ import annotations

import pytest
import torch

from slide_hf.data import Batches, DataPosition, Dataset, DataStats, MicroBatch, eval_batches
from slide_hf.errors import UserError


def _numbered(n: int, seq_len: int = 4) -> Dataset:
    """``n`` int32 rows whose every token is the row's index (labels and positions derived from it)."""
    ids = torch.arange(n, dtype=torch.int32).unsqueeze(1).repeat(1, seq_len)
    positions = torch.arange(seq_len, dtype=torch.int32).repeat(n, 1)
    stats = DataStats(n, n, n * seq_len, n * seq_len, 0.0, 0, 0)
    return Dataset(ids, ids + 1000, positions, "numbered", stats)


def _rows(micro: list[MicroBatch]) -> list[int]:
    return [int(row) for batch in micro for row in batch.input_ids[:, 0]]


def test_micro_batches_are_int64_triples_that_keep_rows_together():
    batches = Batches(_numbered(10), batch_size=2, grad_accum=3, shuffle=True, seed=4)
    step = batches.next_step()
    assert len(step) == 3
    for micro in step:
        assert isinstance(micro, MicroBatch)
        input_ids, labels, position_ids = micro  # unpacks as the engine takes it
        assert input_ids.dtype == labels.dtype == position_ids.dtype == torch.int64
        assert input_ids.shape == labels.shape == position_ids.shape == (2, 4)
        assert torch.equal(labels, input_ids + 1000)
        assert position_ids.tolist() == [[0, 1, 2, 3]] * 2


def test_too_few_rows_for_one_step():
    data = _numbered(5)
    with pytest.raises(UserError) as info:
        Batches(data, batch_size=3, grad_accum=2, shuffle=True, seed=0)
    assert str(info.value) == "numbered yields 5 rows; one step needs 6 (--batch-size 3 x --grad-accum 2)"
    assert Batches(data, batch_size=5, grad_accum=1, shuffle=True, seed=0).steps_per_epoch == 1
    with pytest.raises(UserError, match="--batch-size must be positive"):
        Batches(data, batch_size=0, grad_accum=1, shuffle=True, seed=0)
    with pytest.raises(UserError, match="--grad-accum must be positive"):
        Batches(data, batch_size=1, grad_accum=0, shuffle=True, seed=0)


def _epoch_order(seed: int, *, shuffle: bool = True, n: int = 32) -> list[int]:
    batches = Batches(_numbered(n), batch_size=2, grad_accum=2, shuffle=shuffle, seed=seed)
    return [row for _ in range(batches.steps_per_epoch) for row in _rows(batches.next_step())]


def test_shuffle_is_seeded():
    first = _epoch_order(seed=7)
    assert first == _epoch_order(seed=7)
    assert first != _epoch_order(seed=8)
    assert sorted(first) == list(range(32)) and first != list(range(32))


def test_no_shuffle_keeps_row_order():
    assert _epoch_order(seed=1, shuffle=False) == _epoch_order(seed=2, shuffle=False) == list(range(32))


def test_epoch_rollover_skips_the_partial_tail():
    batches = Batches(_numbered(10), batch_size=2, grad_accum=2, shuffle=False, seed=0)
    assert batches.steps_per_epoch == 2
    assert _rows(batches.next_step()) == [0, 1, 2, 3]
    assert _rows(batches.next_step()) == [4, 5, 6, 7]
    assert batches.position == DataPosition(0, 8)
    assert _rows(batches.next_step()) == [0, 1, 2, 3]  # rows 8 and 9 cannot fill a step
    assert batches.position == DataPosition(1, 4)


def test_each_epoch_reshuffles_and_a_saved_position_replays():
    batches = Batches(_numbered(8), batch_size=2, grad_accum=2, shuffle=True, seed=5)
    steps = [_rows(batches.next_step()) for _ in range(6)]
    epochs = [steps[0] + steps[1], steps[2] + steps[3], steps[4] + steps[5]]
    assert all(sorted(epoch) == list(range(8)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1
    again = Batches(_numbered(8), batch_size=2, grad_accum=2, shuffle=True, seed=5)
    again.position = DataPosition(1, 4)
    assert _rows(again.next_step()) == steps[3]
    assert _rows(again.next_step()) == steps[4]


def test_eval_batches_cover_every_row_once_in_order():
    data = _numbered(7)
    batches = list(eval_batches(data, 3))
    assert [b.input_ids.shape[0] for b in batches] == [3, 3, 1]
    assert _rows(batches) == list(range(7))
    assert all(b.labels.dtype == torch.int64 for b in batches)
    with pytest.raises(UserError, match="must be positive"):
        list(eval_batches(data, 0))


@pytest.mark.parametrize(("rows", "world_size"), [(7, 2), (7, 3), (9, 3), (2, 3)])
def test_eval_batches_of_the_ranks(rows: int, world_size: int):
    """Note [Every rank evaluates as many micro-batches]: rank r takes micro-batches r, r + N, ... of one
    process's, and a rank one short ends with a filler (the first micro-batch, every label ignored)."""
    data = _numbered(rows)
    whole = list(eval_batches(data, 2))
    ranks = [list(eval_batches(data, 2, rank=rank, world_size=world_size)) for rank in range(world_size)]
    assert len({len(share) for share in ranks}) == 1  # every rank as many
    for rank, share in enumerate(ranks):
        own = whole[rank::world_size]
        assert all(torch.equal(got.input_ids, want.input_ids) for got, want in zip(share, own, strict=False))
        assert all(torch.equal(got.labels, want.labels) for got, want in zip(share, own, strict=False))
        for filler in share[len(own) :]:
            assert torch.equal(filler.input_ids, whole[0].input_ids) and bool((filler.labels == -100).all())
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        list(eval_batches(data, 2, rank=2, world_size=2))


# ---- weighted mixtures ---------------------------------------------------------------------------------------


def _mixture(rows_a: int, rows_b: int) -> Dataset:
    """Rows of source a hold their index; rows of b their index too (b's start at ``rows_a``)."""
    from slide_hf.data import SourcePart

    data = _numbered(rows_a + rows_b)
    parts = (SourcePart("a", 0, rows_a, rows_a, 0, 0), SourcePart("b", rows_a, rows_b, rows_b, 0, 0))
    return Dataset(data.input_ids, data.labels, data.position_ids, "a + b", data.stats, parts)


def _drawn(batches: Batches, steps: int) -> list[int]:
    return [row for _ in range(steps) for row in _rows(batches.next_step())]


@pytest.mark.parametrize("shuffle", [True, False])
def test_weights_draw_sources_in_proportion_reproducibly(shuffle):
    data = _mixture(200, 200)
    batches = Batches(data, batch_size=4, grad_accum=2, shuffle=shuffle, seed=5, weights=(3, 1))
    rows = _drawn(batches, 3 * batches.steps_per_epoch)  # three epochs
    from_a = sum(row < 200 for row in rows) / len(rows)
    assert abs(from_a - 0.75) < 0.02, from_a
    assert rows == _drawn(Batches(data, 4, 2, shuffle=shuffle, seed=5, weights=(3, 1)), 3 * batches.steps_per_epoch)
    first_50 = rows[:50]
    assert 0.6 < sum(row < 200 for row in first_50) / 50 < 0.9  # interleaved, not a block of a then b
    if shuffle:
        assert _drawn(Batches(data, 4, 2, shuffle=True, seed=6, weights=(3, 1)), 10) != rows[:80]
    # Every row of the smaller share is still seen over the epochs; the larger share repeats.
    assert set(rows) == set(range(400))


def test_a_small_source_weighted_up_repeats_in_fresh_orders():
    data = _mixture(90, 10)
    batches = Batches(data, batch_size=10, grad_accum=1, shuffle=True, seed=0, weights=(1, 1))
    rows = _drawn(batches, batches.steps_per_epoch)
    b_rows = [row for row in rows if row >= 90]
    assert len(b_rows) == 50 and set(b_rows) == set(range(90, 100))
    assert b_rows[:10] != b_rows[10:20]  # each pass over b is reshuffled


def test_a_resumed_mixture_continues_the_same_sequence():
    """The saved data position (epoch, index) is the sampler's whole state: a fresh Batches placed there
    draws exactly what the uninterrupted one draws, across the epoch boundary too."""
    data = _mixture(30, 50)
    whole = Batches(data, batch_size=4, grad_accum=2, shuffle=True, seed=9, weights=(1, 3))
    drawn = [_rows(whole.next_step()) for _ in range(25)]  # 10 steps per epoch: crosses two boundaries
    for stop in (3, 10, 17):
        replay = Batches(data, batch_size=4, grad_accum=2, shuffle=True, seed=9, weights=(1, 3))
        for _ in range(stop):
            replay.next_step()
        resumed = Batches(data, batch_size=4, grad_accum=2, shuffle=True, seed=9, weights=(1, 3))
        resumed.position = DataPosition(replay.position.epoch, replay.position.index)
        assert [_rows(resumed.next_step()) for _ in range(25 - stop)] == drawn[stop:]


def test_without_weights_several_sources_are_one_pool():
    rows = _drawn(Batches(_mixture(10, 30), 4, 1, shuffle=True, seed=1), 10)
    assert sorted(rows) == list(range(40))


def test_weights_must_match_the_sources():
    with pytest.raises(UserError, match=r"--data-weights gives 3 weight\(s\) for 2 --data source\(s\)"):
        Batches(_mixture(10, 10), 2, 1, shuffle=True, seed=0, weights=(1, 2, 3))
