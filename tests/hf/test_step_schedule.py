"""The step as a schedule (slide_hf/planner/step_schedule.py): each ordering rule on a case whose step time
can be worked out by hand, and the plan's step as the larger of the schedule and the resources."""

from __future__ import annotations

import dataclasses

import pytest

from slide_hf.planner import Bandwidths, PlanInputs, make_plan
from slide_hf.planner.step_schedule import H2D_BESIDE_HOST, ScheduleRates, UnitWork, _host_updates, simulate_step

FAST = 1e15
"""Bytes per second that make a transfer free."""


def _rates(**changes: object) -> ScheduleRates:
    base = ScheduleRates(h2d=FAST, d2h=FAST, duplex=2 * FAST, block_slots=2, staging_sets=3)
    return dataclasses.replace(base, **changes)


def _block(index: int, placement: str = "host", **changes: object) -> UnitWork:
    base = UnitWork(
        name=f"block.{index}",
        placement=placement,
        numel=1000,
        forward_s=1.0,
        backward_s=3.0,
        load_bytes=0.0,
        grad_bytes=0.0,
        update_s=0.0,
        stage_bytes=0.0,
        writeback_bytes=0.0,
    )
    return dataclasses.replace(base, **changes)


def test_with_free_transfers_and_updates_the_step_is_the_compute():
    units = [_block(i) for i in range(4)]
    assert simulate_step(units, _rates()) == pytest.approx(4 * (1.0 + 3.0))


def test_the_next_forward_waits_for_the_first_blocks_update():
    """One host block: its update (10 s) follows its backward and precedes its next load and forward."""
    units = [_block(0, update_s=10.0)]
    assert simulate_step(units, _rates()) == pytest.approx(1.0 + 3.0 + 10.0)


def test_the_host_updates_what_the_next_forward_needs_first():
    """Gradients land last block first; the optimizer takes the lowest forward position among those landed,
    switching to a newly landed one at once (it works a chunk at a time)."""
    done = _host_updates([(3, 0.0, 2.0), (2, 1.0, 2.0), (1, 1.5, 2.0)], free_at=0.0)
    # 0-1: block 3; 1-1.5: block 2; 1.5-3.5: block 1; 3.5-5: the rest of block 2; 5-6: the rest of block 3
    assert done == {1: pytest.approx(3.5), 2: pytest.approx(5.0), 3: pytest.approx(6.0)}


def test_the_forward_overlaps_the_updates_of_the_last_blocks():
    """Four blocks, each update 4 s against a 3 s backward. Gradients land at 3, 6, 9 and 12 s into the
    backward (block 3 first); each new one preempts, so block 0 is done at 16, and the 1 s left of each of
    blocks 1-3 is worked off while the one before runs forward: the step is the compute (16 s) and block
    0's 4 s. In landing order (block 3 first) block 0 would be done at 19 and the step 23."""
    units = [_block(i, update_s=4.0) for i in range(4)]
    assert simulate_step(units, _rates()) == pytest.approx(20.0)


def test_a_load_takes_a_free_slot():
    """One slot: a block's load waits for the previous block's compute; loads then never overlap compute."""
    units = [_block(i, load_bytes=2.0) for i in range(3)]
    one = simulate_step(units, _rates(h2d=1.0, block_slots=1))
    two = simulate_step(units, _rates(h2d=1.0, block_slots=2))
    assert one > two
    # One slot: the three forwards each after a 2 s load; the last block stays for its backward; the two
    # others reload.
    assert one == pytest.approx(3 * (2.0 + 1.0) + 3.0 + 2 * (2.0 + 3.0))


def test_a_streamed_unit_waits_for_a_free_staging_set():
    """Upload, backward and write-back 1 s each: with two sets each block's upload waits for the write-back of
    the block two before it, which ends with the previous block's backward, so the compute idles; with three
    the upload runs beside the previous backward."""
    units = [
        _block(i, "streamed", stage_bytes=1.0, writeback_bytes=1.0, backward_s=1.0, forward_s=0.1) for i in range(6)
    ]
    rates = _rates(h2d=1.0, d2h=1.0, duplex=2.0)
    two, three = (simulate_step(units, dataclasses.replace(rates, staging_sets=n)) for n in (2, 3))
    assert two > three + 1.0


def test_a_summed_streamed_unit_sends_its_earlier_gradients_and_stages_once():
    """Note [Streamed accumulation]: a streamed unit with several contributions is a host unit in the
    micro-batches before the last (its gradient out, 5 s a block on the d2h link here, and summed on the
    host) and stages master, moments and the sum in the last only: with gradients that heavy the earlier
    micro-batches are bound by the link, where a unit staged in every micro-batch never sends one."""
    summed = [
        _block(i, "streamed", stage_bytes=1.0, writeback_bytes=1.0, grad_bytes=5.0, accumulate_s=1.0, summed=True)
        for i in range(4)
    ]
    rates = _rates(h2d=1.0, d2h=1.0, duplex=2.0, micro_batches=3)
    once = simulate_step(summed, rates)
    every = simulate_step([dataclasses.replace(unit, summed=False) for unit in summed], rates)
    assert once > every + 1.0


def test_the_forward_loads_slow_down_while_the_host_optimizer_works():
    units = [_block(i, load_bytes=1.0, update_s=5.0) for i in range(2)]
    fast = simulate_step([dataclasses.replace(u, update_s=0.0) for u in units], _rates(h2d=1.0))
    slow = simulate_step(units, _rates(h2d=1.0))
    assert H2D_BESIDE_HOST < 1.0
    assert slow > fast


@pytest.mark.parametrize(
    "change", [{"h2d": 0.0}, {"duplex": -1.0}, {"block_slots": 0}, {"staging_sets": 0}, {"micro_batches": 0}]
)
def test_rates_that_cannot_be_are_refused(change):
    with pytest.raises(ValueError, match="schedule rates"):
        _rates(**change)


def test_an_infinite_link_makes_transfers_free():
    """A rate of inf (a link the plan need not price) is free, never a NaN step."""
    units = [_block(i, load_bytes=5.0, grad_bytes=5.0) for i in range(3)]
    assert simulate_step(units, _rates(h2d=float("inf"), d2h=float("inf"), duplex=float("inf"))) == pytest.approx(
        3 * (1.0 + 3.0)
    )


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match=r"block\.0: placement must be one of host, streamed, resident"):
        _block(0, "disk")


def test_the_plan_takes_the_larger_of_the_schedule_and_the_resources():
    from slide_core.testing import ToyConfig, ToyModel

    model = ToyModel(ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=768, num_layers=6))
    slow_host = Bandwidths(cpu_adam_gparams=0.01, host_mem_gbps=1000.0, h2d_gbps=50.0, d2h_gbps=50.0)
    plan = make_plan(PlanInputs(model, batch_size=4, seq_len=128, bandwidths=slow_host))
    # The schedule has the host optimizer in it (its idle start too); the other resources bound it.
    others = max(t for r, t in plan.resource_s.items() if r != "cpu")
    assert plan.step_time_s > others
    assert plan.resource_bound_s == max(plan.compute_s, plan.pcie_s, plan.update_s, plan.disk_s)
    assert plan.to_dict()["resource_bound_s"] == plan.resource_bound_s


def test_a_deferred_step_starts_the_host_updates_after_the_backward():
    """Note [Deferred steps]: the four blocks above, every step after one that clipped. No update starts
    before the backward ends (12 s into it); block 0's 4 s then gate its forward, block 1's the next, and so
    on: 4 x 4 s of updates, the last forward (1 s) and the backward (12 s), 29 s against 20 speculating."""
    units = [_block(i, update_s=4.0) for i in range(4)]
    assert simulate_step(units, _rates(), deferred=True) == pytest.approx(29.0)
    free = [_block(i) for i in range(4)]  # with free updates, waiting for the norm costs nothing
    assert simulate_step(free, _rates(), deferred=True) == pytest.approx(simulate_step(free, _rates()))


def test_a_plan_with_clipping_prices_the_steps_while_clipping_fires():
    """The deferred step waits for the whole backward before its host updates, so it is never shorter than
    the speculating one, and it is longer where the host optimizer has a backlog to hide."""
    from slide_core.testing import ToyConfig, ToyModel

    model = ToyModel(ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=768, num_layers=6))
    # The host optimizer's pass about half the GPU's compute: speculating, it hides behind the backward.
    slow_host = Bandwidths(cpu_adam_gparams=1.0, gpu_tflops=1.0, host_mem_gbps=1000.0, h2d_gbps=50.0, d2h_gbps=50.0)
    unclipped = make_plan(PlanInputs(model, batch_size=4, seq_len=128, bandwidths=slow_host))
    assert unclipped.clipped_step_time_s is None
    assert unclipped.expected_step_s([5.0, 5.0], 1.0) == unclipped.step_time_s
    plan = make_plan(PlanInputs(model, batch_size=4, seq_len=128, bandwidths=slow_host, max_grad_norm=1.0))
    assert plan.clipped_step_time_s is not None and plan.clipped_step_time_s > plan.step_time_s
    assert plan.to_dict()["clipped_step_time_s"] == plan.clipped_step_time_s
    # Each step is planned by the norm of the step before it: clipped (above 1) -> deferred.
    assert plan.expected_step_s([2.0, 2.0, 0.5], 1.0) == plan.clipped_step_time_s
    assert plan.expected_step_s([None, 0.5, 2.0], 1.0) == plan.step_time_s
    assert plan.expected_step_s([float("nan"), 0.999], 1.0) == plan.step_time_s  # a skipped step, one under
    assert plan.expected_step_s([2.0, 0.5], 1.0) == pytest.approx((plan.step_time_s + plan.clipped_step_time_s) / 2)
