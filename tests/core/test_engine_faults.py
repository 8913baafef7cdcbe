"""Worker failures surface in the caller within seconds; nothing hangs and no thread is left behind.

See Note [Worker failures] in slide_core/engine/workers.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig, EngineTimeout, WorkerFailure
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel


class _Injected(RuntimeError):
    pass


class _FailingAdamW(TorchAdamW):
    def __init__(self, fail_on_call: int) -> None:
        super().__init__(AdamWConfig())
        self.calls = 0
        self.fail_on_call = fail_on_call

    def step(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise _Injected("injected optimizer failure")
        super().step(*args, **kwargs)


class _FailingTransferDevice(CPUDevice):
    """Fails the n-th host-to-device copy, which runs on the h2d transfer thread."""

    def __init__(self, role: str, fail_on_call: int) -> None:
        super().__init__()
        self.role = role
        self.calls = 0
        self.fail_on_call = fail_on_call

    def stream(self, role: str):
        if role == self.role and threading.current_thread().name.startswith("slide-"):
            self.calls += 1
            if self.calls == self.fail_on_call:
                raise _Injected(f"injected {role} transfer failure")
        return super().stream(role)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("slide-") and t.is_alive()]


def _run_until_failure(device: CPUDevice, optimizer: TorchAdamW, timeout_s: float = 5.0) -> BaseException:
    model = ToyModel(ToyConfig(num_layers=3))
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    before = set(_engine_threads())
    began = time.monotonic()
    with device, pytest.raises(Exception) as caught:
        host = HostParameters(model, device.alloc_pinned)
        model.init_({u.name: host.views(u) for u in model.units}, 0)
        config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, timeout_s=timeout_s)
        with Engine(model, device, host, optimizer, config) as engine:
            for _ in range(20):
                engine.step([(ids, ids)], lr=1e-3)
    assert time.monotonic() - began < timeout_s + 5.0
    deadline = time.monotonic() + 5.0
    while set(_engine_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(_engine_threads()) - before, "engine threads left behind"
    return caught.value


@pytest.mark.timeout(30)
def test_optimizer_failure_raises_in_caller() -> None:
    error = _run_until_failure(CPUDevice(), _FailingAdamW(fail_on_call=5))
    assert isinstance(error, (WorkerFailure, _Injected))
    chain = [error, error.__cause__]
    assert any(isinstance(e, _Injected) and "injected optimizer failure" in str(e) for e in chain)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("role", ["h2d", "d2h"])
def test_transfer_failure_raises_in_caller(role: str) -> None:
    error = _run_until_failure(_FailingTransferDevice(role, fail_on_call=4), TorchAdamW(AdamWConfig()))
    chain = [error, error.__cause__]
    assert any(isinstance(e, _Injected) and f"injected {role} transfer failure" in str(e) for e in chain)


@pytest.mark.timeout(30)
def test_a_stuck_wait_times_out_with_a_message() -> None:
    class _SlowAdamW(TorchAdamW):
        def step(self, *args, **kwargs) -> None:
            time.sleep(3.0)

    error = _run_until_failure(CPUDevice(), _SlowAdamW(AdamWConfig()), timeout_s=1.0)
    timeout = error if isinstance(error, EngineTimeout) else error.__cause__
    assert isinstance(timeout, EngineTimeout)
    assert "timed out after 1 s waiting for" in str(timeout)


def test_two_engines_coexist() -> None:
    """No module-global state: two engines in one process train independently."""
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    results = []
    with CPUDevice() as device:
        models = [ToyModel(ToyConfig(num_layers=2)) for _ in range(2)]
        hosts = [HostParameters(m, device.alloc_pinned) for m in models]
        for model, host in zip(models, hosts, strict=True):
            model.init_({u.name: host.views(u) for u in model.units}, 0)
        config = EngineConfig(compute_dtype=torch.float32)
        with (
            Engine(models[0], device, hosts[0], TorchAdamW(AdamWConfig()), config) as first,
            Engine(models[1], device, hosts[1], TorchAdamW(AdamWConfig()), config) as second,
        ):
            for _ in range(3):
                results.append((first.step([(ids, ids)], 1e-3).loss, second.step([(ids, ids)], 1e-3).loss))
    assert all(a == b for a, b in results)
