"""The step schedule's cost does not grow with the micro-batch count (slide_hf/planner/step_schedule.py, Note
[Micro-batches in steady state]): against a plain micro-batch-by-micro-batch reference of the same order, the
same step to 1e-9 for 1 to 6 micro-batches and past the point where it jumps ahead; a billion micro-batches in
well under a second."""

from __future__ import annotations

import heapq
import random
import time

import pytest

from slide_hf.planner.step_schedule import H2D_BESIDE_HOST, ScheduleRates, UnitWork, _host_updates, simulate_step


def _reference_step(units: list[UnitWork], rates: ScheduleRates) -> float:
    """The engine's order simulated one micro-batch at a time over four steps, the last one's duration: the
    schedule as it was before it jumped over repeating micro-batches."""
    free = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0}

    def run(server: str, ready: float, seconds: float) -> float:
        free[server] = max(free[server], ready) + seconds
        return free[server]

    def copy_in(ready: float, size: float) -> float:
        start = max(free["h2d"], ready)
        slow_rate = rates.h2d * H2D_BESIDE_HOST
        slow_s = min(max(0.0, free["host"] - start), size / slow_rate)
        free["h2d"] = start + slow_s + (size - slow_s * slow_rate) / rates.h2d
        return free["h2d"]

    slots = [0.0] * rates.block_slots
    updated = {u.name: 0.0 for u in units}
    sliding = [u for u in units if u.placement != "resident" and u.is_block]
    kept = {u.name for u in sliding[-rates.block_slots :]}
    share = rates.both_ways_share
    ends = []
    for _ in range(4):
        for micro in range(rates.micro_batches):
            last = micro == rates.micro_batches - 1
            loaded = {}
            for unit in units:
                ready = 0.0
                if unit.placement != "resident":
                    slot = heapq.heappop(slots) if unit.is_block else 0.0
                    ready = loaded[unit.name] = copy_in(max(updated[unit.name], slot), unit.load_bytes)
                end = run("compute", ready, unit.forward_s)
                if unit.placement != "resident" and unit.is_block and unit.name not in kept:
                    heapq.heappush(slots, end)
            streamed_done: list[float] = []
            jobs = []
            for position, unit in reversed(list(enumerate(units))):
                ready = 0.0
                if unit.placement == "streamed":
                    sets = rates.staging_sets
                    set_free = streamed_done[-sets] if len(streamed_done) >= sets else 0.0
                    slot = heapq.heappop(slots) if unit.is_block and unit.name not in kept else 0.0
                    ready = run("h2d", max(set_free, slot), unit.stage_bytes / (rates.h2d * share))
                elif unit.placement != "resident" and unit.loads_in_backward and unit.name not in kept:
                    slot = heapq.heappop(slots) if unit.is_block else 0.0
                    ready = run("h2d", slot, unit.load_bytes / (rates.h2d * share))
                elif unit.name in loaded:
                    ready = loaded[unit.name]
                released = computed = run("compute", ready, unit.backward_s)
                if unit.placement in ("resident", "streamed"):
                    if last:
                        released = updated[unit.name] = run("compute", computed, unit.update_s)
                        if unit.placement == "streamed":
                            back = run("d2h", released, unit.writeback_bytes / (rates.d2h * share))
                            streamed_done.append(back)
                            updated[unit.name] = back
                else:
                    released = run("d2h", computed, unit.grad_bytes / (rates.d2h * share))
                    jobs.append((position, released, unit.update_s if last else unit.accumulate_s))
                if unit.placement != "resident" and unit.is_block:
                    heapq.heappush(slots, released)
            done = _host_updates(jobs, free["host"])
            free["host"] = max(done.values(), default=free["host"])
            if last:
                for position, finished in done.items():
                    updated[units[position].name] = finished
        ends.append(free["compute"])
    return ends[-1] - ends[-2]


def _shape(seed: int) -> tuple[list[UnitWork], dict[str, float]]:
    """Blocks of every placement with random costs, an embedding and a head around them half the time, and
    random link rates and buffer counts."""
    r = random.Random(seed)
    units = [
        UnitWork(
            name=f"block.{i}",
            placement=r.choice(["host", "host", "streamed", "resident"]),
            numel=1000,
            forward_s=r.uniform(0.1, 2.0),
            backward_s=r.uniform(0.2, 5.0),
            load_bytes=r.uniform(0.0, 5.0),
            grad_bytes=r.uniform(0.0, 5.0),
            update_s=r.uniform(0.0, 8.0),
            stage_bytes=r.uniform(0.0, 4.0),
            writeback_bytes=r.uniform(0.0, 4.0),
            accumulate_s=r.uniform(0.0, 4.0) if r.random() < 0.8 else 0.0,
        )
        for i in range(r.randint(1, 8))
    ]
    if r.random() < 0.5:
        ends = [
            UnitWork(
                name=name,
                placement=r.choice(["host", "resident"]),
                numel=10,
                forward_s=forward_s,
                backward_s=0.0,
                load_bytes=r.uniform(0.0, 3.0),
                grad_bytes=r.uniform(0.0, 3.0),
                update_s=r.uniform(0.0, 3.0),
                accumulate_s=r.uniform(0.0, 2.0),
                is_block=False,
                loads_in_backward=False,
            )
            for name, forward_s in (("embedding", 0.0), ("head", r.uniform(0.0, 2.0)))
        ]
        units = [ends[0], *units, ends[1]]
    rates = {
        "h2d": r.uniform(0.5, 4.0),
        "d2h": r.uniform(0.5, 4.0),
        "duplex": r.uniform(1.0, 6.0),
        "block_slots": r.randint(1, 4),
        "staging_sets": r.randint(2, 3),
    }
    return units, rates


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 5, 6])
def test_few_micro_batches_match_the_micro_batch_loop(seed, micro_batches):
    units, rates = _shape(seed)
    rates_n = ScheduleRates(micro_batches=micro_batches, **rates)  # type: ignore[arg-type]
    assert simulate_step(units, rates_n) == pytest.approx(_reference_step(units, rates_n), rel=1e-9, abs=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_many_micro_batches_match_the_micro_batch_loop(seed):
    """Past the first few micro-batches the schedule jumps over the repeating ones (and over a cycle of two
    that alternate): the step is still the loop's."""
    units, rates = _shape(seed)
    for micro_batches in (17, 64, 301):
        rates_n = ScheduleRates(micro_batches=micro_batches, **rates)  # type: ignore[arg-type]
        assert simulate_step(units, rates_n) == pytest.approx(_reference_step(units, rates_n), rel=1e-9, abs=0)


@pytest.mark.timeout(60)
def test_a_billion_micro_batches_take_under_a_second():
    """Linear in the micro-batch count, 1e9 never ended; each shape here is simulated in milliseconds."""
    for seed in SEEDS:
        units, rates = _shape(seed)
        few = simulate_step(units, ScheduleRates(micro_batches=1000, **rates))  # type: ignore[arg-type]
        started = time.perf_counter()
        many = simulate_step(units, ScheduleRates(micro_batches=10**9, **rates))  # type: ignore[arg-type]
        assert time.perf_counter() - started < 1.0
        # the step grows with the micro-batches, by the same time each once they repeat
        assert many / 10**9 == pytest.approx(few / 1000, rel=1e-2)
