"""bench/'s scripts never shadow a package: `python bench/X.py` puts bench/ first on sys.path, so a script
named like a package that the run imports (transformers imports ``kernels`` for some families) is imported
in its place, and the run fails far from the cause (``cannot import name 'CUDAProperties' from 'kernels'``)."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# Top-level names that slide, torch, transformers and their optional extras import, whether or not they are
# installed here (find_spec below catches the installed ones): a bench script must not take any of them.
KNOWN_PACKAGES = frozenset(
    {
        "accelerate",
        "bitsandbytes",
        "datasets",
        "deepspeed",
        "einops",
        "fla",
        "flash_attn",
        "huggingface_hub",
        "jinja2",
        "kernels",
        "kvikio",
        "liger_kernel",
        "mlflow",
        "numba",
        "numpy",
        "optimum",
        "packaging",
        "peft",
        "psutil",
        "pyarrow",
        "regex",
        "safetensors",
        "sentencepiece",
        "tensorboard",
        "tiktoken",
        "timm",
        "tokenizers",
        "torch",
        "torchao",
        "torchvision",
        "tqdm",
        "transformers",
        "triton",
        "wandb",
        "xformers",
        "yaml",
    }
)


def _bench_modules() -> list[str]:
    return sorted(path.stem for path in BENCH.glob("*.py"))


def _path_without_bench() -> list[str]:
    """sys.path as a process sees it when bench/ is not on it."""
    return [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]


def test_bench_holds_scripts():
    assert "gpu_matrix" in _bench_modules()  # the glob looks in the right folder


@pytest.mark.parametrize("name", _bench_modules())
def test_no_bench_script_shadows_a_package(name):
    assert name not in KNOWN_PACKAGES, f"bench/{name}.py shadows the package {name!r}"
    assert name not in sys.stdlib_module_names, f"bench/{name}.py shadows the standard library's {name!r}"
    assert name not in sys.builtin_module_names, f"bench/{name}.py shadows the built-in module {name!r}"
    found = importlib.machinery.PathFinder.find_spec(name, _path_without_bench())
    assert found is None, f"bench/{name}.py shadows {name!r} installed at {found.origin}"
