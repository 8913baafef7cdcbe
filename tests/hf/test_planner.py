"""The planner: its arithmetic on toy shapes, its host numbers against a real engine, and HF presets."""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys

import psutil
import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel
from slide_hf.errors import UserError
from slide_hf.planner import (
    CUDA_CONTEXT_BYTES,
    ENGINE_HOST_BUFFERS,
    PROCESS_BASELINE_BYTES,
    Bandwidths,
    ModelShape,
    PlanInputs,
    available_host_bytes,
    check_fits,
    format_bytes,
    largest_batch,
    make_plan,
    parse_size,
)
from slide_hf.planner.unit_costs import HOST_ADAM_IN_STEP

MiB, GiB = 1 << 20, 1 << 30


def _toy(tied: bool = False, layers: int = 4) -> ToyModel:
    return ToyModel(
        ToyConfig(
            vocab_size=8192,
            hidden_size=512,
            num_heads=8,
            intermediate_size=1536,
            num_layers=layers,
            tie_embeddings=tied,
        )
    )


# ---- model shape ------------------------------------------------------------------------------------
def test_shape_of_toy_model_reads_units_and_config():
    model = _toy(tied=True)
    shape = ModelShape.of(model)
    assert shape.unit_numels == tuple(u.layout.numel for u in model.units)
    assert shape.total_numel == sum(u.layout.numel for u in model.units)
    assert shape.params == sum(u.layout.param_numel for u in model.units)
    assert shape.tied and shape.num_blocks == 4
    assert (shape.hidden_size, shape.num_heads, shape.head_dim, shape.kv_dim) == (512, 8, 64, 512)
    assert (shape.intermediate_size, shape.vocab_size) == (1536, 8192)
    assert shape.head_numel == 512  # a tied head owns only its norm


def test_plan_accepts_a_model_or_its_shape():
    model = _toy()
    assert make_plan(PlanInputs(model)).to_dict() == make_plan(PlanInputs(ModelShape.of(model))).to_dict()


# ---- host arithmetic --------------------------------------------------------------------------------
@pytest.mark.parametrize(("tied", "accum"), [(False, 1), (True, 1), (False, 3)])
def test_host_breakdown_formulas(tied, accum):
    shape = ModelShape.of(_toy(tied=tied))
    inputs = PlanInputs(shape, batch_size=3, seq_len=100, grad_accum=accum, transfer_chunk_numel=4096)
    host = make_plan(inputs).host_breakdown
    n = shape.total_numel
    assert host["master_fp32"] == 4 * n
    assert host["optimizer_state"] == 8 * n
    expected_accum = n if accum > 1 else (shape.embedding_numel if tied else 0)
    assert host["grad_accumulators"] == 4 * expected_accum
    ring_chunks = max(4, math.ceil(EngineConfig().grad_ring_fraction * n / 4096))  # EngineConfig.ring_slots
    assert host["grad_ring"] == ring_chunks * 4096 * 2
    assert host["activation_stash"] == 4 * 3 * 100 * 512 * 2
    assert host["optimizer_scratch"] == TorchAdamW(AdamWConfig()).host_scratch_bytes(4096)  # its own report
    assert host["nvme_staging"] == 0 and host["process_baseline"] == PROCESS_BASELINE_BYTES
    assert make_plan(inputs).host_peak_bytes == sum(host.values())


def test_nvme_offload_moves_state_and_stash_to_disk():
    shape = ModelShape.of(_toy())
    ram = make_plan(PlanInputs(shape, batch_size=2, seq_len=64))
    half = make_plan(PlanInputs(shape, batch_size=2, seq_len=64, offload_optimizer="nvme", nvme_fraction=0.5))
    # 6 units, half of them (3 blocks, in index order) keep m and v on disk
    moved = 8 * sum(shape.block_numels[:3])
    assert half.disk_bytes == moved
    assert half.host_breakdown["optimizer_state"] == ram.host_breakdown["optimizer_state"] - moved
    assert half.host_breakdown["nvme_staging"] == 2 * 8 * shape.max_block_numel
    stash = ram.host_breakdown["activation_stash"]
    acts = make_plan(PlanInputs(shape, batch_size=2, seq_len=64, offload_activations="nvme"))
    assert acts.host_breakdown["activation_stash"] == 0 and acts.disk_bytes == stash
    assert acts.host_breakdown["nvme_staging"] == 2 * stash // shape.num_blocks
    everything = make_plan(PlanInputs(shape, offload_optimizer="nvme", nvme_fraction=1.0))
    assert everything.host_breakdown["optimizer_state"] == 0 and everything.disk_bytes == 8 * shape.total_numel
    # device-resident units keep their state on the GPU, never on disk (slide_hf.offload's rule)
    placed = make_plan(
        PlanInputs(shape, batch_size=2, seq_len=64, offload_optimizer="nvme", nvme_fraction=0.5,
                   resident_units=("block.0", "embedding"))
    )  # fmt: skip
    assert placed.disk_bytes == 8 * sum(shape.block_numels[1:3])
    assert placed.host_breakdown["optimizer_state"] >= 0


# ---- GPU arithmetic ---------------------------------------------------------------------------------
def test_gpu_breakdown_and_phases():
    shape = ModelShape.of(_toy())
    plan = make_plan(PlanInputs(shape, batch_size=4, seq_len=256, block_slots=3))
    gpu = plan.gpu_breakdown
    assert gpu["block_slots"] == 3 * 2 * shape.max_block_numel * 2
    assert gpu["embedding_slot"] == 2 * shape.embedding_numel * 2
    assert gpu["head_slot"] == 2 * shape.head_numel * 2
    assert gpu["activation_buffers"] == 2 * 4 * 256 * 512 * 2
    assert gpu["cuda_context"] == CUDA_CONTEXT_BYTES
    assert gpu["workspace"] == max(plan.gpu_phases.values()) == plan.gpu_phases[plan.gpu_peak_phase]
    assert plan.gpu_peak_bytes == sum(gpu.values())
    assert set(plan.gpu_phases) == {"forward", "head", "backward", "embedding_backward"}


class _ReportsScratch(TorchAdamW):
    """An optimizer whose device replica says it needs an odd number of scratch bytes."""

    def device_replica(self) -> _ReportsScratch:
        return _ReportsScratch(self.config)

    def device_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False) -> int:
        return 12345 * (2 if corrects else 1) + max_range_numel % 7


@pytest.mark.parametrize("state_format", ["fp32", "bf16", "int8"])
def test_resident_units_add_their_optimizers_scratch_to_the_gpu_peak(state_format: str):
    """Resident units put the update's scratch on the GPU peak: exactly what the run's optimizer's device
    replica reports for its largest unit, never the planner's own arithmetic."""
    from slide_core.optim.compact_adamw import CompactAdamW

    shape = ModelShape.of(_toy())
    config = AdamWConfig(state_format=state_format)
    optimizer = TorchAdamW(config) if state_format == "fp32" else CompactAdamW(config, fused=False, chunk_numel=64 * 99)
    inputs = PlanInputs(shape, batch_size=2, seq_len=128, optimizer_state=state_format, optimizer=optimizer)
    sliding = make_plan(inputs)
    resident = make_plan(dataclasses.replace(inputs, resident_units=("embedding", "block.1")))
    scratch = optimizer.device_replica().device_scratch_bytes(shape.embedding_numel)
    assert scratch > 0 and sliding.gpu_breakdown["resident_scratch"] == 0
    assert resident.gpu_breakdown["resident_scratch"] == scratch
    grown = resident.gpu_breakdown["resident_units"] - sliding.gpu_breakdown["embedding_slot"] + scratch
    assert resident.gpu_peak_bytes - sliding.gpu_peak_bytes == grown
    # with clipping, the correction's scratch (the optimizer's) and the pipeline's scaled gradient piece
    clipped = make_plan(dataclasses.replace(inputs, resident_units=("embedding",), max_grad_norm=1.0))
    corrects = optimizer.device_replica().device_scratch_bytes(shape.embedding_numel, corrects=True)
    piece = 4 * min(shape.embedding_numel, inputs.transfer_chunk_numel)
    assert clipped.gpu_breakdown["resident_scratch"] == corrects + piece
    # one source: whatever the optimizer says is what the plan holds
    odd = dataclasses.replace(inputs, resident_units=("block.2",), optimizer=_ReportsScratch(AdamWConfig()))
    assert make_plan(odd).gpu_breakdown["resident_scratch"] == 12345 + shape.block_numels[2] % 7


def test_resident_scratch_is_what_the_engine_allocates():
    """Real engine steps on the CPU device with a resident embedding (bigger than a chunk) and bf16
    moments: the peak the resident updates allocate (counted op by op) is the plan's
    ``resident_scratch``, and the unit's device buffers its ``resident_units``, to the byte."""
    from slide_core.alloc_counter import AllocationCounter
    from slide_core.optim.compact_adamw import CompactAdamW
    from slide_hf import PRESETS, build_model, init_random

    hf_config = PRESETS["test-llama-untied"]()
    model = build_model(hf_config)
    optimizer = CompactAdamW(AdamWConfig(state_format="bf16", weight_decay=0.1), fused=False, chunk_numel=64 * 10)
    assert model.embedding.layout.numel > 3 * optimizer.chunk_numel  # updated in several chunks
    counter = AllocationCounter()
    replica = optimizer.device_replica()
    plain_step = replica.step

    def counted_step(*args, **kwargs):
        with counter:
            plain_step(*args, **kwargs)

    replica.step = counted_step
    optimizer.device_replica = lambda: replica
    config = EngineConfig(compute_dtype=torch.bfloat16, transfer_chunk_numel=4096, resident_units=("embedding",))
    with CPUDevice() as device:
        host = HostParameters(model)
        init_random(model, host, hf_config, seed=0)
        with Engine(model, device, host, optimizer, config) as engine:
            for seed in range(2):
                ids = torch.randint(0, hf_config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
                engine.step([(ids, ids.clone())], lr=1e-3)
            resident_bytes = engine.residents.device_bytes
    inputs = PlanInputs(model, seq_len=16, resident_units=("embedding",), optimizer_state="bf16", optimizer=optimizer)
    plan = make_plan(inputs)
    assert counter.peak_bytes > 0
    assert counter.peak_bytes == plan.gpu_breakdown["resident_scratch"]
    # the unit itself, with its moments stored as bf16 (12 bytes/param with bf16 compute, not 16)
    assert resident_bytes == plan.gpu_breakdown["resident_units"] == 12 * model.embedding.layout.numel


def test_peaks_grow_with_batch_and_max_batch_is_tight():
    shape = ModelShape.of(_toy())
    peaks = [make_plan(PlanInputs(shape, batch_size=b, seq_len=512)) for b in (1, 2, 8, 32)]
    assert all(a.gpu_peak_bytes < b.gpu_peak_bytes for a, b in itertools.pairwise(peaks))
    assert all(a.host_peak_bytes < b.host_peak_bytes for a, b in itertools.pairwise(peaks))
    cap = 2 * GiB
    plan = make_plan(PlanInputs(shape, seq_len=512, gpu_memory_bytes=cap))
    best = plan.max_batch_size
    assert best and plan.max_batch_limit == "gpu"
    assert make_plan(PlanInputs(shape, batch_size=best, seq_len=512)).gpu_peak_bytes <= cap
    assert make_plan(PlanInputs(shape, batch_size=best + 1, seq_len=512)).gpu_peak_bytes > cap
    assert make_plan(PlanInputs(shape)).max_batch_size is None  # no cap, no answer
    host_bound = make_plan(PlanInputs(shape, seq_len=512, gpu_memory_bytes=cap, host_memory_bytes=GiB + 300 * MiB))
    assert host_bound.max_batch_limit == "host" and host_bound.max_batch_size < best
    too_small = largest_batch(PlanInputs(shape), gpu_cap=CUDA_CONTEXT_BYTES, host_cap=None)
    assert too_small == (0, "gpu")


# ---- time -------------------------------------------------------------------------------------------
def test_compute_time_counts_recompute_and_attention():
    shape = ModelShape.of(_toy())
    bw = Bandwidths(gpu_tflops=1.0)
    plan = make_plan(PlanInputs(shape, batch_size=2, seq_len=128, grad_accum=2, bandwidths=bw))
    tokens = 2 * 128 * 2
    per_token = 8 * shape.block_params + 6 * 8192 * 512 + 8 * 4 * 128 * 512
    assert plan.tokens_per_step == tokens
    assert plan.flops_per_step == tokens * per_token
    assert plan.compute_s == pytest.approx(tokens * per_token / 1e12)


def test_binding_limit_follows_the_slowest_pipeline():
    shape = ModelShape.of(_toy())
    base = PlanInputs(shape, batch_size=8, seq_len=512)
    slow = {
        "gpu compute": Bandwidths(gpu_tflops=0.001),
        "pcie": Bandwidths(h2d_gbps=0.001),
        "cpu": Bandwidths(cpu_adam_gparams=0.0001),
    }
    for name, bw in slow.items():
        plan = make_plan(dataclasses.replace(base, bandwidths=bw))
        # the binding limit is the largest resource line (of PCIe's three, whichever the link binds)
        assert plan.binding.startswith(name) and plan.binding == max(plan.resource_s, key=plan.resource_s.get)
        assert plan.resource_bound_s == max(plan.compute_s, plan.pcie_s, plan.update_s, plan.disk_s)
        # One resource a thousand times slower than the rest: the schedule's step is that resource's time
        # (the host optimizer's at its busy rate, HOST_ADAM_BUSY_SHARE, not HOST_ADAM_IN_STEP's average).
        assert plan.step_time_s == pytest.approx(plan.resource_bound_s, rel=0.1)
    nvme = make_plan(dataclasses.replace(base, offload_optimizer="nvme", bandwidths=Bandwidths(disk_gbps=0.001)))
    assert nvme.binding == "nvme" and nvme.disk_s == pytest.approx(16 * shape.total_numel / 1e6)


def test_update_time_and_pcie_bytes():
    shape = ModelShape.of(_toy())
    bw = Bandwidths(h2d_gbps=1.0, d2h_gbps=1000.0, cpu_adam_gparams=0.001, host_mem_gbps=1e6, pcie_duplex_gbps=1e6)
    plan = make_plan(PlanInputs(shape, batch_size=1, seq_len=8, block_slots=2, bandwidths=bw))
    assert plan.update_s == pytest.approx(shape.total_numel / (1e6 * HOST_ADAM_IN_STEP))
    loads = shape.embedding_numel + shape.head_numel + (2 * 4 - 2) * shape.max_block_numel
    stash = 4 * 1 * 8 * 512 * 2
    assert plan.pcie_s == pytest.approx((4 * loads + stash) / 1e9)


def test_overlap_rises_with_batch_and_critical_batch_is_where_it_reaches_one():
    shape = ModelShape.of(_toy())
    bw = Bandwidths(gpu_tflops=50.0)
    overlaps = [make_plan(PlanInputs(shape, batch_size=b, seq_len=256, bandwidths=bw)).overlap for b in (1, 2, 4)]
    assert overlaps[0] < overlaps[1] < overlaps[2]
    critical = make_plan(PlanInputs(shape, seq_len=256, bandwidths=bw)).critical_batch_size
    assert critical is not None and critical > 1
    assert make_plan(PlanInputs(shape, batch_size=critical, seq_len=256, bandwidths=bw)).overlap >= 1
    assert make_plan(PlanInputs(shape, batch_size=critical - 1, seq_len=256, bandwidths=bw)).overlap < 1


# ---- fitting and sizes ------------------------------------------------------------------------------
def test_check_fits_messages_name_the_fix():
    shape = ModelShape.of(_toy())
    plan = make_plan(PlanInputs(shape, batch_size=64, seq_len=1024))
    check_fits(plan, host_available=None, gpu_available=None)
    check_fits(plan, host_available=plan.host_peak_bytes, gpu_available=plan.gpu_peak_bytes)
    cap = plan.gpu_peak_bytes // 2
    best, _ = largest_batch(plan.inputs, gpu_cap=cap, host_cap=None)
    with pytest.raises(UserError, match=rf"GPU memory, .* allowed by --gpu-memory; .*largest that fits: {best}\)"):
        check_fits(plan, host_available=None, gpu_available=cap)
    # m and v are 2/3 of the model's host bytes: moving just enough of them to NVMe is the first thing to try
    need = plan.host_peak_bytes - plan.host_breakdown["optimizer_state"] // 2
    with pytest.raises(
        UserError, match=r"host RAM, .* available; try --offload-optimizer nvme --nvme-fraction "
    ) as info:
        check_fits(plan, host_available=need, gpu_available=None)
    assert "\n" not in str(info.value)
    fraction = float(str(info.value).split("--nvme-fraction ")[1].split(";")[0])
    assert 0.4 <= fraction < 1.0
    for suggested, fits in ((fraction, True), (fraction - 0.05, False)):
        trial = make_plan(dataclasses.replace(plan.inputs, offload_optimizer="nvme", nvme_fraction=suggested))
        assert (trial.host_peak_bytes <= need) is fits
    with pytest.raises(UserError, match="use a machine with more RAM"):
        check_fits(plan, host_available=GiB, gpu_available=None)
    with pytest.raises(UserError, match=r"GPU memory.*; also needs .* host RAM"):
        check_fits(plan, host_available=GiB, gpu_available=cap)


def test_a_compact_state_that_fits_in_ram_is_offered_beside_the_exact_fix():
    """Where bf16 or int8 Adam state alone would fit the host, the line says so after the NVMe fix (which
    keeps the math exact); the first such format is named, and none where the run's format is already the
    most compact or none fits."""
    shape = ModelShape.of(_toy())
    plan = make_plan(PlanInputs(shape, batch_size=8, seq_len=256))
    bf16 = make_plan(PlanInputs(shape, batch_size=8, seq_len=256, optimizer_state="bf16")).host_peak_bytes
    int8 = make_plan(PlanInputs(shape, batch_size=8, seq_len=256, optimizer_state="int8")).host_peak_bytes
    assert int8 < bf16 < plan.host_peak_bytes
    for available, offered in ((bf16, "bf16"), (int8, "int8"), (int8 - 1, None)):
        with pytest.raises(UserError) as info:
            check_fits(plan, host_available=available, gpu_available=None)
        message = str(info.value)
        if offered is None:
            assert "--optimizer-state" not in message
            continue
        assert message.endswith(f"--optimizer-state {offered} (rounded moments, not exact: docs/optimizer_state.md)")
        exact = "try --offload-optimizer nvme --nvme-fraction"
        if exact in message:  # the exact fix first
            assert message.index(exact) < message.index("; or, in RAM, --optimizer-state")
        else:
            assert "use a machine with more RAM, or try --optimizer-state" in message
    compact = make_plan(PlanInputs(shape, batch_size=8, seq_len=256, optimizer_state="bf16"))
    with pytest.raises(UserError) as info:
        check_fits(compact, host_available=int8, gpu_available=None)
    assert str(info.value).endswith("--optimizer-state int8 (rounded moments, not exact: docs/optimizer_state.md)")


def test_the_compact_state_offer_prices_that_state_when_the_plan_holds_the_runs_optimizer():
    """`slide plan` and `slide train` plan with the run's optimizer (``PlanInputs.optimizer``), whose state
    arrays are the fp32 ones: the offer must price the compact format's own arrays, not those."""
    from slide_core.optim import AdamWConfig, build_optimizer

    shape = ModelShape.of(_toy())
    fp32 = build_optimizer("torch-adamw", AdamWConfig(state_format="fp32"), warmup=False)
    plan = make_plan(PlanInputs(shape, batch_size=8, seq_len=256, optimizer=fp32))
    bf16 = make_plan(PlanInputs(shape, batch_size=8, seq_len=256, optimizer_state="bf16")).host_peak_bytes
    assert bf16 < plan.host_peak_bytes
    with pytest.raises(UserError) as info:
        check_fits(plan, host_available=bf16, gpu_available=None)
    assert str(info.value).endswith("--optimizer-state bf16 (rounded moments, not exact: docs/optimizer_state.md)")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("24GiB", 24 * GiB),
        ("24G", 24 * GiB),
        ("24", 24 * GiB),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * MiB),
        ("512m", 512 * MiB),
        ("1.5 gib", 3 * GiB // 2),
        ("4096B", 4096),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text", ["", "lots", "24XB", "-1GB", "0", "GiB", "nanGiB", "infGiB", "1e400", "99999999999TiB"]
)
def test_parse_size_rejects_and_names_the_value(text):
    with pytest.raises(UserError, match=rf"--gpu-memory: .*{text!r}"):
        parse_size(text, what="--gpu-memory")


def test_bad_inputs_are_user_errors():
    shape = ModelShape.of(_toy())
    with pytest.raises(UserError, match="--batch-size"):
        PlanInputs(shape, batch_size=0)
    with pytest.raises(UserError, match="--nvme-fraction"):
        PlanInputs(shape, nvme_fraction=1.5)
    with pytest.raises(UserError, match="--offload-optimizer"):
        PlanInputs(shape, offload_optimizer="tape")  # type: ignore[arg-type]


def test_format_bytes_and_available_host_bytes():
    assert format_bytes(30.1 * GiB) == "30.1 GiB" and format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(100) == "100 B"
    assert 0 <= available_host_bytes() < psutil.virtual_memory().available


# ---- against the real engine ------------------------------------------------------------------------
def _engine_measure(model: ToyModel, inputs: PlanInputs, config: EngineConfig) -> tuple[dict[str, int], int]:
    """Run 2 steps; return the engine's host buffers (by planner key) and the RSS growth meanwhile."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    steps = [
        [
            (ids, ids.clone())
            for ids in (
                torch.randint(0, vocab, (inputs.batch_size, inputs.seq_len), generator=generator)
                for _ in range(inputs.grad_accum)
            )
        ]
        for _ in range(2)
    ]
    process = psutil.Process()
    before = process.memory_info().rss
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        model.init_({unit.name: host.views(unit) for unit in model.units}, seed=0)
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
            for micro in steps:
                engine.step(micro, lr=1e-3)
            engine.drain()
            grown = process.memory_info().rss - before
            actual = {
                "master_fp32": host.nbytes,
                "updates": engine.host_state.host_bytes,  # optimizer state + gradient accumulators
                "grad_ring": engine.transfer.ring.nbytes,
                "activation_stash": engine.stash.host_bytes,
            }
    return actual, grown


def _engine_setup(tied: bool, accum: int) -> tuple[ToyModel, PlanInputs, EngineConfig]:
    model = _toy(tied=tied)
    chunk = 1 << 20
    config = EngineConfig(block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=chunk, grad_ring_slots=4)
    inputs = PlanInputs(
        model,
        batch_size=2,
        seq_len=64,
        grad_accum=accum,
        compute_dtype_bytes=4,
        block_slots=2,
        transfer_chunk_numel=chunk,
        grad_ring_slots=4,
    )
    return model, inputs, config


@pytest.mark.parametrize(("tied", "accum"), [(False, 1), (True, 2)])
def test_planned_host_buffers_match_the_engine(tied, accum):
    model, inputs, config = _engine_setup(tied, accum)
    host = make_plan(inputs).host_breakdown
    predicted = {
        "master_fp32": host["master_fp32"],
        "updates": host["optimizer_state"] + host["grad_accumulators"],
        "grad_ring": host["grad_ring"],
        "activation_stash": host["activation_stash"],
    }
    actual, _ = _engine_measure(model, inputs, config)
    for key, value in actual.items():
        assert predicted[key] == pytest.approx(value, rel=0.01), key
    assert sum(predicted.values()) == pytest.approx(sum(actual.values()), rel=0.01)
    assert set(ENGINE_HOST_BUFFERS) <= set(host)


_RSS_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import torch
from test_planner import _engine_measure, _engine_setup
from slide_core.engine import EngineConfig
from slide_core.testing import ToyConfig, ToyModel
from slide_hf.planner import PlanInputs, make_plan

warm = ToyModel(ToyConfig())  # pays torch's one-time kernel and thread-pool setup before measuring
_engine_measure(warm, PlanInputs(warm, seq_len=16), EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=4096))
model, inputs, config = _engine_setup(False, 1)
_, grown = _engine_measure(model, inputs, config)
print(json.dumps({{"grown": grown}}))
"""


@pytest.mark.slow  # a fresh Python process: seconds of imports
def test_rss_growth_stays_within_the_plan():
    """In a fresh process (freed memory of earlier tests would hide growth): the RSS a real engine adds
    over 2 steps is at least the big slabs and at most the plan plus allocator slack."""
    import json
    from pathlib import Path

    script = _RSS_SCRIPT.format(here=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    grown = json.loads(out.stdout.strip().splitlines()[-1])["grown"]
    _, inputs, _ = _engine_setup(False, 1)
    plan = make_plan(inputs)
    host = plan.host_breakdown
    # The CPU device keeps its "GPU" slots and workspaces in host RAM too, so the growth is bounded by the
    # engine's host buffers plus the device side (without a CUDA context), plus allocator slack.
    device_side = plan.gpu_peak_bytes - CUDA_CONTEXT_BYTES
    assert grown <= plan.engine_host_bytes + device_side + 64 * MiB, format_bytes(grown)
    assert grown >= 0.8 * (host["master_fp32"] + host["optimizer_state"]), format_bytes(grown)


@pytest.mark.slow  # a fresh Python process: seconds of imports
def test_process_baseline_covers_a_fresh_training_process():
    """PROCESS_BASELINE_BYTES is measured here: a new interpreter with torch, transformers, the engine and
    a built (meta-device) model, before any engine buffer."""
    code = (
        "import psutil, torch, transformers, slide_core.engine, slide_core.optim;"
        "from slide_hf import build_model, resolve_model;"
        "build_model(resolve_model('tiny-llama')[0]);"
        "print(psutil.Process().memory_info().rss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    rss = int(out.stdout.strip().splitlines()[-1])
    assert PROCESS_BASELINE_BYTES / 8 < rss <= PROCESS_BASELINE_BYTES, format_bytes(rss)


# ---- HF presets -------------------------------------------------------------------------------------
def test_llama31_8b_shape_and_plan():
    pytest.importorskip("transformers")
    from slide_hf import build_model, resolve_model

    shape = ModelShape.of(build_model(resolve_model("llama3.1-8b")[0]))
    assert shape.params == 8_030_261_248 and not shape.tied
    assert (shape.hidden_size, shape.kv_dim, shape.intermediate_size, shape.vocab_size) == (4096, 1024, 14336, 128256)
    assert shape.num_blocks == 32 and shape.head_dim == 128
    plan = make_plan(PlanInputs(shape, batch_size=8, seq_len=2048))
    # fp32 master + m + v: 12 B per (padded) parameter
    assert plan.host_breakdown["master_fp32"] + plan.host_breakdown["optimizer_state"] == 12 * shape.total_numel
    assert 8 * GiB < plan.gpu_peak_bytes < 16 * GiB
    assert plan.gpu_peak_phase == "backward"
    assert math.isclose(plan.flops_per_step / plan.tokens_per_step / shape.params, 8, rel_tol=0.15)


def test_tied_preset_gets_an_embedding_accumulator():
    pytest.importorskip("transformers")
    from slide_hf import build_model, resolve_model

    shape = ModelShape.of(build_model(resolve_model("tiny-llama")[0]))
    assert shape.tied and shape.vocab_size == 32000
    plan = make_plan(PlanInputs(shape, batch_size=1, seq_len=128))
    assert plan.host_breakdown["grad_accumulators"] == 4 * shape.embedding_numel
