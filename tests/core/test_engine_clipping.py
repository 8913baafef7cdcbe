"""Gradient-norm clipping and non-finite step skipping against a plain PyTorch loop, on the CPU device in fp32.

The reference is ``torch.nn.utils.clip_grad_norm_`` followed by ``torch.optim.AdamW.step()``; a skipped
step's reference simply never sees that step's batch. See Note [Clip rollback ordering] and Note
[Speculative non-finite guard] in docs/design/engine.md, and Note [Grad store reuse] in
slide_core/engine/grad_ring.py (exercised by the accumulated and tied cases).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping

import pytest
import torch

from slide_core import AdamWConfig, HostParameters, Optimizer
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig, EngineError, StepResult
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyBlock, ToyConfig, ToyModel, load_init, reference_loss, toy_batches, toy_init

RTOL = 1e-5
LR = 3e-3


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN backward: the gradients of everything before it become NaN, the loss not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.nan)


class _PoisonableBlock(ToyBlock):
    def __init__(self, cfg: ToyConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.poisoned = False

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs) -> torch.Tensor:
        y = super().forward(params, x, inputs)
        return _PoisonGrad.apply(y) if self.poisoned and torch.is_grad_enabled() else y


class _PoisonableToy(ToyModel):
    """A ToyModel whose block ``poison_at`` can be told to return NaN gradients."""

    def __init__(self, cfg: ToyConfig, poison_at: int = 1) -> None:
        super().__init__(cfg)
        self.blocks[poison_at] = _PoisonableBlock(cfg, poison_at)
        self.poisonable = self.blocks[poison_at]

    def poison(self, on: bool) -> None:
        self.poisonable.poisoned = on


class _CountingAdamW(TorchAdamW):
    """Counts host optimizer steps, to show that a skipped step had applied speculative updates."""

    def __init__(self, config: AdamWConfig) -> None:
        super().__init__(config)
        self.calls = 0

    def step(self, *args, **kwargs) -> None:
        self.calls += 1
        super().step(*args, **kwargs)


def _reference_run(model, init, batches, adam: AdamWConfig, max_norm: float, skip: frozenset[int] = frozenset()):
    """Plain autograd + clip_grad_norm_ + torch.optim.AdamW; steps in ``skip`` are never taken."""
    params = {unit: {name: torch.nn.Parameter(t.clone()) for name, t in views.items()} for unit, views in init.items()}
    flat = [p for views in params.values() for p in views.values()]
    decay = [p for p in flat if p.dim() >= 2]
    no_decay = [p for p in flat if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": adam.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
    )
    losses, norms = {}, {}
    for step, micro in enumerate(batches):
        if step in skip:
            continue
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            loss = reference_loss(model, params, ids, labels)
            (loss / tokens).backward()
            total += loss.item()
        losses[step] = total / tokens
        norms[step] = float(torch.nn.utils.clip_grad_norm_(flat, max_norm))
        optimizer.step()
        optimizer.zero_grad()
    state = {
        unit: {
            name: (optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"], int(optimizer.state[p]["step"]))
            for name, p in views.items()
        }
        for unit, views in params.items()
    }
    return losses, norms, params, state


def _clip_config(block_slots: int, resident: tuple[str, ...], max_norm: float) -> EngineConfig:
    return EngineConfig(
        block_slots=block_slots,
        compute_dtype=torch.float32,
        transfer_chunk_numel=1024,
        resident_units=resident,
        max_grad_norm=max_norm,
    )


def _engine_run(
    model,
    init,
    batches,
    adam: AdamWConfig,
    config: EngineConfig,
    before_step: Callable[[int], None] = lambda step: None,
    optimizer: Optimizer | None = None,
    after_step: Callable[[int], None] = lambda step: None,
    on_start: Callable[[Engine], None] = lambda engine: None,
):
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        results: list[StepResult] = []
        with Engine(model, device, host, optimizer or TorchAdamW(adam), config) as engine:
            on_start(engine)
            for step, micro in enumerate(batches):
                before_step(step)
                results.append(engine.step(micro, lr=LR))
                after_step(step)
            engine.drain(with_state=True)  # device-resident units' Adam state, copied to the host
        params = {unit.name: host.views(unit) for unit in model.units}
        state = {
            unit.name: {name: unit.layout.views(flat) for name, flat in engine.host_state.views(unit).items()}
            for unit in model.units
        }
        return results, params, state, engine.step_count


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _assert_weights_and_state(params, state, ref_params, ref_state, step_count: int) -> None:
    """Weights and both Adam moments within RTOL: the speculative coefficient c_u keeps the rounding of a
    correction small (see 'Why c_u rather than 1' in docs/design/engine.md)."""
    for unit, views in ref_params.items():
        for name, want in views.items():
            assert _rel(params[unit][name], want) <= RTOL, f"{unit}.{name} differs"
            exp_avg, exp_avg_sq, steps = ref_state[unit][name]
            assert steps == step_count, f"{unit}.{name}: reference took {steps} steps, engine {step_count}"
            assert _rel(state[unit]["exp_avg"][name], exp_avg) <= RTOL, f"{unit}.{name} exp_avg differs"
            assert _rel(state[unit]["exp_avg_sq"][name], exp_avg_sq) <= RTOL, f"{unit}.{name} v differs"


CASES = {
    # name: (tied, accum, block_slots, resident_units)
    "plain-slots1": (False, 1, 1, ()),
    "tied-accum2": (True, 2, 2, ()),
    "tied-accum2-resident": (True, 2, 2, ("embed", "layers.0")),
    "accum2-slots1-resident": (False, 2, 1, ("embed", "layers.0")),
    # one micro-batch: every final norm is on the device (Note [Early clipping decision]); the tied
    # resident embedding sums its two contributions in its slot (Note [Tied gradient in the slot])
    "tied-resident": (True, 1, 2, ("embed",)),
    "resident-head-block": (False, 1, 1, ("head", "layers.1")),
}


@pytest.mark.parametrize("regime", ["clips", "mixed", "never"])
@pytest.mark.parametrize("case", list(CASES))
def test_clipping_matches_clip_grad_norm(case: str, regime: str) -> None:
    """Speculative updates corrected at the end of the step (Note [Clip rollback ordering]) equal
    clip_grad_norm_ + AdamW: losses, reported norms, weights and Adam state."""
    tied, accum, slots, resident = CASES[case]
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=11)
    batches = toy_batches(cfg, steps=4, accum=accum, seed=3)
    adam = AdamWConfig(weight_decay=0.1)
    if regime == "clips":
        max_norm = 0.05
    elif regime == "never":
        max_norm = 1e6
    else:  # between the unclipped norms: some steps clip, some do not
        _, unclipped, _, _ = _reference_run(model, init, batches, adam, 1e6)
        max_norm = sorted(unclipped.values())[len(unclipped) // 2]
    ref_losses, ref_norms, ref_params, ref_state = _reference_run(model, init, batches, adam, max_norm)
    clipped = [norm > max_norm for norm in ref_norms.values()]
    expected = {"clips": all(clipped), "never": not any(clipped), "mixed": any(clipped) and not all(clipped)}
    assert expected[regime], f"test setup: clipped steps {clipped} do not fit regime {regime}"

    config = _clip_config(slots, resident, max_norm)
    results, params, state, step_count = _engine_run(model, init, batches, adam, config)
    for step, result in enumerate(results):
        assert not result.skipped
        assert result.step == step + 1
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL), f"loss differs at step {step + 1}"
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL), f"grad norm differs at step {step + 1}"
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


@pytest.mark.parametrize("case", ["plain-slots1", "tied-accum2"])
def test_clipping_with_fused_adamw_scales_in_the_optimizer(case: str) -> None:
    """Host speculative updates hand the optimizer the kept gradient and ``grad_scale=c_u`` (no scaled
    copy); FusedAdamW scales in its kernel, and the corrected run still equals clip_grad_norm_ + AdamW."""
    pytest.importorskip("numba")
    from slide_core.optim.fused_adamw import FusedAdamW

    class _RecordingFusedAdamW(FusedAdamW):
        def __init__(self, config: AdamWConfig) -> None:
            super().__init__(config)
            self.scales: list[float] = []

        def step(self, *args, grad_scale: float = 1.0, **kwargs) -> None:
            self.scales.append(grad_scale)
            super().step(*args, grad_scale=grad_scale, **kwargs)

    tied, accum, slots, resident = CASES[case]
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=11)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=3)
    adam = AdamWConfig(weight_decay=0.1)
    max_norm = 0.05
    ref_losses, ref_norms, ref_params, ref_state = _reference_run(model, init, batches, adam, max_norm)
    assert all(norm > max_norm for norm in ref_norms.values()), "test setup: every step must clip"
    config = _clip_config(slots, resident, max_norm)
    optimizer = _RecordingFusedAdamW(adam)
    results, params, state, step_count = _engine_run(model, init, batches, adam, config, optimizer=optimizer)
    assert min(optimizer.scales) < 1.0 and all(0.0 < scale <= 1.0 for scale in optimizer.scales)
    for step, result in enumerate(results):
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL), f"loss differs at step {step + 1}"
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL), f"grad norm differs at step {step + 1}"
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


NAN_CASES = {
    # name: (tied, accum, block_slots, resident_units, max_norm)
    "plain-clips": (False, 1, 2, (), 0.05),
    "tied-accum2-resident": (True, 2, 1, ("embed", "layers.0"), 1e6),
    "accum2-resident-head": (False, 2, 2, ("head", "layers.0"), 0.05),
}


@pytest.mark.parametrize("case", list(NAN_CASES))
def test_nan_step_is_skipped_exactly(case: str) -> None:
    """NaN gradients in layers.1 and everything before it (Note [Speculative non-finite guard]): head and
    layers.2 were already updated speculatively and are taken back, or, in a step deferred after a clipped
    one, their held gradients are dropped (resident units are still taken back); the step counter does
    not advance."""
    tied, accum, slots, resident, max_norm = NAN_CASES[case]
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = _PoisonableToy(cfg, poison_at=1)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=5, accum=accum, seed=8)
    adam = AdamWConfig(weight_decay=0.1)
    bad = 2
    ref_losses, ref_norms, ref_params, ref_state = _reference_run(
        model, init, batches, adam, max_norm, frozenset({bad})
    )
    config = _clip_config(slots, resident, max_norm)
    optimizer = _CountingAdamW(adam)
    calls: list[int] = []

    def before_step(step: int) -> None:
        calls.append(optimizer.calls)
        model.poison(step == bad)

    results, params, state, step_count = _engine_run(model, init, batches, adam, config, before_step, optimizer)
    per_step = calls[1]  # host ranges one step applies: the first step speculates, and returns when they are
    taken = len(batches) - 1
    if ref_norms[bad - 1] > max_norm:  # the step before clipped: this one deferred (Note [Deferred clipped steps])
        assert optimizer.calls == per_step * taken, "a deferred step applied host updates before its norm was known"
    else:
        assert optimizer.calls > per_step * taken, "the bad step applied no speculative update: nothing was rolled back"
    assert [r.skipped for r in results] == [step == bad for step in range(len(batches))]
    assert results[bad].grad_norm is not None and not math.isfinite(results[bad].grad_norm)
    assert [r.step for r in results] == [1, 2, 3, 3, 4]
    assert step_count == len(batches) - 1
    for step, result in enumerate(results):
        if step != bad:
            assert result.loss == pytest.approx(ref_losses[step], rel=RTOL), f"loss differs at step {step + 1}"
            assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL)
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("slide-") and t.is_alive()}


def _no_threads_left(before: set[threading.Thread]) -> None:
    deadline = time.monotonic() + 5.0
    while _engine_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _engine_threads() - before, "engine threads left behind"


@pytest.mark.timeout(30)
def test_consecutive_nan_steps_raise() -> None:
    """Three skipped steps in a row stop training, with the weights of before the first of them."""
    cfg = ToyConfig(num_layers=3)
    model = _PoisonableToy(cfg)
    init = toy_init(model, seed=2)
    batches = toy_batches(cfg, steps=6, accum=1, seed=1)
    adam = AdamWConfig(weight_decay=0.1)
    _, _, ref_params, _ = _reference_run(model, init, batches[:1], adam, 0.05)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=0.05, timeout_s=10)
    before = _engine_threads()
    began = time.monotonic()
    results: list[StepResult] = []
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with pytest.raises(EngineError) as caught, Engine(model, device, host, TorchAdamW(adam), config) as engine:
            for step, micro in enumerate(batches):
                model.poison(step >= 1)
                results.append(engine.step(micro, lr=LR))
        assert time.monotonic() - began < 20.0  # no hang; generous for a loaded 2-core CI machine
        message = str(caught.value)
        assert "non-finite gradients in 3 consecutive steps" in message
        assert "lower --lr" in message
        assert [r.skipped for r in results] == [False, True, True]
        assert engine.step_count == 1
        for unit, views in ref_params.items():
            for name, want in views.items():
                assert _rel(host.views(unit)[name], want) <= RTOL, f"{unit}.{name} not rolled back"
    _no_threads_left(before)


@pytest.mark.timeout(30)
def test_skipped_steps_are_numbered_as_the_run_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    """A run that starts from another run's AdamW state continues its Adam step count (bias correction),
    but its messages number the steps from its own first: the skip warning and the stop name run steps."""
    cfg = ToyConfig(num_layers=3)
    model = _PoisonableToy(cfg)
    init = toy_init(model, seed=2)
    batches = toy_batches(cfg, steps=6, accum=1, seed=1)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=0.05, timeout_s=10)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with (
            caplog.at_level(logging.WARNING),
            pytest.raises(EngineError) as caught,
            Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine,
        ):
            engine.restore_schedule_state({"step": 100, "steps_before": 100})
            for step, micro in enumerate(batches):
                model.poison(step >= 1)
                engine.step(micro, lr=LR)
        assert engine.step_count == 101 and engine.schedule_state()["steps_before"] == 100
    skipped = [r.getMessage() for r in caplog.records if "skipped: gradient norm" in r.getMessage()]
    assert [m.split(" skipped")[0] for m in skipped] == ["step 2", "step 2", "step 2"]
    assert "(the last, step 2," in str(caught.value)


@pytest.mark.timeout(30)
def test_nan_without_clipping_stops_with_a_message() -> None:
    """With clipping off nothing can be taken back: the engine detects the NaN and raises."""
    cfg = ToyConfig(num_layers=3)
    model = _PoisonableToy(cfg)
    init = toy_init(model)
    batches = toy_batches(cfg, steps=3, accum=1)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, timeout_s=10)
    before = _engine_threads()
    with pytest.raises(EngineError) as caught:
        _engine_run(model, init, batches, AdamWConfig(), config, before_step=lambda step: model.poison(step == 1))
    chain = [caught.value, caught.value.__cause__]
    assert any("non-finite gradients in" in str(e) and "max_grad_norm" in str(e) for e in chain)
    _no_threads_left(before)


def test_clipping_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_grad_norm"):
        EngineConfig(max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        EngineConfig(max_grad_norm=math.inf)
    with pytest.raises(ValueError, match="max_consecutive_nonfinite"):
        EngineConfig(max_consecutive_nonfinite=0)


def test_clipping_with_fused_adamw() -> None:
    """The correction only assumes the Optimizer interface and AdamW's arithmetic, not TorchAdamW."""
    fused_adamw = pytest.importorskip("slide_core.optim.fused_adamw")
    if not fused_adamw.FusedAdamW.available():
        pytest.skip("numba is not importable")
    cfg = ToyConfig(tie_embeddings=True, num_layers=2)
    model = ToyModel(cfg)
    init = toy_init(model, seed=4)
    batches = toy_batches(cfg, steps=3, accum=2, seed=6)
    adam = AdamWConfig(weight_decay=0.1)
    ref_losses, ref_norms, ref_params, ref_state = _reference_run(model, init, batches, adam, 0.05)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=0.05)
    results, params, state, step_count = _engine_run(
        model, init, batches, adam, config, optimizer=fused_adamw.FusedAdamW(adam, threads=1)
    )
    for step, result in enumerate(results):
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL)
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL)
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


def test_bf16_clipping_smoke() -> None:
    """bf16 gradients travel through the grad store and are scaled in fp32; the norm is close to fp32's."""
    cfg = ToyConfig(num_layers=2)
    model = ToyModel(cfg)
    init = toy_init(model, seed=9)
    batches = toy_batches(cfg, steps=3, accum=2, seed=2)
    _, ref_norms, _, _ = _reference_run(model, init, batches, AdamWConfig(), 0.05)
    config = EngineConfig(compute_dtype=torch.bfloat16, transfer_chunk_numel=1024, max_grad_norm=0.05)
    results, params, _, _ = _engine_run(model, init, batches, AdamWConfig(), config)
    for step, result in enumerate(results):
        assert not result.skipped and math.isfinite(result.loss)
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=0.05)
    assert all(torch.isfinite(t).all() for views in params.values() for t in views.values())


class _SlowAdamW(TorchAdamW):
    """Host updates that take a while, so a step that waited for them is told apart from one that did not."""

    def __init__(self, config: AdamWConfig) -> None:
        super().__init__(config)
        self.calls = 0

    def step(self, *args, **kwargs) -> None:
        time.sleep(0.02)
        super().step(*args, **kwargs)
        self.calls += 1


@pytest.mark.parametrize(("max_norm", "waits"), [(1e6, False), (0.05, True)])
def test_clipping_that_does_not_trigger_does_not_wait(max_norm: float, waits: bool) -> None:
    """Note [Early clipping decision]: a step that does not clip returns before its host updates are done
    (they overlap the next forward, as with clipping off); a first step that clips waits for them, corrects
    them, and the weights still match clip_grad_norm_ + AdamW."""
    cfg = ToyConfig(num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=3, accum=1, seed=8)
    adam = AdamWConfig(weight_decay=0.1)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=max_norm)
    applied_after_step: list[int] = []
    optimizer = _SlowAdamW(adam)
    results, params, state, step_count = _engine_run(
        model,
        init,
        batches,
        adam,
        config,
        optimizer=optimizer,
        after_step=lambda step: applied_after_step.append(optimizer.calls),  # host updates done so far
    )
    per_step = optimizer.calls // len(batches)  # every step updates the same ranges
    if waits:  # the first step speculates and is judged once all of it is applied; later ones defer (below)
        assert applied_after_step[0] == per_step, applied_after_step
    else:
        assert applied_after_step[0] < per_step, applied_after_step
    ref_losses, ref_norms, ref_params, ref_state = _reference_run(model, init, batches, adam, max_norm)
    for step, result in enumerate(results):
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL)
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL)
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)


def test_clipped_steps_defer_the_next_steps_updates() -> None:
    """Note [Deferred clipped steps]: after a step that clipped, host updates wait for the norm instead of
    speculating. Only the first step is corrected; every later one applies each range once, with the
    final coefficient, and returns before those updates are done; the run equals clip_grad_norm_ + AdamW."""
    cfg = ToyConfig(num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=5)
    batches = toy_batches(cfg, steps=4, accum=1, seed=8)
    adam = AdamWConfig(weight_decay=0.1)
    max_norm = 0.05
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, max_grad_norm=max_norm)
    optimizer = _SlowAdamW(adam)
    corrected: list[str] = []
    applied_after_step: list[int] = []

    def count_corrections(engine: Engine) -> None:
        correct = engine.host_pipeline.correct

        def counting_correct(unit, *args):
            corrected.append(unit.name)
            return correct(unit, *args)

        engine.host_pipeline.correct = counting_correct

    results, params, state, step_count = _engine_run(
        model,
        init,
        batches,
        adam,
        config,
        optimizer=optimizer,
        after_step=lambda step: applied_after_step.append(optimizer.calls),
        on_start=count_corrections,
    )
    assert sorted(corrected) == sorted(unit.name for unit in model.units), "only the first step is corrected"
    per_step = optimizer.calls // len(batches)
    assert optimizer.calls == per_step * len(batches)  # one optimizer pass per range and step, no redo
    assert applied_after_step[0] == per_step  # speculated: judged after all of it was applied
    assert applied_after_step[1] < 2 * per_step, applied_after_step  # deferred: overlaps what follows
    ref_losses, ref_norms, ref_params, ref_state = _reference_run(model, init, batches, adam, max_norm)
    assert all(norm > max_norm for norm in ref_norms.values()), "test setup: every step must clip"
    for step, result in enumerate(results):
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL)
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL)
    _assert_weights_and_state(params, state, ref_params, ref_state, step_count)
