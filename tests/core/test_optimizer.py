"""The optimizer seam (slide_core/optimizer.py): a third-party optimizer with a config dataclass of its own,
installed as a ``slide.optimizers`` plugin, built by name and run by the engine on the CPU.

The plugin below is SGD with momentum, nothing of AdamW: its config has none of AdamWConfig's fields (so an
engine that read ``optimizer.config.<field>`` would fail), and it steps a split master through
``MasterRange.updating`` without ever naming the split format.
"""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters, plugins
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW, build_optimizer
from slide_core.optim.state_formats import StateArray
from slide_core.testing import ToyConfig, ToyModel, load_init, reference_loss, toy_batches, toy_init

RTOL = 1e-5
LR = 0.05
MOMENTUM = 0.9

PLUGIN_SOURCE = """
from dataclasses import dataclass

import torch

from slide_core.master_store import as_master_range
from slide_core.optimizer import Optimizer


@dataclass(frozen=True)
class MomentumConfig:
    momentum: float = 0.9


class MomentumSGD(Optimizer):
    '''torch.optim.SGD(momentum=m, dampening=0): buf = m * buf + g (g on the first step), p -= lr * buf.'''

    config_type = MomentumConfig
    state_names = ("momentum_buffer",)
    split_master = True

    def __init__(self, config: MomentumConfig) -> None:
        super().__init__(config)
        self._decoded = torch.empty(0)
        self.warmed_up = False

    def warmup(self) -> None:
        self.warmed_up = True

    def _scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        if self._decoded.numel() < numel or self._decoded.device != device:
            self._decoded = torch.empty(numel, device=device)
        return self._decoded[:numel]

    def step(self, master, grad, state, *, lr, step, decay, grad_scale=1.0) -> None:
        buf = state["momentum_buffer"]
        g = grad.float() * grad_scale
        if step == 1:
            buf.copy_(g)
        else:
            buf.mul_(self.config.momentum).add_(g)
        with as_master_range(master).updating(self._scratch) as values:
            values.add_(buf, alpha=-lr)
"""


@pytest.fixture
def momentum_plugin(install_distribution) -> type:
    install_distribution(
        "slide-momentum",
        {"slide_momentum_sgd": PLUGIN_SOURCE},
        {"slide.optimizers": {"momentum-sgd": "slide_momentum_sgd:MomentumSGD"}},
    )
    return plugins.load("slide.optimizers", "momentum-sgd")


def test_a_plugin_is_built_with_its_own_config(momentum_plugin: type) -> None:
    import slide_momentum_sgd  # the plugin's module, installed by the fixture

    default = build_optimizer("momentum-sgd")
    assert type(default) is momentum_plugin and default.config == slide_momentum_sgd.MomentumConfig()
    assert default.warmed_up  # build_optimizer compiles (here: marks) before training
    chosen = build_optimizer("momentum-sgd", slide_momentum_sgd.MomentumConfig(momentum=0.5))
    assert chosen.config.momentum == 0.5
    assert chosen.state_format == "fp32" and chosen.state_arrays == (StateArray("momentum_buffer"),)
    assert not chosen.corrects
    with pytest.raises(
        plugins.PluginError, match=r"optimizer 'momentum-sgd' takes a MomentumConfig, got a AdamWConfig"
    ):
        build_optimizer("momentum-sgd", AdamWConfig())
    with pytest.raises(plugins.PluginError, match=r"optimizer 'torch-adamw' takes a AdamWConfig, got a MomentumConfig"):
        build_optimizer("torch-adamw", slide_momentum_sgd.MomentumConfig())
    adamw = build_optimizer("torch-adamw")  # no config: the plugin's defaults
    assert type(adamw) is TorchAdamW and adamw.config == AdamWConfig()


def _reference(model, init, batches) -> tuple[list[float], dict]:
    """Plain autograd + torch.optim.SGD(momentum)."""
    params = {unit: {name: torch.nn.Parameter(t.clone()) for name, t in views.items()} for unit, views in init.items()}
    flat = [p for views in params.values() for p in views.values()]
    optimizer = torch.optim.SGD(flat, lr=LR, momentum=MOMENTUM)
    losses = []
    for micro in batches:
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            loss = reference_loss(model, params, ids, labels)
            (loss / tokens).backward()
            total += loss.item()
        losses.append(total / tokens)
        optimizer.step()
        optimizer.zero_grad()
    return losses, params


@pytest.mark.parametrize(("accum", "resident"), [(1, ()), (2, ("embed",))])
def test_the_engine_runs_a_plugin_it_knows_nothing_of(
    momentum_plugin: type, accum: int, resident: tuple[str, ...]
) -> None:
    """Host-updated and device-resident units, against torch.optim.SGD(momentum) in fp32."""
    cfg = ToyConfig(tie_embeddings=True, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=4)
    batches = toy_batches(cfg, steps=4, accum=accum, seed=12)
    ref_losses, ref_params = _reference(model, init, batches)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, resident_units=resident)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with Engine(model, device, host, build_optimizer("momentum-sgd"), config) as engine:
            losses = [engine.step(micro, lr=LR).loss for micro in batches]
            engine.drain()
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    for unit, views in ref_params.items():
        for name, want in views.items():
            got = host.views(unit)[name]
            err = float((got - want.detach()).norm() / want.detach().norm())
            assert err <= RTOL, f"{unit}.{name} differs: relative error {err:.2e}"


def test_a_plugin_steps_a_split_master_bit_for_bit(momentum_plugin: type) -> None:
    """bf16 compute: the split master's run equals the fp32 master's bit for bit, though the plugin only
    asks its master range for writable fp32 values."""
    cfg = ToyConfig(tie_embeddings=True, num_layers=2)
    batches = toy_batches(cfg, steps=3, accum=2, seed=3)
    masters = {}
    for master_format in ("fp32", "split"):
        model = ToyModel(cfg)
        with CPUDevice() as device:
            host = HostParameters(model, device.alloc_pinned, master_format=master_format)
            load_init(host, toy_init(model, seed=2))
            config = EngineConfig(transfer_chunk_numel=1024, master_format=master_format)
            with Engine(model, device, host, build_optimizer("momentum-sgd"), config) as engine:
                losses = [engine.step(micro, lr=LR).loss for micro in batches]
                engine.drain()
            masters[master_format] = (losses, {unit.name: host.read(unit).clone() for unit in model.units})
    assert masters["split"][0] == masters["fp32"][0]
    for name, want in masters["fp32"][1].items():
        assert torch.equal(masters["split"][1][name], want), name


def test_the_optimizer_modules_import_one_another_without_a_cycle() -> None:
    """Every import between slide_core.optim's modules, the base and the master store (lazy ones inside
    functions too) points one way: the kernels and the correction never import an optimizer class."""
    import ast
    from pathlib import Path

    import slide_core

    root = Path(slide_core.__file__).parent
    files = {f"slide_core.optim.{p.stem}": p for p in (root / "optim").glob("*.py") if p.stem != "__init__"}
    files |= {f"slide_core.{name}": root / f"{name}.py" for name in ("optimizer", "master_store", "split_master")}
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        edges[module] = targets & files.keys() - {module}

    def cycle_from(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        if module in path:
            return (*path, module)
        return next((c for n in sorted(edges[module]) if (c := cycle_from(n, (*path, module)))), None)

    cycles = [c for c in (cycle_from(m, ()) for m in sorted(files)) if c]
    assert not cycles, " -> ".join(cycles[0])
