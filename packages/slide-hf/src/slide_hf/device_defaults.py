"""What a run defaults to because of its device: the device plugin's policy reaching the run.

A device plugin knows its hardware's good choices (slide-rocm's ``ROCmPolicy``: SDPA on AOTriton or its
build of flash-attn, and never GPUDirect Storage). slide-hf asks the device (``Device.preferred_attention``,
``Device.preferred_activation_tier``) wherever it picks for a user who chose nothing: the attention here,
once the model and the device of a run meet; the activation tier where it is opened
(:func:`slide_hf.offload.open_activation_tier`).

The compute dtype left unset (no ``--dtype``) is the device's too (:func:`default_compute_dtype`): bfloat16 on
a GPU and on a CPU that computes it natively, float32 on any other CPU. Without native bfloat16 (x86's
AVX512-BF16 or AMX-BF16, ARM's BF16 extension) torch converts every bf16 operand to fp32 and back around each
op, so bf16 is far slower than fp32 there (the demo run on a 2-core AVX2 EPYC: 45 tokens/s in bf16, 1,800 in
fp32). ``--dtype`` given always wins.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slide_core.device import Device
from slide_hf.options.schema import DType

__all__ = [
    "CPUINFO",
    "ComputeDTypeChoice",
    "apply_device_defaults",
    "choose_compute_dtype",
    "default_compute_dtype",
    "native_bf16_flag",
]

CPUINFO = Path("/proc/cpuinfo")
"""Where Linux lists the CPU's instruction-set extensions (``flags`` on x86, ``Features`` on ARM)."""

_NATIVE_BF16: dict[str, tuple[str, frozenset[str]]] = {
    "x86": ("flags", frozenset({"avx512_bf16", "amx_bf16"})),
    "arm": ("features", frozenset({"bf16"})),
}
"""Per architecture: the /proc/cpuinfo key listing extensions, and those that compute bfloat16 natively."""
_ARCHITECTURES = {"x86_64": "x86", "amd64": "x86", "i386": "x86", "i686": "x86", "aarch64": "arm", "arm64": "arm"}


def apply_device_defaults(model: Any, device: Device) -> None:
    """Hand ``device``'s preferences to ``model``: an HF adapter's model tries the device's attention
    first for every layer that can run it (``HFCausalLM.prefer_attention``). Other models take none."""
    from slide_hf.adapters.base import HFCausalLM

    if isinstance(model, HFCausalLM):
        model.prefer_attention(device.preferred_attention())


@dataclass(frozen=True)
class ComputeDTypeChoice:
    """The compute dtype a run takes when none was given, and why, in words for its log line."""

    dtype: DType
    reason: str

    def describe(self) -> str:
        """``compute dtype float32: this CPU has no native bfloat16 (...)``."""
        return f"compute dtype {self.dtype.value}: {self.reason}"


def native_bf16_flag(cpuinfo: str, machine: str) -> str | None:
    """The extension in ``cpuinfo`` (the text of /proc/cpuinfo) that computes bfloat16 natively on a CPU of
    architecture ``machine`` (``platform.machine()``), or ``None`` when it lists none."""
    arch = _ARCHITECTURES.get(machine.lower())
    if arch is None:
        return None
    key, native = _NATIVE_BF16[arch]
    for line in cpuinfo.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip().lower() == key:
            found = native.intersection(value.split())
            if found:
                return min(found)
            return None  # every core lists the same extensions: the first list decides
    return None


def choose_compute_dtype(*, accelerator: bool, master: str, cpuinfo: str | None, machine: str) -> ComputeDTypeChoice:
    """The compute dtype for a run that gave none: bfloat16 on an accelerator and wherever ``--master split``
    (which stores the bf16 copy the GPU computes with) was asked for; on a CPU, bfloat16 only when its
    ``cpuinfo`` shows native bfloat16, float32 otherwise (also when ``cpuinfo`` could not be read: ``None``)."""
    if accelerator:
        return ComputeDTypeChoice(DType.BFLOAT16, "the default on a GPU")
    if master == "split":
        return ComputeDTypeChoice(DType.BFLOAT16, "--master split stores the bf16 copy")
    if cpuinfo is None:
        return ComputeDTypeChoice(
            DType.FLOAT32, f"cannot read {CPUINFO} to tell whether this CPU has native bfloat16 (--dtype chooses)"
        )
    flag = native_bf16_flag(cpuinfo, machine)
    if flag is not None:
        return ComputeDTypeChoice(DType.BFLOAT16, f"this CPU has native bfloat16 ({flag})")
    wanted = " or ".join(sorted(_NATIVE_BF16[_ARCHITECTURES.get(machine.lower(), "x86")][1]))
    return ComputeDTypeChoice(
        DType.FLOAT32,
        f"this CPU has no native bfloat16 (no {wanted}), where bfloat16 runs slower "
        "(--dtype bfloat16 to use it anyway)",
    )


def default_compute_dtype(accelerator: bool, master: str, cpuinfo: Path | None = None) -> ComputeDTypeChoice:
    """:func:`choose_compute_dtype` on this host, for a run on an ``accelerator`` or on its CPU: reads
    ``cpuinfo`` (:data:`CPUINFO` when ``None``) only for the CPU. `slide train` asks it for its device and
    `slide plan` for the device it plans, so the plan prices the run."""
    text = None
    if not accelerator:
        try:
            text = (cpuinfo or CPUINFO).read_text(errors="replace")
        except OSError:  # not Linux (macOS, Windows), or /proc not mounted
            text = None
    return choose_compute_dtype(accelerator=accelerator, master=master, cpuinfo=text, machine=platform.machine())
