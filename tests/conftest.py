"""Suite-wide setup: Triton's interpreter on machines without a GPU, numba's compile before the first
test, throwaway plugin distributions, slide-kernels' torch fallback on request (``torch_kernels``) and the
`slide` command run in-process (``slide``).

Triton reads TRITON_INTERPRET when a kernel is first defined, so it has to be set before the first import
of slide_kernels anywhere in the session, which is why it happens here, at import. Without a GPU the
kernels run in the interpreter (fp32); with one nothing is set, so `python -m pytest -m gpu` compiles the
kernels for the GPU. Setting TRITON_INTERPRET yourself still wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_cores_with_the_other_workers() -> None:
    """Note [One core per test worker]: under pytest-xdist (``hatch test``: one worker per core), each
    worker's torch would start one OpenMP thread per core of the machine, so N workers run N times as many
    threads as there are cores. torch's small CPU ops then wait at every parallel region for a thread whose
    core another worker holds (on a busy 2-core machine, an RMSNorm of 64 x 4096 took ten times as long with two threads as with one). Each worker takes
    its share of the cores for torch's own ops (``OMP_NUM_THREADS`` where it is unset, which the `slide`
    processes a test starts inherit). numba's ``NUMBA_NUM_THREADS`` is left alone: `slide train` sets it
    for each rank (Note [Host cores per rank] in slide_hf/launch.py) and a test checks the share it
    sets."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    share = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


_share_cores_with_the_other_workers()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Note [A module fixture is built once]: under ``--dist loadgroup`` (hatch.toml), a test module that
    defines a module-scoped fixture is one unit of work, sent whole to one worker, which builds the fixture
    once (some launch data-parallel ranks or train a run; with tests spread one by one, each worker would
    build its own). Every other test is a unit of its own, as with ``--dist load``. xdist sends the largest
    units first, so the single tests even out the end of the run.

    xdist's own ``xdist_group`` marks still form groups. They do not reach the scheduler under pytest 9
    (xdist 3.8 renames ``item._nodeid``, which a pytest 9 node no longer reads), so the modules are grouped
    here, by reading their source, on the controller, which has no collected items to look at.

    Note [The slow tests go first]: xdist orders the units by their number of tests, so the single tests
    would go in collection order, and a slow one (a subprocess run of tens of seconds) collected late would
    run alone at the end while the other worker idles. The units go longest first instead, as far as the
    controller can tell from the source: the module groups (xdist's order, largest first), then the single
    tests marked ``slow`` (``@pytest.mark.slow`` on the test function), then the rest, each in collection
    order. The fast single tests then even out the end of the run.

    Note [One worker launches the ranks]: the modules that launch several processes (``launch_ranks``, or
    `slide train --nproc-per-node 2` run as a subprocess) are one unit, run by one worker one after another,
    while the other worker runs the tests that stay in one process. Two launches at once put 4 to 6 processes
    on 2 cores, and ranks that wait for each other in a collective then wait for a core as well: a 2-rank
    run took 2 to 3 times as long beside another launch as beside a single-process test."""
    if config.getvalue("dist") != "loadgroup":
        return None
    import re

    from xdist.scheduler import LoadGroupScheduling

    root = config.rootpath
    slow_mark = re.compile(r"^@pytest\.mark\.slow\b[^\n]*\n(?:@[^\n]*\n|\s[^\n]*\n)*?def (test_\w+)", re.M)

    class ModuleFixtureScheduling(LoadGroupScheduling):
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.shares_a_module_fixture: dict[str, bool] = {}
            self.slow_tests: dict[str, set[str]] = {}
            self.launches_ranks: dict[str, bool] = {}
            self.ordered = False

        def _read(self, module: str) -> None:
            source = root / module
            text = source.read_text(encoding="utf-8") if source.is_file() else ""
            self.shares_a_module_fixture[module] = 'scope="module"' in text
            self.slow_tests[module] = set(slow_mark.findall(text))
            self.launches_ranks[module] = "launch_ranks(" in text or (
                '"--nproc-per-node", "2"' in text and "subprocess.run(" in text
            )

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if scope != nodeid:  # an xdist_group mark
                return scope
            module = nodeid.split("::", 1)[0]
            if module not in self.shares_a_module_fixture:
                self._read(module)
            if self.launches_ranks[module]:  # Note [One worker launches the ranks]
                return "ranks launched"
            return module if self.shares_a_module_fixture[module] else nodeid

        def _priority(self, scope: str, tests: dict[str, bool]) -> int:
            if len(tests) > 1 or scope not in tests:  # a module group (or an xdist_group)
                return 0
            module, _, name = scope.partition("::")
            if module not in self.slow_tests:
                self._read(module)
            return 1 if name.split("[", 1)[0] in self.slow_tests[module] else 2

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete when the first unit is assigned (Note above)
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: self._priority(*unit))  # stable
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return ModuleFixtureScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _numba_compiled() -> None:
    """Compile FusedAdamW's kernels (or load them from numba's on-disk cache) once, before any test, so no
    test's duration includes a compile that only the first user of the optimizer in a session would pay."""
    try:
        from slide_core.optim.adamw_config import AdamWConfig
        from slide_core.optim.fused_adamw import FusedAdamW
    except ImportError:  # a kernels-only checkout
        return
    if FusedAdamW.available():
        FusedAdamW(AdamWConfig()).warmup()


@pytest.fixture(scope="session", autouse=True)
def _machine_rates_in_a_private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The machine rates `slide doctor` caches (slide_hf/machine_rates.py) go to this session's directory
    unless a test names one (``XDG_CACHE_HOME``): a test must neither write the user's cache nor plan with
    rates an earlier test measured there."""
    try:
        from slide_hf import machine_rates
    except ImportError:  # a checkout without slide-hf
        yield
        return
    private = tmp_path_factory.mktemp("cache")
    user_cache_dir = machine_rates.cache_dir

    def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
        if environ is not None:  # a test of the rule itself
            return user_cache_dir(environ)
        return Path(os.environ.get("XDG_CACHE_HOME") or private) / "slide"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine_rates, "cache_dir", cache_dir)
        yield


_TORCH_KERNELS = ("SLIDE_KERNELS_BACKEND", "torch")


@pytest.fixture
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """slide-kernels' torch fallback for this test: the path a CPU user's run takes (no Triton interpreter
    outside the tests), and ~15x faster than the interpreter this file turns on for the kernel tests. It is
    set in the environment, so the processes a test launches (data-parallel ranks) take it too; through the
    test's own ``monkeypatch``, so all of a test's patches are undone together, last first."""
    monkeypatch.setenv(*_TORCH_KERNELS)


@pytest.fixture(scope="module")
def torch_kernels_module() -> Iterator[None]:
    """``torch_kernels`` for a module-scoped fixture (a run built once and shared by a module's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(*_TORCH_KERNELS)
        yield


Slide = Callable[..., tuple[int, str, str]]


@pytest.fixture
def slide(capsys: pytest.CaptureFixture[str], torch_kernels: None, monkeypatch: pytest.MonkeyPatch) -> Slide:
    """``slide(*argv) -> (exit status, stdout, stderr)``: the `slide` command run in-process through
    ``slide_hf.cli.main.main`` (no interpreter start, no second import of torch and transformers), on
    slide-kernels' torch fallback as on a CPU user's machine. Every command's parser is built, as in a
    real run: a command whose ``add_parser`` fails fails the test. `slide doctor` measures the machine's
    rates on tiny arrays (what it prints is what is tested, not the rates)."""
    pytest.importorskip("transformers")
    from slide_hf.cli import doctor
    from slide_hf.cli.main import main
    from slide_hf.machine_rates import MeasureSizes

    tiny = MeasureSizes(
        host_numel=1 << 14, adam_numel=1 << 12, reps=1, optimizer="torch-adamw", state_formats=("fp32",)
    )
    monkeypatch.setattr(doctor, "MEASURE_SIZES", tiny)

    def call(*argv: str | os.PathLike[str]) -> tuple[int, str, str]:
        status = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        return status, out, err

    return call


InstallDistribution = Callable[[str, Mapping[str, str], Mapping[str, Mapping[str, str]]], Path]


@pytest.fixture
def install_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InstallDistribution]:
    """``install_distribution(name, modules, entry_points) -> site directory``: a distribution installed
    the way pip leaves one, for this test only.

    ``modules`` maps module names to source; ``entry_points`` maps groups to ``{name: "module:attr"}``. The
    modules and a ``<name>-0.1.dist-info`` with ``METADATA`` and ``entry_points.txt`` are written to a
    fresh directory put first on ``sys.path``, and slide's plugin cache is cleared so the entry points are
    seen; both are undone afterwards."""
    from slide_core import plugins

    imported: list[str] = []

    def install(name: str, modules: Mapping[str, str], entry_points: Mapping[str, Mapping[str, str]]) -> Path:
        site = tmp_path / f"site-{name}"
        site.mkdir()
        for module, source in modules.items():
            (site / f"{module}.py").write_text(source, encoding="utf-8")
            imported.append(module)
        dist_info = site / f"{name.replace('-', '_')}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n", encoding="utf-8")
        sections = [
            f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in names.items())
            for group, names in entry_points.items()
        ]
        (dist_info / "entry_points.txt").write_text("\n".join(sections), encoding="utf-8")
        monkeypatch.syspath_prepend(str(site))
        plugins.clear_cache()
        return site

    yield install
    plugins.clear_cache()
    for module in imported:
        sys.modules.pop(module, None)
