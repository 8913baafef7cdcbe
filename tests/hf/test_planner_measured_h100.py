"""The planner's step time against steps measured on an H100 host (16 cores, 125.8 GiB, PCIe 5), batch
16 x 1024, with the rates ``slide doctor`` measured there and the units each run kept resident or streamed
(docs/benchmarks.md, "Where each unit's update runs", call 5).

These runs are what the step schedule (slide_hf/planner/step_schedule.py) was built against: every run
within 15 %, and the worst run closer than the busiest resource alone put it.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_planner_measured_h200 import LLAMA_8B

from slide_hf.machine_rates import HostIdentity, MachineRates
from slide_hf.planner import ModelShape, PlanInputs, make_plan

GiB = 1 << 30

LLAMA_3B = ModelShape(
    embedding_numel=128_256 * 3072,
    block_numels=(100_669_440,) * 28,
    head_numel=3072,
    params=3_212_749_824,
    block_params=100_669_440 * 28,
    tied=True,
    hidden_size=3072,
    num_heads=24,
    head_dim=128,
    kv_dim=1024,
    intermediate_size=8192,
    vocab_size=128_256,
)

H100_DOCTOR = MachineRates(
    identity=HostIdentity("h100", "16 cores", "NVIDIA H100 80GB HBM3"),
    measured_at="2026-12-05",
    host_copy_gbps=80.0,
    host_triad_gbps=123.3,
    cpu_adam_gparams={"fp32": 7.66, "bf16": 9.31, "int8": 5.18},
    cpu_adam_split_gparams={"fp32": 6.46, "bf16": 5.93, "int8": 3.85},
    h2d_gbps=55.1,
    d2h_gbps=55.0,
    gpu_mem_gbps=2809.0,
    gpu_tflops=759.5,
    pcie_duplex_gbps=73.0,
).bandwidths()
"""`slide doctor` on that host, as planning reads it (the matmul rate times TRAINING_MATMUL_SHARE)."""

SPLIT_BF16 = {"master_format": "split", "optimizer_state": "bf16"}


def _inputs(shape: ModelShape, gib: int, **changes: object) -> PlanInputs:
    base = PlanInputs(shape, batch_size=16, seq_len=1024, bandwidths=H100_DOCTOR, gpu_memory_bytes=gib * GiB)
    return dataclasses.replace(base, staging_sets=2, **changes)  # the engine of those runs staged two sets


RUNS = {
    # name: (inputs, measured step seconds)
    "8b host fp32": (_inputs(LLAMA_8B, 24, resident_units=("embedding", "block.0")), 2.175),
    "8b host split bf16": (_inputs(LLAMA_8B, 24, resident_units=("embedding", "head", "block.0"), **SPLIT_BF16), 1.741),
    "8b every block streamed, split bf16": (
        _inputs(LLAMA_8B, 24, resident_units=("block.0",), streamed_units=tuple(f"block.{i}" for i in range(1, 32)),
                **SPLIT_BF16),
        2.634,
    ),
    "3b host split bf16": (_inputs(LLAMA_3B, 12, resident_units=("embedding", "head", "block.0"), **SPLIT_BF16), 0.776),
}  # fmt: skip


@pytest.mark.parametrize("run", sorted(RUNS))
def test_the_predicted_step_is_within_fifteen_percent_of_the_measured_one(run):
    inputs, measured_s = RUNS[run]
    plan = make_plan(inputs)
    assert plan.step_time_s == pytest.approx(measured_s, rel=0.15), plan.resource_s


def test_the_schedule_misses_the_worst_run_by_less_than_the_busiest_resource_did():
    def worst(predicted):
        return max(abs(predicted(inputs) / measured - 1) for inputs, measured in RUNS.values())

    schedule = worst(lambda inputs: make_plan(inputs).step_time_s)
    busiest = worst(lambda inputs: make_plan(inputs).resource_bound_s)
    assert schedule < busiest - 0.05
