"""GPU-streamed updates (slide_core/engine/streamed_pipeline.py) on the CPU device: the same math as plain
torch AdamW, and the same bits as the host placement with the same optimizer ops."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
from test_engine import _assert_close, _reference_run
from test_engine_clipping import RTOL, _assert_weights_and_state, _PoisonableToy
from test_engine_clipping import _engine_run as _clip_engine_run
from test_engine_clipping import _reference_run as _clip_reference

from slide_core import AdamWConfig, HostParameters, LRSchedule
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.engine.clip_strategy import ClipPolicy, SpeculativeClipping
from slide_core.engine.streamed_pipeline import StreamedPipeline
from slide_core.engine.update_staging import UpdateStaging
from slide_core.optim import TorchAdamW, build_optimizer
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optim.state_formats import state_arrays
from slide_core.testing import PinRecordingDevice, ToyConfig, ToyModel, load_init, toy_batches, toy_init

BLOCKS = ("layers.0", "layers.1", "layers.2")


def _run(model, init, batches, optimizer, config: EngineConfig, *, master_format: str = "fp32", recorder=None):
    """Losses, the host master's planes and every unit's host optimizer state after ``batches``;
    ``recorder`` (a :class:`_Recorder`) is told of each step."""
    on_device: set[str] = set()
    device_step = StreamedPipeline._step_on_device

    def recording_step(pipeline, unit, *args, **kwargs):
        on_device.add(unit.name)
        return device_step(pipeline, unit, *args, **kwargs)

    with CPUDevice() as device, mock.patch.object(StreamedPipeline, "_step_on_device", recording_step):
        host = HostParameters(model, device.alloc_pinned, master_format=master_format)
        load_init(host, init)
        with Engine(model, device, host, optimizer, config) as engine:
            losses = []
            for micro in batches:
                if recorder is not None:
                    recorder.next_step()
                losses.append(engine.step(micro, lr=3e-3).loss)
            engine.drain(with_state=True)
            state = {u.name: {k: v.clone() for k, v in engine.host_state.views(u).items()} for u in model.units}
            views = {u.name: {k: v.clone() for k, v in host.read_views(u).items()} for u in model.units}
        planes = {name: plane.clone() for name, plane in host.planes.items()}
    return losses, planes, state, views, on_device


@pytest.mark.parametrize("accum", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "streamed", [BLOCKS, ("embed", "layers.1", "head"), ("embed", "layers.0", "layers.1", "layers.2", "head")]
)
def test_streamed_units_match_plain_adamw(tied: bool, accum: int, streamed: tuple[str, ...]) -> None:
    """Every placement of streamed units, a tied embedding's two shares and accumulation summed for the
    device update (Note [Streamed accumulation]), against torch.optim.AdamW, fp32, <= 1e-5."""
    if tied and "head" in streamed:
        streamed = tuple(name for name in streamed if name != "head") or BLOCKS
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=13)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=4)
    adam = AdamWConfig(weight_decay=0.1)
    schedule = LRSchedule(3e-3, "constant")
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, block_slots=2, streamed_units=streamed
    )
    losses, _, _, views, on_device = _run(model, init, batches, TorchAdamW(adam), config)
    assert on_device == set(streamed)
    _assert_close((losses, views), _reference_run(model, init, batches, adam, schedule))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _assert_same_bits(streamed, host) -> None:
    """The same losses, master planes and host optimizer state, bit for bit (two :func:`_run` results)."""
    assert streamed[0] == host[0]
    for name, plane in host[1].items():
        assert torch.equal(_bits(streamed[1][name]), _bits(plane)), name
    for unit, arrays in host[2].items():
        for name, tensor in arrays.items():
            assert torch.equal(_bits(streamed[2][unit][name]), _bits(tensor)), (unit, name)


@pytest.mark.parametrize(
    ("state_format", "master_format", "accum", "clip"),
    [
        ("fp32", "fp32", 1, 0.0),
        ("bf16", "fp32", 1, 0.0),
        ("int8", "fp32", 1, 0.0),
        ("fp32", "split", 1, 0.0),
        ("bf16", "split", 1, 0.0),
        ("int8", "split", 1, 0.0),
        ("bf16", "split", 2, 0.0),  # accumulation: summed for the device (Note [Streamed accumulation])
        ("int8", "fp32", 1, 0.05),  # clipping: the device speculates, then deferred steps take the host's path
        ("fp32", "split", 2, 0.05),
    ],
)
def test_streamed_and_host_placements_give_the_same_bits(
    state_format: str, master_format: str, accum: int, clip: float
) -> None:
    """Note [Streamed updates are the host's arithmetic]: with the same optimizer ops on both sides (the
    torch path), masters and moments after several steps are bit for bit those of the host placement,
    compact moments included (rounded on the host slab's positions) and a split master included (decoded
    and encoded on the device); one resident unit beside them, and one unit left on the host. With
    accumulation the streamed units are updated on the device too (Note [Streamed accumulation]); with
    clipping they speculate on the device and are corrected on the host (Note [Streamed speculation])."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=4, accum=accum, seed=9)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32

    def optimizer():
        return TorchAdamW(adam) if state_format == "fp32" else CompactAdamW(adam, fused=False)

    base = dict(compute_dtype=dtype, transfer_chunk_numel=4096, resident_units=("layers.3",), max_grad_norm=clip)
    host = _run(model, init, batches, optimizer(), EngineConfig(**base), master_format=master_format)
    streamed_names = ("embed", "layers.0", "layers.2", "head")
    streamed = _run(
        model, init, batches, optimizer(), EngineConfig(**base, streamed_units=streamed_names),
        master_format=master_format,
    )  # fmt: skip
    assert streamed[4] == set(streamed_names)
    _assert_same_bits(streamed, host)


@pytest.mark.parametrize("state_format", ["fp32", "bf16", "int8"])
def test_the_one_launch_codec_streams_the_host_kernels_bits(state_format: str) -> None:
    """A run's optimizer (the numba kernels on the host) with the codec a `slide` run gives it
    (slide_kernels.ops.split_master, in Triton's interpreter here): a split master streamed through the
    device ends bit for bit where the host placement's does, tie bytes included (both keep the bits of
    elements that are not midpoints), and so do the moments."""
    from slide_kernels._backend import kernels_available
    from slide_kernels.ops.split_master import TritonSplitCodec

    if not kernels_available("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1")
    cfg = ToyConfig(tie_embeddings=False, num_layers=3, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=7)
    batches = toy_batches(cfg, steps=3, accum=1, seed=2)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)

    def optimizer():
        built = build_optimizer("auto", adam)
        built.split_codec = TritonSplitCodec()
        return built

    base = dict(compute_dtype=torch.bfloat16, transfer_chunk_numel=4096)
    host = _run(model, init, batches, optimizer(), EngineConfig(**base), master_format="split")
    streamed_names = ("embed", "layers.0", "layers.1", "head")
    streamed = _run(
        model, init, batches, optimizer(), EngineConfig(**base, streamed_units=streamed_names), master_format="split"
    )
    assert streamed[4] == set(streamed_names)
    _assert_same_bits(streamed, host)


class _Recorder:
    """Per step (main thread): the streamed units updated on the device, and the corrections the step's
    decision queued for them on the host."""

    def __init__(self) -> None:
        self.on_device: list[set[str]] = []
        self.corrected: list[set[tuple[str, str]]] = []
        self.squares: list[float] = []  # every speculative device update's squared norm (landed on the CPU)
        self.summed: list[float] = []  # the c_u of every speculative device update of a summed gradient

    def next_step(self) -> None:
        self.on_device.append(set())
        self.corrected.append(set())

    def scaled(self, max_norm: float) -> bool:
        """Whether some speculative update applied ``c_u < 1``."""
        return any(math.sqrt(square) > max_norm for square in self.squares) or any(c < 1.0 for c in self.summed)

    def patches(self) -> contextlib.ExitStack:
        device_step, finish = StreamedPipeline._step_on_device, StreamedPipeline.finish
        recorder = self

        def recording_step(pipeline, unit, *args, **kwargs):
            recorder.on_device[-1].add(unit.name)
            return device_step(pipeline, unit, *args, **kwargs)

        def recording_finish(pipeline, unit, ctx, correction):
            speculated = pipeline._speculated.get(unit.name)
            if speculated is not None:
                if speculated.norm_sq is None:  # a summed gradient: its c_u as the host recorded it
                    recorder.summed.append(speculated.applied)
                else:
                    recorder.squares.append(float(speculated.norm_sq))
                if correction.kind != "keep":
                    recorder.corrected[-1].add((unit.name, correction.kind))
            return finish(pipeline, unit, ctx, correction)

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(StreamedPipeline, "_step_on_device", recording_step))
        stack.enter_context(mock.patch.object(StreamedPipeline, "finish", recording_finish))
        return stack


def _policy(regime: str) -> contextlib.AbstractContextManager[object]:
    """``speculating``: every step clips and speculates, none defers (a step's correction at step 1
    restores zero moments whatever it applied; later ones depend on ``c_u``)."""
    if regime != "speculating":
        return contextlib.nullcontext()
    return mock.patch.object(ClipPolicy, "for_step", lambda policy: SpeculativeClipping(policy))


def _clip_regime(model, init, batches, adam, regime: str) -> float:
    """A max_norm under which every step clips, none does, or some do and some not (checked)."""
    if regime in ("clips", "speculating"):  # below some units' own norms too: their speculative update applies c_u < 1
        max_norm = 0.01
    elif regime == "never":
        max_norm = 1e6
    else:
        _, unclipped, _, _ = _clip_reference(model, init, batches, adam, 1e6)
        ordered = sorted(unclipped.values())  # between two norms: none is within rounding of it
        max_norm = (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    _, norms, _, _ = _clip_reference(model, init, batches, adam, max_norm)
    clipped = [norm > max_norm for norm in norms.values()]
    fits = {
        "clips": all(clipped),
        "speculating": all(clipped),
        "never": not any(clipped),
        "mixed": any(clipped) and not all(clipped),
    }
    assert fits[regime], f"test setup: clipped steps {clipped} do not fit regime {regime}"
    return max_norm


STREAMED = ("embed", "layers.0", "layers.2", "head")


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("regime", ["clips", "speculating", "mixed", "never"])
@pytest.mark.parametrize("resident", [(), ("layers.1",)])
def test_streamed_units_speculate_and_match_clip_grad_norm(regime: str, resident: tuple[str, ...], accum: int) -> None:
    """Note [Streamed speculation]: with clipping, a speculative step updates the streamed units on the
    device with ``c_u`` and the host corrects them when the step clips; a deferred step (after one that
    clipped) takes the host's path; with accumulation the summed gradient's norm is summed on the host
    (Note [Streamed accumulation]). Losses, reported norms, weights and both moments equal
    clip_grad_norm_ + torch.optim.AdamW within 1e-5, and which steps ran where is as the Notes say."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=11)
    batches = toy_batches(cfg, steps=4, accum=accum, seed=3)
    adam = AdamWConfig(weight_decay=0.1)
    max_norm = _clip_regime(model, init, batches, adam, regime)
    ref_losses, ref_norms, ref_params, ref_state = _clip_reference(model, init, batches, adam, max_norm)
    config = EngineConfig(
        block_slots=1, compute_dtype=torch.float32, transfer_chunk_numel=1024, resident_units=resident,
        max_grad_norm=max_norm, streamed_units=STREAMED,
    )  # fmt: skip
    recorder = _Recorder()
    with recorder.patches(), _policy(regime):
        results, params, state, step_count = _clip_engine_run(
            model, init, batches, adam, config, before_step=lambda step: recorder.next_step()
        )
    clipped = [ref_norms[step] > max_norm for step in range(len(batches))]
    defers = regime != "speculating"
    for step, result in enumerate(results):
        assert not result.skipped
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL), f"loss differs at step {step + 1}"
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL), f"grad norm differs at step {step + 1}"
        deferred = defers and step > 0 and clipped[step - 1]
        assert recorder.on_device[step] == (set() if deferred else set(STREAMED)), step
        corrected = {(name, "rescale") for name in STREAMED} if clipped[step] and not deferred else set()
        assert recorder.corrected[step] == corrected, step
    assert recorder.scaled(max_norm) == (regime in ("clips", "speculating"))
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("max_norm", [1e6, 0.05])
def test_a_nonfinite_step_takes_streamed_updates_back(max_norm: float, accum: int) -> None:
    """NaN gradients in layers.1 and everything before it at step 3: the streamed units updated on the
    device in that step (their non-finite gradients applied as zeros: Note [Speculative non-finite guard],
    and Note [Streamed accumulation] for a summed one) are taken back on the host, the step is skipped,
    and the run equals the reference that never saw that batch. With every step clipping, the bad step
    defers instead and nothing of it is applied."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=3)
    model = _PoisonableToy(cfg, poison_at=1)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=5, accum=accum, seed=8)
    adam = AdamWConfig(weight_decay=0.1)
    bad = 2
    ref_losses, ref_norms, ref_params, ref_state = _clip_reference(
        model, init, batches, adam, max_norm, frozenset({bad})
    )
    config = EngineConfig(
        block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=max_norm,
        streamed_units=STREAMED,
    )  # fmt: skip
    recorder = _Recorder()

    def before_step(step: int) -> None:
        recorder.next_step()
        model.poison(step == bad)

    with recorder.patches():
        results, params, state, step_count = _clip_engine_run(model, init, batches, adam, config, before_step)
    assert [r.skipped for r in results] == [step == bad for step in range(len(batches))]
    assert step_count == len(batches) - 1
    deferred = ref_norms[bad - 1] > max_norm
    assert recorder.on_device[bad] == (set() if deferred else set(STREAMED))
    assert recorder.corrected[bad] == (set() if deferred else {(name, "undo") for name in STREAMED})
    for step, result in enumerate(results):
        if step != bad:
            assert result.loss == pytest.approx(ref_losses[step], rel=RTOL), f"loss differs at step {step + 1}"
            assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL)
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


@pytest.mark.parametrize("regime", ["clips", "speculating", "mixed", "never"])
@pytest.mark.parametrize(
    ("state_format", "master_format"),
    [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("fp32", "split"), ("bf16", "split"), ("int8", "split")],
)
def test_streamed_speculation_gives_the_host_placements_bits(
    state_format: str, master_format: str, regime: str
) -> None:
    """Note [Streamed speculation]: the device's speculative update is the host's arithmetic with the same
    fp32 ``c_u``, and its correction is the host's own code on the same kept gradient, so after steps that
    clip, do not, or some of each, masters and moments are the host placement's bit for bit (the torch
    ops on both sides), compact moments and a split master included."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=4, accum=1, seed=9)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    max_norm = _clip_regime(model, init, batches, AdamWConfig(weight_decay=0.1), regime)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32

    def optimizer():
        return TorchAdamW(adam) if state_format == "fp32" else CompactAdamW(adam, fused=False)

    base = dict(compute_dtype=dtype, transfer_chunk_numel=4096, resident_units=("layers.3",), max_grad_norm=max_norm)
    with _policy(regime):
        host = _run(model, init, batches, optimizer(), EngineConfig(**base), master_format=master_format)
    recorder = _Recorder()
    recorder.next_step()
    with recorder.patches(), _policy(regime):
        config = EngineConfig(**base, streamed_units=STREAMED)
        streamed = _run(model, init, batches, optimizer(), config, master_format=master_format)
    assert streamed[4] == set(STREAMED)
    assert recorder.scaled(max_norm) == (regime in ("clips", "speculating"))
    assert bool(recorder.corrected[0]) == (regime != "never")
    _assert_same_bits(streamed, host)


ACCUM_FORMATS = [
    ("fp32", "fp32"),
    ("bf16", "fp32"),
    ("int8", "fp32"),
    ("fp32", "split"),
    ("bf16", "split"),
    ("int8", "split"),
]


@pytest.mark.parametrize(
    ("state_format", "master_format", "accum", "regime"),
    [
        *(
            (state, master, accum, regime)
            for state, master in ACCUM_FORMATS
            for accum in (2, 3)
            for regime in ("off", "speculating")
        ),
        ("bf16", "split", 2, "mixed"),
        ("int8", "fp32", 3, "mixed"),
    ],
)
def test_streamed_accumulation_gives_the_host_placements_bits(
    state_format: str, master_format: str, accum: int, regime: str
) -> None:
    """Note [Streamed accumulation]: the earlier micro-batches' gradients summed on the host, the sum
    staged beside the master and the last one added on the device is the host's fp32 sum, and with
    clipping its norm is summed on the host and its c_u formed on the device as the host forms it, so after
    steps that clip (every one speculating, or some deferred) or run without clipping, masters and moments
    are the host placement's bit for bit, every streamed unit updated on the device in every step that
    does not defer."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=9)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    max_norm = 0.0 if regime == "off" else _clip_regime(model, init, batches, AdamWConfig(weight_decay=0.1), regime)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32

    def optimizer():
        return TorchAdamW(adam) if state_format == "fp32" else CompactAdamW(adam, fused=False)

    base = dict(compute_dtype=dtype, transfer_chunk_numel=1024, resident_units=("layers.3",), max_grad_norm=max_norm)
    with _policy(regime):
        host = _run(model, init, batches, optimizer(), EngineConfig(**base), master_format=master_format)
    recorder = _Recorder()
    with recorder.patches(), _policy(regime):
        config = EngineConfig(**base, streamed_units=STREAMED)
        streamed = _run(model, init, batches, optimizer(), config, master_format=master_format, recorder=recorder)
    assert all(on_device == set(STREAMED) for on_device in recorder.on_device[:1])
    if regime == "speculating":
        assert recorder.on_device == [set(STREAMED)] * len(batches)
        assert recorder.corrected == [{(name, "rescale") for name in STREAMED}] * len(batches)
        assert recorder.scaled(max_norm)
    _assert_same_bits(streamed, host)


@pytest.mark.parametrize(("accum", "max_norm"), [(1, 0.0), (2, 0.0), (1, 0.05), (3, 0.05)])
def test_a_streamed_tied_embedding_sums_both_shares_for_the_device(accum: int, max_norm: float) -> None:
    """A tied embedding gets the head's share and its own each micro-batch: the shares before its last are
    summed on the host, the last added on the device (Note [Streamed accumulation]); the bits are the host
    placement's."""
    cfg = ToyConfig(tie_embeddings=True, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=4, accum=accum, seed=9)
    adam = AdamWConfig(weight_decay=0.1, state_format="bf16")
    base = dict(compute_dtype=torch.bfloat16, transfer_chunk_numel=1024, max_grad_norm=max_norm)
    names = ("embed", "layers.0", "layers.3")
    host = _run(model, init, batches, CompactAdamW(adam, fused=False), EngineConfig(**base), master_format="split")
    config = EngineConfig(**base, streamed_units=names)
    streamed = _run(model, init, batches, CompactAdamW(adam, fused=False), config, master_format="split")
    assert streamed[4] == set(names)
    _assert_same_bits(streamed, host)


def test_staging_is_three_sets_of_the_largest_shard() -> None:
    """What the planner prices is what the staging allocates: three sets (Note [Three staging sets]), a
    split master's planes in each and one fp32 buffer its updates decode into; with accumulation an fp32
    sum per set once a step sums (tests/core/test_sums_pool.py: one per summing unit in flight)."""
    arrays = state_arrays("int8")
    with CPUDevice() as device:
        for split in (False, True):
            staging = UpdateStaging(device, 10_000, arrays, split=split)
            tensors = [t for staged in staging.sets for t in (*staged.planes.values(), *staged.state.values())]
            tensors += [staged.master for staged in staging.sets if staged.master is not None]
            tensors += [staging.values] if staging.values is not None else []
            held = sum(t.numel() * t.element_size() for t in tensors)
            assert held == UpdateStaging.bytes_for(10_000, arrays, split=split)
            assert len(staging.sets) == 3
            assert (staging.values is not None) == split
            assert all((staged.master is None) == split for staged in staging.sets)
            summing = [10_000, 10_000, 4_000, 9_000]  # accumulation: every streamed unit sums
            staging.hold_sums(summing)
            staging.hold_sums(summing)  # once
            assert len(staging.sums.buffers) == 3
            held += sum(h.values.numel() * h.values.element_size() for h in staging.sums.buffers)
            assert held == UpdateStaging.bytes_for(10_000, arrays, split=split, summing_numels=summing)


def test_streamed_units_leave_the_ring_to_the_host_units() -> None:
    """Note [The ring is sized for the host's units]: the gradient ring holds the backlog of the units the
    host updates every step, so streaming units shrinks it, and what the engine allocates is what
    ``GradTransfer.host_bytes`` (the planner's price) says; the clipping store still holds every unit."""
    from slide_core.engine.grad_transfer import GradTransfer

    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    numel = {unit.name: unit.layout.numel for unit in model.units}
    streamed = ("embed", "layers.0", "layers.1", "layers.2")
    base = dict(compute_dtype=torch.float32, transfer_chunk_numel=1024, grad_ring_slots=1, grad_ring_fraction=1.0)
    rings = {}
    for names in ((), streamed):
        config = EngineConfig(**base, streamed_units=names)
        with CPUDevice() as device:
            host = HostParameters(model, device.alloc_pinned)
            with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
                rings[names] = engine.pipelines.transfer.ring.nbytes
        host_numels = [n for name, n in numel.items() if name not in names]
        assert rings[names] == GradTransfer.host_bytes(config, host_numels, [numel[name] for name in names])
    assert rings[streamed] < rings[()]
    clipping = EngineConfig(**{**base, "max_grad_norm": 1.0}, streamed_units=streamed)
    everything = GradTransfer.host_bytes(clipping, list(numel.values()))
    assert (
        GradTransfer.host_bytes(clipping, [numel["layers.3"], numel["head"]], [numel[n] for n in streamed])
        == everything
    )


def test_streamed_units_must_not_be_resident_or_offloaded() -> None:
    with pytest.raises(ValueError, match="streamed_units and resident_units must not share units, both name embed"):
        EngineConfig(streamed_units=("embed",), resident_units=("embed",))
    with pytest.raises(ValueError, match="offloaded_units"):
        EngineConfig(streamed_units=("layers.0",), offloaded_units=("layers.0",))
    with pytest.raises(ValueError, match="staging_sets must be >= 2"):
        EngineConfig(streamed_units=("layers.0",), staging_sets=1)


def test_pins_of_the_streamed_state_are_given_back_before_the_state_is_dropped() -> None:
    """The state slabs' streamed span is pinned once per allocation and unpinned before ``host_state.drop``
    (an export must not hold the Adam state registered, hence allocated, beside the masters)."""

    cfg = ToyConfig(num_layers=3)
    model = ToyModel(cfg)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, streamed_units=("layers.0", "head"))
    with PinRecordingDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, toy_init(model))
        engine = Engine(model, device, host, TorchAdamW(AdamWConfig()), config)
        with engine:
            engine.step(toy_batches(cfg, steps=1, accum=1)[0], lr=1e-3)
            slabs = engine.host_state.state_slabs
            start, end = host.offset("layers.0"), host.extent("head")[1]
            state_pins = [
                t for t in device.pinned if any(t.data_ptr() == s.data_ptr() + 4 * start for s in slabs.values())
            ]
            assert len(state_pins) == len(slabs) == 2  # one span per slab: exp_avg, exp_avg_sq
            assert all(t.numel() == end - start for t in state_pins)
            engine.close(keep_host_state=False)
        assert [id(t) for t in device.unpinned] == [id(t) for t in state_pins]


@pytest.mark.skipif(not FusedAdamW.available(), reason="needs numba")
@pytest.mark.parametrize(
    ("state_format", "master_format"),
    [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("fp32", "split"), ("bf16", "split")],
)
def test_a_runs_optimizer_gives_the_same_bits_in_either_placement(state_format: str, master_format: str) -> None:
    """The optimizer `slide train` builds: numba kernels for host-updated units, its device replica (torch's
    fused AdamW on widened moments) for streamed ones. Both do the same fp32 arithmetic, so after several
    steps masters and moments are bit for bit the host placement's."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=4, accum=1, seed=9)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32
    base = dict(compute_dtype=dtype, transfer_chunk_numel=4096, resident_units=("layers.3",))
    host = _run(model, init, batches, build_optimizer("auto", adam), EngineConfig(**base), master_format=master_format)
    streamed_names = ("embed", "layers.0", "layers.2", "head")
    config = EngineConfig(**base, streamed_units=streamed_names)
    streamed = _run(model, init, batches, build_optimizer("auto", adam), config, master_format=master_format)
    assert streamed[4] == set(streamed_names)
    assert streamed[0] == host[0]
    for name, plane in host[1].items():  # a tie bit means something only at a midpoint (split_master.py)
        assert name == "ties" or torch.equal(_bits(streamed[1][name]), _bits(plane)), name
    for unit, views in host[3].items():
        for name, view in views.items():
            assert torch.equal(_bits(streamed[3][unit][name]), _bits(view)), (unit, name)
    for unit, arrays in host[2].items():
        for name, tensor in arrays.items():
            assert torch.equal(_bits(streamed[2][unit][name]), _bits(tensor)), (unit, name)


def test_backward_loads_read_the_staged_master() -> None:
    """Note [The backward reads the staged master]: every block loaded again for its backward is served
    from its staging set (its master crosses once for the backward and the update); the rest read the
    host. The results are those of plain AdamW (the tests above, which take the same path)."""
    served: list[tuple[str, bool]] = []
    load = StreamedPipeline.load

    def recording_load(pipeline, unit, *args):
        served.append((unit.name, unit.name in pipeline._load_from))
        return load(pipeline, unit, *args)

    cfg = ToyConfig(tie_embeddings=False, num_layers=6, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    names = ("embed", *(f"layers.{i}" for i in range(6)), "head")
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=4096, block_slots=2, streamed_units=names)
    with mock.patch.object(StreamedPipeline, "load", recording_load):
        _run(
            model,
            toy_init(model, seed=5),
            toy_batches(cfg, steps=2, accum=1, seed=9),
            TorchAdamW(AdamWConfig()),
            config,
        )
    per_step = len(served) // 2
    assert served[:per_step] == served[per_step:]
    loads: dict[str, list[bool]] = {}
    for name, from_staging in served[:per_step]:
        loads.setdefault(name, []).append(from_staging)
    twice = {name for name, flags in loads.items() if len(flags) == 2}
    assert {"layers.0", "layers.1", "layers.2"} <= twice
    for name, flags in loads.items():
        assert flags == ([False, True] if name in twice else [False]), name
