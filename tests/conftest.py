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

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (Note [A module fixture is built once])
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Note [A module fixture is built once]: every xdist worker that runs a test builds that test's
    module-scoped fixtures for itself, and some of them launch data-parallel ranks or train a run. Tests that
    use one are put in one ``xdist_group`` per module, which ``--dist loadgroup`` (hatch.toml) sends to a
    single worker; the other tests are spread one by one, as with ``--dist load``. Without xdist, nothing
    changes."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        if any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


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
def slide(capsys: pytest.CaptureFixture[str], torch_kernels: None) -> Slide:
    """``slide(*argv) -> (exit status, stdout, stderr)``: the `slide` command run in-process through
    ``slide_hf.cli.main.main`` (no interpreter start, no second import of torch and transformers), on
    slide-kernels' torch fallback as on a CPU user's machine. Every command's parser is built, as in a
    real run: a command whose ``add_parser`` fails fails the test."""
    pytest.importorskip("transformers")
    from slide_hf.cli.main import main

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
