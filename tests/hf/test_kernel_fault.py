"""A CUDA error raised inside another package's kernel is reported as that package's, with the way to run
without it, through `slide`'s own error handling (slide_hf/cli/kernel_fault.py, slide_hf/cli/main.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from slide_hf.cli import doctor
from slide_hf.cli import main as cli

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be reported later"


def _module(name: str, source: str, **names: object) -> types.ModuleType:
    """A module called ``name`` (its frames say so) defining ``source``'s functions."""
    module = types.ModuleType(name)
    module.__dict__.update(names)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def _kernel(package: str, error: type[BaseException]) -> types.ModuleType:
    """``package``'s kernel, launched through a stand-in for triton's launcher, which raises ``error``."""
    launcher = _module(
        "triton.runtime.jit", "def launch():\n    raise error(message)\n", error=error, message=ILLEGAL_ACCESS
    )
    return _module(
        f"{package}.ops.gated_delta_rule.chunk", "def chunk():\n    return launch()\n", launch=launcher.launch
    )


def _run_doctor_into(monkeypatch, capsys, failing) -> tuple[int, str]:
    monkeypatch.setattr(doctor, "run", lambda args: failing())
    status = cli.main(["doctor"])
    return status, capsys.readouterr().err


def test_a_cuda_error_in_fla_names_fla_and_the_torch_path(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    kernel = _kernel("fla", torch.AcceleratorError)

    def step():  # the engine re-raises a worker's failure with the original as its cause
        try:
            kernel.chunk()
        except Exception as error:
            raise RuntimeError("the backward of block.0 failed") from error

    status, err = _run_doctor_into(monkeypatch, capsys, step)
    assert status == 1
    assert err.count("\n") == 1 and "bug in slide" not in err
    assert err.startswith(
        "slide doctor: error: a CUDA error was raised inside flash-linear-attention 0.6.0 "
        "(fla.ops.gated_delta_rule.chunk): CUDA error: an illegal memory access was encountered -- "
    )
    assert "SLIDE_LINEAR_ATTENTION=torch" in err


def test_a_cuda_runtime_error_in_another_package_names_it(monkeypatch, capsys) -> None:
    kernel = _kernel("some_kernels", RuntimeError)
    status, err = _run_doctor_into(monkeypatch, capsys, kernel.chunk)
    assert status == 1 and "bug in slide" not in err
    assert "raised inside some_kernels (some_kernels.ops.gated_delta_rule.chunk)" in err
    assert "run without that package" in err


@pytest.mark.parametrize("error", [torch.AcceleratorError, RuntimeError])
def test_a_cuda_error_in_slides_own_kernel_is_still_a_bug_in_slide(monkeypatch, capsys, error) -> None:
    kernel = _kernel("slide_kernels", error)
    status, err = _run_doctor_into(monkeypatch, capsys, kernel.chunk)
    assert status == 1
    assert "internal error" in err and "bug in slide" in err


def test_other_errors_from_a_package_are_unchanged(monkeypatch, capsys) -> None:
    fla = _module("fla.layers", "def forward():\n    raise ValueError('bad shape')\n")
    status, err = _run_doctor_into(monkeypatch, capsys, fla.forward)
    assert status == 1 and "internal error: ValueError: bad shape" in err
