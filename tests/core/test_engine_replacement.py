"""Units moved between the host AdamW and the GPU-streamed update between steps (Note [Re-placement at a step
boundary] in slide_core/engine/replacement.py), on the CPU device: the same bits as the all-host run, the
same math as plain torch AdamW, and nothing allocated by a move."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch
from test_engine import _assert_close, _reference_run
from test_streamed_pipeline import _assert_same_bits, _clip_regime, _policy, _Recorder

from slide_core import AdamWConfig, HostParameters, LRSchedule
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.engine.replacement import StreamedPlacement
from slide_core.optim import TorchAdamW
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init

STREAMABLE = ("embed", "layers.0", "layers.1", "layers.2", "head")
MOVES: Mapping[int, tuple[str, ...]] = {
    1: ("layers.0", "layers.1"),  # after step 1: two blocks to the device
    2: ("embed", "layers.1", "layers.2", "head"),  # one back to the host, three more to the device
    4: (),  # every one back to the host
}
"""Which units the device updates from the step after each key (the run starts with none)."""


def _run(model, init, batches, optimizer, config: EngineConfig, moves: Mapping[int, Sequence[str]], *, split: bool):
    """Losses, master planes, host state and views after ``batches``, moving units after the steps ``moves``
    names; also the units updated on the device in each step."""
    recorder = _Recorder()
    with CPUDevice() as device, recorder.patches():
        host = HostParameters(model, device.alloc_pinned, master_format="split" if split else "fp32")
        load_init(host, init)
        with Engine(model, device, host, optimizer, config) as engine:
            losses, norms = [], []
            for step, micro in enumerate(batches):
                recorder.next_step()
                result = engine.step(micro, lr=3e-3)
                losses.append(result.loss)
                norms.append(result.grad_norm)
                if step + 1 in moves:
                    engine.place_streamed(moves[step + 1])
            engine.drain(with_state=True)
            state = {u.name: {k: v.clone() for k, v in engine.host_state.views(u).items()} for u in model.units}
            views = {u.name: {k: v.clone() for k, v in host.read_views(u).items()} for u in model.units}
        planes = {name: plane.clone() for name, plane in host.planes.items()}
    return (losses, planes, state, views), recorder, norms


@pytest.mark.parametrize(
    ("state_format", "master_format", "regime"),
    [
        ("fp32", "fp32", None),
        ("bf16", "fp32", None),
        ("int8", "fp32", None),
        ("fp32", "split", None),
        ("bf16", "split", None),
        ("int8", "split", None),
        ("fp32", "fp32", "mixed"),  # clipping: speculative steps on the device, deferred ones on the host
        ("bf16", "split", "speculating"),  # every step clips on the device and is corrected on the host
        ("int8", "fp32", "never"),
    ],
)
def test_moving_units_mid_run_gives_the_all_host_bits(state_format: str, master_format: str, regime: str | None):
    """Note [Re-placement at a step boundary]: a run that moves units to the device and back between its
    steps ends with the all-host run's masters and moments bit for bit (the torch ops on both sides),
    compact moments and a split master included, with and without clipping; and the device updated
    exactly the units placed there in each step (a deferred clipped step updates on the host)."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=64, intermediate_size=128)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=6, accum=1, seed=9)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    fp32_adam = AdamWConfig(weight_decay=0.1)
    max_norm = 0.0 if regime is None else _clip_regime(model, init, batches, fp32_adam, regime)
    split = master_format == "split"

    def optimizer():
        return TorchAdamW(adam) if state_format == "fp32" else CompactAdamW(adam, fused=False)

    base = dict(
        compute_dtype=torch.bfloat16 if split else torch.float32,
        transfer_chunk_numel=4096,
        resident_units=("layers.3",),
        max_grad_norm=max_norm,
    )
    with _policy(regime or ""):
        host, _, _ = _run(model, init, batches, optimizer(), EngineConfig(**base), {}, split=split)
        config = EngineConfig(**base, streamable_units=STREAMABLE)
        moved, recorder, norms = _run(model, init, batches, optimizer(), config, MOVES, split=split)
    # A step after one that clipped defers (Note [Deferred clipped steps]); one that speculates never does.
    clipped = [regime in ("mixed", "never") and norm is not None and norm > max_norm for norm in norms]
    placed: tuple[str, ...] = ()
    for step in range(len(batches)):
        placed = MOVES.get(step, placed)
        deferred = step > 0 and clipped[step - 1]
        assert recorder.on_device[step] == (set() if deferred else set(placed)), step
    if regime == "speculating":
        assert any(recorder.corrected)
    if regime == "mixed":
        assert any(clipped) and not all(clipped)  # the device's updates were corrected on the host
    _assert_same_bits(moved, host)


def test_moving_units_matches_plain_adamw() -> None:
    """Moves in both directions, fp32, against torch.optim.AdamW within 1e-5."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=13)
    batches = toy_batches(cfg, steps=5, accum=1, seed=4)
    adam = AdamWConfig(weight_decay=0.1)
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, streamed_units=("layers.1",),
        streamable_units=STREAMABLE,
    )  # fmt: skip
    (losses, _, _, views), recorder, _ = _run(model, init, batches, TorchAdamW(adam), config, MOVES, split=False)
    assert recorder.on_device[0] == {"layers.1"}  # the streamed units start on the device, the others on the host
    assert recorder.on_device[3] == set(MOVES[2])
    _assert_close((losses, views), _reference_run(model, init, batches, adam, LRSchedule(3e-3, "constant")))


def test_a_move_allocates_nothing_and_names_what_moved() -> None:
    """The staging sets exist from the start, sized for the largest streamable unit; a move reuses them,
    and the host buffers the engine holds are the same before and after it."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=1)
    batches = toy_batches(cfg, steps=3, accum=1, seed=2)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, streamable_units=STREAMABLE)
    largest = max(unit.layout.numel for unit in model.units)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
            staging = engine.pipelines.streamed.staging
            sets = [staged.master.data_ptr() for staged in staging.sets if staged.master is not None]
            assert len(sets) == 3 and all(s.master.numel() == largest for s in staging.sets if s.master is not None)
            engine.step(batches[0], lr=1e-3)
            engine.wait_idle()
            before = engine.host_allocations.to_dict()
            assert engine.streamed_units == ()
            to_device, to_host = engine.place_streamed(("layers.2", "layers.0"))
            assert (to_device, to_host) == ({"layers.0", "layers.2"}, set())
            assert engine.streamed_units == ("layers.0", "layers.2")  # forward order
            engine.step(batches[1], lr=1e-3)
            assert engine.place_streamed(("layers.2",)) == (set(), {"layers.0"})
            engine.step(batches[2], lr=1e-3)
            engine.wait_idle()
            assert engine.host_allocations.to_dict() == before
            assert [s.master.data_ptr() for s in staging.sets if s.master is not None] == sets


def test_only_the_units_the_streamed_path_was_built_for_can_move() -> None:
    placement = StreamedPlacement(("layers.0", "layers.1"), ("layers.0",))
    assert "layers.0" in placement and "layers.1" not in placement
    with pytest.raises(ValueError, match=r"units head cannot be updated on the GPU in this run"):
        placement.move(("layers.1", "head"))
    assert placement.streamed == {"layers.0"}  # a refused move changes nothing
    with pytest.raises(ValueError, match="streamable_units and resident_units must not share units"):
        EngineConfig(streamable_units=("embed",), resident_units=("embed",))
    with pytest.raises(ValueError, match="streamable_units and offloaded_units"):
        EngineConfig(streamable_units=("layers.0",), offloaded_units=("layers.0",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("state_format", "master_format"), [("fp32", "fp32"), ("bf16", "split"), ("int8", "fp32")])
def test_moving_units_on_a_gpu_tracks_the_host_run(state_format: str, master_format: str) -> None:
    """On a CUDA GPU, with the optimizer a run builds: moves both ways between steps keep the losses of the
    all-host run (CUDA's atomic sums differ run to run, so not bits: tests/core/test_streamed_gpu.py), and
    the staging the moved units use is the one allocated when the engine started."""
    from slide_core.devices.cuda import CUDADevice
    from slide_core.optim import build_optimizer

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ToyConfig(tie_embeddings=False, num_layers=4, hidden_size=128, intermediate_size=344, vocab_size=512)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=6, accum=1, seed=9, batch=4, seq=64)
    adam = AdamWConfig(weight_decay=0.1, state_format=state_format)
    dtype = torch.bfloat16 if master_format == "split" else torch.float32
    base = dict(compute_dtype=dtype, transfer_chunk_numel=8192, resident_units=("layers.3",), block_slots=2)

    def run(config: EngineConfig, moves: Mapping[int, Sequence[str]]) -> list[float]:
        with CUDADevice() as device:
            host = HostParameters(model, master_format=master_format)
            load_init(host, init)
            with Engine(model, device, host, build_optimizer("auto", adam), config) as engine:
                staging = [t.data_ptr() for s in engine.pipelines.streamed.staging.sets for t in s.state.values()]
                losses = []
                for step, micro in enumerate(batches):
                    losses.append(engine.step(micro, lr=3e-3).loss)
                    if step + 1 in moves:
                        engine.place_streamed(moves[step + 1])
                after = [t.data_ptr() for s in engine.pipelines.streamed.staging.sets for t in s.state.values()]
                assert after == staging
        return losses

    host = run(EngineConfig(**base), {})
    moved = run(EngineConfig(**base, streamable_units=STREAMABLE), MOVES)
    assert moved == pytest.approx(host, rel=1e-3)
    assert moved[-1] < moved[0]


def test_streamed_uploads_and_write_backs_are_timed_spans_with_their_bytes() -> None:
    """The streamed units' master and moments to their staging set and back are spans of their own
    (``upload``, ``write_back``), with the bytes they moved, so a run can time PCIe under load; a unit
    moved to the host records none."""
    cfg = ToyConfig(tie_embeddings=False, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=3)
    batches = toy_batches(cfg, steps=2, accum=1, seed=6)
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, streamed_units=("layers.1",),
        streamable_units=STREAMABLE,
    )  # fmt: skip
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
            engine.step(batches[0], lr=1e-3)
            engine.wait_idle()
            times = engine.unit_times()
            numel = next(unit.layout.numel for unit in model.units if unit.name == "layers.1")
            moved = numel * 4 * 3  # fp32 master and two fp32 moments, each way
            assert times["layers.1"].bytes["upload"] == moved and times["layers.1"].bytes["write_back"] == moved
            assert times["layers.1"].ms["upload"] > 0 and times["layers.1"].ms["write_back"] > 0
            assert all("upload" not in t.bytes for name, t in times.items() if name != "layers.1")
            engine.place_streamed(())
            engine.step(batches[1], lr=1e-3)
            engine.wait_idle()
            assert all(t.bytes.get("upload", 0) == 0 for t in engine.unit_times().values())
