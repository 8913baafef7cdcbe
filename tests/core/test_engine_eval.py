"""``Engine.evaluate`` against plain PyTorch, and against training without it, on the CPU device in fp32.

See Note [Evaluation between steps] in slide_core/engine/evaluation.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig, EvalResult
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, packed_row, reference_loss, toy_batches, toy_init
from slide_core.tiers.host_ram import HostRamTier

LR = 3e-3

CASES = {
    # name: (tied, block_slots, engine options, state tier, activation tier)
    "untied-slots1": (False, 1, {}, False, False),
    "tied": (True, 2, {}, False, False),
    "resident": (True, 2, {"resident_units": ("embed", "layers.1")}, False, False),
    "resident-head": (False, 1, {"resident_units": ("head", "layers.0")}, False, False),
    "nvme-state": (True, 2, {"offloaded_units": ("embed", "layers.0", "layers.2")}, True, False),
    "activations-tier": (False, 2, {}, False, True),
    "everything": (True, 2, {"resident_units": ("layers.1",), "offloaded_units": ("embed", "head")}, True, True),
    # GPU-streamed updates (the device path on the CPU device): staged backward loads, never an evaluation's
    "streamed": (False, 2, {"streamed_units": ("embed", "layers.0", "layers.1", "head")}, False, False),
}


def _model(tied: bool) -> ToyModel:
    return ToyModel(ToyConfig(tie_embeddings=tied, num_layers=3))


def _config(block_slots: int, options: Mapping, **more) -> EngineConfig:
    return EngineConfig(
        block_slots=block_slots, compute_dtype=torch.float32, transfer_chunk_numel=1024, **options, **more
    )


def _eval_batches(cfg: ToyConfig) -> list:
    """Two micro-batches of different sizes, the second a packed row of three documents."""
    (ids, labels), *_ = toy_batches(cfg, steps=1, accum=1, seed=11, batch=3, seq=10)[0]
    g = torch.Generator().manual_seed(12)
    documents = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 3, 6)]
    return [(ids, labels), packed_row(documents)]


def _reference_eval(model: ToyModel, params, micro_batches) -> EvalResult:
    with torch.no_grad():
        loss_sum = sum(float(reference_loss(model, params, *micro)) for micro in micro_batches)
    loss_tokens = sum(int((micro[1][:, 1:] != -100).sum()) for micro in micro_batches)
    return EvalResult(loss_sum, loss_tokens, sum(int(micro[0].numel()) for micro in micro_batches))


class _Run:
    """One engine over the toy model, with the tiers a case asks for."""

    def __init__(self, case: str, *, optimizer=None, **more) -> None:
        tied, block_slots, options, state_tier, activation_tier = CASES[case]
        self.model = _model(tied)
        self.init = toy_init(self.model, seed=5)
        self.stack = ExitStack()
        device = self.stack.enter_context(CPUDevice())
        self.host = HostParameters(self.model, device.alloc_pinned)
        load_init(self.host, self.init)
        tiers = {
            "state_tier": self.stack.enter_context(HostRamTier()) if state_tier else None,
            "activation_tier": self.stack.enter_context(HostRamTier()) if activation_tier else None,
        }
        config = _config(block_slots, options, **more)
        self.optimizer = optimizer or TorchAdamW(AdamWConfig(weight_decay=0.1))
        self.engine = self.stack.enter_context(Engine(self.model, device, self.host, self.optimizer, config, **tiers))

    def host_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """The current master weights (device-resident ones copied back by a drain)."""
        self.engine.drain()
        return {unit.name: {n: v.clone() for n, v in self.host.views(unit).items()} for unit in self.model.units}

    def close(self) -> None:
        self.stack.close()


def _assert_eval_equal(got: EvalResult, want: EvalResult) -> None:
    assert got.loss_tokens == want.loss_tokens
    assert got.tokens == want.tokens
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_evaluate_matches_plain_pytorch(case: str) -> None:
    """Before any step and after two, evaluate gives plain PyTorch's summed loss at the engine's weights."""
    run = _Run(case)
    try:
        micro_batches = _eval_batches(run.model.cfg)
        _assert_eval_equal(run.engine.evaluate(micro_batches), _reference_eval(run.model, run.init, micro_batches))
        for micro in toy_batches(run.model.cfg, steps=2, accum=2, seed=3):
            run.engine.step(micro, lr=LR)
        got = run.engine.evaluate(micro_batches)
        assert run.engine.step_count == 2
        _assert_eval_equal(got, _reference_eval(run.model, run.host_weights(), micro_batches))
    finally:
        run.close()


def _train(case: str, evaluate_between: bool, **more):
    """Four steps (the last two with two micro-batches), with or without an evaluation after each."""
    run = _Run(case, **more)
    try:
        cfg = run.model.cfg
        batches = toy_batches(cfg, steps=2, accum=1, seed=8) + toy_batches(cfg, steps=2, accum=2, seed=9)
        eval_batches = _eval_batches(cfg)
        results, evals = [], []
        for micro in batches:
            results.append(run.engine.step(micro, lr=LR))
            if evaluate_between:
                evals.append(run.engine.evaluate(eval_batches))
        schedule = run.engine.schedule_state()
        run.engine.drain(with_state=True)
        state = {name: slab.clone() for name, slab in run.engine.host_state.state_slabs.items()}
        return results, run.host.slab.clone(), state, schedule, evals
    finally:
        run.close()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
@pytest.mark.parametrize("case", ["untied-slots1", "resident", "nvme-state", "everything", "streamed"])
def test_evaluate_between_steps_changes_nothing(case: str, max_grad_norm: float) -> None:
    """Steps with an evaluation after each give the same bits as steps without: losses, norms, weights,
    Adam state and the schedule state (with max_grad_norm 0.05 every step clips, so every step after the
    first defers its host updates: Note [Deferred clipped steps])."""
    without = _train(case, evaluate_between=False, max_grad_norm=max_grad_norm)
    with_eval = _train(case, evaluate_between=True, max_grad_norm=max_grad_norm)
    if max_grad_norm:
        assert all(result.grad_norm > max_grad_norm for result in without[0]), "test setup: every step must clip"
    assert [(r.loss, r.grad_norm, r.skipped) for r in with_eval[0]] == [
        (r.loss, r.grad_norm, r.skipped) for r in without[0]
    ]
    assert torch.equal(with_eval[1], without[1])
    for name, slab in without[2].items():
        assert torch.equal(with_eval[2][name], slab), name
    assert with_eval[3] == without[3]
    assert with_eval[4][0].loss_sum != with_eval[4][-1].loss_sum, "the evaluations saw the training"


class _SlowAdamW(TorchAdamW):
    """Host updates that take a while, counted, so an evaluation starts while some are still pending."""

    def __init__(self, config: AdamWConfig) -> None:
        super().__init__(config)
        self.calls = 0
        self._lock = threading.Lock()

    def step(self, *args, **kwargs) -> None:
        time.sleep(0.01)
        super().step(*args, **kwargs)
        with self._lock:
            self.calls += 1


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_evaluate_sees_pending_updates(max_grad_norm: float) -> None:
    """Called right after a step returns, while host updates of that step are still pending (with
    clipping: the second step's deferred updates, queued only once its norm was known), evaluate waits
    for each unit's update and sees the weights after the step."""
    run = _Run("untied-slots1", optimizer=_SlowAdamW(AdamWConfig(weight_decay=0.1)), max_grad_norm=max_grad_norm)
    try:
        micro_batches = _eval_batches(run.model.cfg)
        pending = []
        for micro in toy_batches(run.model.cfg, steps=2, accum=1, seed=4):
            run.engine.step(micro, lr=LR)
            before = run.optimizer.calls
            got = run.engine.evaluate(micro_batches)
            pending.append(before)
            per_step = run.optimizer.calls // run.engine.step_count
            _assert_eval_equal(got, _reference_eval(run.model, run.host_weights(), micro_batches))
        assert pending[-1] < 2 * per_step, "test setup: the updates should still be pending at evaluate"
    finally:
        run.close()


def test_evaluate_needs_micro_batches() -> None:
    run = _Run("tied")
    try:
        with pytest.raises(ValueError, match="at least one micro-batch"):
            run.engine.evaluate([])
        ids, _ = toy_batches(run.model.cfg, steps=1, accum=1)[0][0]
        with pytest.raises(ValueError, match="micro-batch 0 has 1 parts"):
            run.engine.evaluate([(ids,)])
    finally:
        run.close()


@pytest.mark.parametrize("case", ["untied-slots1", "tied", "resident", "nvme-state", "everything"])
def test_evaluation_by_groups_is_bit_exact(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Evaluation by groups]: each unit visited once for a group of micro-batches gives the loss of
    visiting it once per micro-batch, bit for bit, and loads each sliding unit once per group."""
    from slide_core.engine import evaluation

    cfg = _model(False).cfg
    micro_batches = _eval_batches(cfg) + [b for step in toy_batches(cfg, steps=2, accum=2, seed=4) for b in step]
    host_batches = [evaluation.split_micro_batch(m, i) for i, m in enumerate(micro_batches)]
    results, loads = {}, {}
    for group in (1, evaluation.MAX_EVAL_GROUP):
        monkeypatch.setattr(evaluation, "MAX_EVAL_GROUP", group)
        run = _Run(case)
        try:
            # the toy's blocks hold every micro-batch's activations beyond the first
            assert run.engine._group_size(host_batches) == min(group, len(micro_batches))
            loads[group] = _count_loads(run, monkeypatch)
            results[group] = run.engine.evaluate(micro_batches)
        finally:
            run.close()
    one, grouped = results[1], results[evaluation.MAX_EVAL_GROUP]
    assert grouped == one  # the same summed loss, bit for bit, and the same token counts
    model = _model(CASES[case][0])
    _assert_eval_equal(grouped, _reference_eval(model, toy_init(model, seed=5), micro_batches))
    # Fewer loads where the slots cannot keep every sliding unit between micro-batches; never more.
    assert len(loads[evaluation.MAX_EVAL_GROUP]) <= len(loads[1])
    if case == "untied-slots1":
        assert len(loads[evaluation.MAX_EVAL_GROUP]) * 2 <= len(loads[1])


def _count_loads(run: _Run, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the units the run's loader loads from now on, in order."""
    loaded: list[str] = []
    original = run.engine.loader._load

    def load(slot, unit):
        loaded.append(unit.name)
        return original(slot, unit)

    monkeypatch.setattr(run.engine.loader, "_load", load)
    return loaded
