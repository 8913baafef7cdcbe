"""`slide doctor`: what this machine and install can run, in one screen.

Every probe is independent and guarded: an optional package that is missing, or installed but broken
(a kvikio wheel for another CUDA, a flash-attn built for another torch), becomes a line saying so, never
a traceback. That is the point of the command: it is what people run when something does not work.

``kernels.attention`` says which of HF's attention implementations training runs on each device type
here (slide_hf/adapters/attention.py): for plain and for logit-capped (Gemma 2) layers, or, with
``--model``, for each layer type of that model. ``kernels.linear_attention`` says, per device type, whether
gated delta-net layers (Qwen3.5, Qwen3-Next) run flash-linear-attention or transformers' torch path, and
why (slide_hf/adapters/linear_attention.py); on a GPU that takes a tiny check of fla's kernel there.

``machine_rates`` measures this machine's host memory bandwidth, PCIe each way, the host AdamW per state format
and the GPU, and caches them for planning (slide_hf/machine_rates.py): `slide plan`, and `slide train`'s
``--update-placement auto``, read that cache. Each run of the command measures again (a few seconds).

Plugins speak for themselves: the device plugin ``--device auto`` picks and every ``slide.tiers`` plugin
are found through the registry (slide_core/plugins.py) and asked for their ``doctor_facts()`` (slide-rocm's
device answers with its policy, slide-io's gds tier with whether GPUDirect Storage is real here), so this
command imports neither distribution and reports third-party plugins the same way.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from slide_hf.machine_rates import MeasureSizes

__all__ = ["add_parser", "collect", "render", "run"]

DISTRIBUTIONS = (
    "torch",
    "triton",
    "transformers",
    "safetensors",
    "flash-attn",
    "kvikio",
    "slide-core",
    "slide-hf",
    "slide-kernels",
    "slide-io",
    "slide-rocm",
)

MEASURE_SIZES = MeasureSizes()
"""How much each rate measurement moves (the defaults leave the caches; tests shrink them)."""

EPILOG = textwrap.dedent(
    """\
    examples:
      slide doctor
      slide doctor --model gemma2-9b      # which attention each of its layer types runs
      slide doctor --json > doctor.json   # attach to a bug report
    """
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="report versions, devices, kernels, storage and plugins",
        description="Report what this machine and install can run: versions, GPU, host RAM, kernels, I/O, plugins.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--model",
        metavar="NAME_OR_DIR",
        help="a preset or HF model directory: also say which attention each of its layer types runs",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    model = _model(args.model) if args.model else None
    report = collect(model, measure=MEASURE_SIZES)
    print(json.dumps(report) if args.json else render(report))
    return 0


def _model(name: str) -> Any:
    """The adapter's model for ``name`` (on the meta device: nothing allocated); a bad name is a one-line
    user error, not a line in the report."""
    from slide_hf import build_model, resolve_model
    from slide_hf.errors import UserError

    try:
        config, _ = resolve_model(name)
        return build_model(config)
    except ValueError as error:
        raise UserError(str(error)) from None


def collect(model: Any = None, measure: MeasureSizes | None = None) -> dict[str, Any]:
    """The whole report as plain data (strings, numbers, lists, dicts); ``model`` (an adapter's model)
    adds its per-layer-type attention; ``measure`` measures this machine's rates at those sizes and
    replaces their cache (without it the report has no ``machine_rates``)."""
    report = {
        "versions": _guard(_versions),
        "device": _guard(_device),
        "host": _guard(_host),
        "kernels": _guard(lambda: _kernels(model)),
        "storage": _guard(_storage),
        "plugins": _guard(_plugins),
    }
    if measure is not None:
        report["machine_rates"] = _guard(lambda: _machine_rates(measure))
    return report


def _machine_rates(sizes: MeasureSizes) -> dict[str, Any]:
    """Measure the rates planning divides by, cache them, and say what they are and where they went."""
    from slide_hf.machine_rates import refresh_cached

    rates, path = refresh_cached(sizes)
    info: dict[str, Any] = {
        "cache": str(path),
        "measured_at": rates.measured_at,
        "host_copy_gbps": round(rates.host_copy_gbps, 1),
        "host_triad_gbps": round(rates.host_triad_gbps, 1),
        "cpu_adam": {
            state: f"{gparams:.3g} Gparam/s ({rates.cpu_adam_gbps(state):.3g} GB/s)"
            for state, gparams in rates.cpu_adam_gparams.items()
        },
        "cpu_adam_split_master": {
            state: f"{gparams:.3g} Gparam/s" for state, gparams in rates.cpu_adam_split_gparams.items()
        }
        or "n/a (the optimizer takes no split master)",
    }
    for name in ("h2d_gbps", "d2h_gbps", "pcie_duplex_gbps", "gpu_mem_gbps", "gpu_tflops"):
        value = getattr(rates, name)
        info[name] = "n/a (no CUDA GPU)" if value is None else round(value, 1)
    return info


def _guard(probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return probe()
    except Exception as error:  # a broken optional install must not take the report down
        return {"error": _one_line(error)}


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _versions() -> dict[str, Any]:
    versions: dict[str, Any] = {"python": f"{platform.python_version()} ({sys.executable})"}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _device() -> dict[str, Any]:
    """The accelerator here, and the ``slide.devices`` plugin ``--device auto`` picks for it."""
    import torch

    from slide_core.devices import auto_device_name

    if not torch.cuda.is_available():
        reason = (
            "torch is a CPU build" if torch.version.cuda is None and torch.version.hip is None else "no GPU visible"
        )
        return {"backend": "cpu", "detail": f"no accelerator ({reason}); training runs on the CPU device"}
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "backend": auto_device_name(),
        "name": props.name,
        "memory_bytes": int(props.total_memory),
        "count": torch.cuda.device_count(),
    }
    if torch.version.hip:
        info["hip"] = torch.version.hip
    else:
        info["cuda"] = torch.version.cuda
        info["capability"] = f"{props.major}.{props.minor}"
    facts = _guard(lambda: _plugin_facts("slide.devices", info["backend"]))
    if facts:
        info["policy"] = facts
    return info


def _plugin_facts(group: str, name: str) -> dict[str, Any]:
    """What the plugin ``name`` of ``group`` says about this machine (``doctor_facts``), or one line saying
    why it could not be asked (not installed, does not import)."""
    from slide_core import plugins
    from slide_core.device import Device
    from slide_core.tier import Tier

    expected = Device if group == "slide.devices" else Tier
    try:
        plugin = plugins.load(group, name, expected=expected)
    except plugins.PluginError as error:
        return {"detail": _one_line(error)}
    return dict(plugin.doctor_facts())


def _host() -> dict[str, Any]:
    import psutil

    memory = psutil.virtual_memory()
    return {
        "ram_total_bytes": int(memory.total),
        "ram_available_bytes": int(memory.available),
        "cpu_cores_logical": os.cpu_count() or 0,
        "cpu_cores_physical": psutil.cpu_count(logical=False) or 0,
        "platform": platform.platform(),
    }


def _kernels(model: Any = None) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import slide_kernels

        for device_type in ("cuda", "cpu"):
            usable = slide_kernels.kernels_available(device_type)
            info[f"triton_{device_type}"] = "yes" if usable else "no (torch fallback)"
    except Exception as error:
        info["triton"] = f"slide-kernels unusable: {_one_line(error)}"
    info["flash_attn"] = _importable("flash_attn")
    info["host_adamw"] = _host_adamw()
    info["attention"] = _guard(lambda: _attention(model))
    info["linear_attention"] = _guard(lambda: _linear_attention(model))
    return info


def _host_adamw() -> str:
    """Which host AdamW `--optimizer auto` runs here: the fused numba kernel, or torch ops at about 1.5x its
    memory traffic on what usually binds a step (said with the fix, since a missing numba is an install slip)."""
    from slide_core.optim.fused_adamw import FusedAdamW

    if FusedAdamW.available():
        import numba

        return f"FusedAdamW (numba {numba.__version__}: one fused pass, 26 B/param)"
    return "TorchAdamW (numba not importable: bf16 grads cast first, ~40 B/param; `pip install numba` for the fused kernel)"


def _linear_attention(model: Any) -> dict[str, Any]:
    """Per device type, the path delta-net layers run at bf16 and why: ``model``'s own choice where it has
    such layers, else the rule's answer for any model that has."""
    import torch

    from slide_hf.adapters.linear_attention import LinearAttention

    owner = getattr(model, "linear_attention", None)
    if owner is None:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        owner = LinearAttention.for_class(Qwen3NextGatedDeltaNet)
    device_types = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
    devices = {
        t: torch.device(t, 0) if t == "cuda" else torch.device(t) for t in device_types
    }  # the GPU "device" reports
    return {t: owner.path_for(device, torch.bfloat16).describe() for t, device in devices.items()}


def _attention(model: Any) -> dict[str, Any]:
    """Per device type this machine has, the attention training runs there (bf16, the default compute
    dtype): for ``model``'s layer types, or without one for the two cases the rule tells apart."""
    import torch

    from slide_hf.adapters.attention import AttentionSupport, LayerAttention, attention_summary, choose_attention

    info: dict[str, Any] = {}
    for device_type in ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",):
        if model is not None:
            info[device_type] = attention_summary(model, device_type, torch.bfloat16)
            continue
        support = AttentionSupport.detect(device_type, torch.bfloat16)
        plain = choose_attention(LayerAttention(), support)
        capped = choose_attention(LayerAttention(softcap=50.0), support)
        info[device_type] = f"{plain}; layers with a logit softcap (Gemma 2): {capped}"
    return info


def _storage() -> dict[str, Any]:
    """kvikio, and what every ``slide.tiers`` plugin says about itself here (slide-io's gds tier: whether
    GPUDirect Storage is real). ``gds`` always has a line: the tier's, or why there is none."""
    from slide_core import plugins

    info: dict[str, Any] = {"kvikio": _importable("kvikio")}
    try:
        names = plugins.available("slide.tiers")
    except Exception as error:  # unreadable package metadata
        info["tiers"] = f"error: {_one_line(error)}"
        names = []
    for name in names:
        facts = _plugin_facts("slide.tiers", name)
        detail = facts.pop("detail", None)
        if detail is not None:
            info[name] = detail
        info.update(facts)
    if "gds" not in info:
        info["gds"] = plugins.install_hint("slide.tiers", "gds") or "no slide.tiers plugin reports on it"
    return info


def _plugins() -> dict[str, Any]:
    from slide_core import plugins

    found: dict[str, Any] = {}
    for group in plugins.GROUPS:
        try:
            found[group] = plugins.available(group)
        except Exception as error:
            found[group] = f"error: {_one_line(error)}"
    return found


def _importable(module: str) -> str:
    """``"yes (version)"`` or ``"no (why)"``; any exception counts as not importable (broken builds raise
    OSError or undefined-symbol ImportErrors, not ModuleNotFoundError)."""
    try:
        imported = importlib.import_module(module)
    except Exception as error:
        return f"no ({_one_line(error)})"
    return f"yes ({getattr(imported, '__version__', 'unknown version')})"


def render(report: dict[str, Any]) -> str:
    """Human-readable text: one section per probe, one ``key: value`` line per fact."""
    lines: list[str] = []
    for section, values in report.items():
        lines.append(f"{section}:")
        lines += _lines(values, indent="  ")
    return "\n".join(lines)


def _lines(values: dict[str, Any], indent: str) -> list[str]:
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += _lines(value, indent + "  ")
            continue
        if isinstance(value, list):
            value = ", ".join(value) or "none"
        elif key.endswith("_bytes") and isinstance(value, int):
            value = f"{value / 2**30:.1f} GiB"
        out.append(f"{indent}{key}: {value}")
    return out
