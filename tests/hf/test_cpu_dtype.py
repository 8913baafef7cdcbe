"""The compute dtype a run takes without ``--dtype`` (slide_hf/device_defaults.py): float32 on a CPU without
native bfloat16, bfloat16 on one with it and on a GPU; ``--dtype`` always wins, and a resume keeps what the
run chose."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from slide_hf import device_defaults
from slide_hf.device_defaults import choose_compute_dtype, default_compute_dtype, native_bf16_flag
from slide_hf.options import DType, TrainConfig
from slide_hf.options.engine import engine_values

# /proc/cpuinfo as real CPUs write it (one core each; the flag lists shortened, the words that matter kept).
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2
bugs\t\t: sysret_ss_attrs spectre_v1 spectre_v2
"""
SKYLAKE_AVX512 = EPYC_AVX2.replace("avx2 bmi2", "avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni")
COOPER_LAKE = SKYLAKE_AVX512 + "flags\t\t: avx2 avx512f avx512_bf16\n"  # a second core: same list
SAPPHIRE_RAPIDS = SKYLAKE_AVX512.replace("avx512_vnni", "avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8")
AMX_ONLY = SKYLAKE_AVX512.replace("avx512_vnni", "avx512_vnni amx_bf16 amx_tile")
GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
"""
GRAVITON3 = GRAVITON2.replace("asimddp", "asimddp sve svebf16 i8mm bf16 dgh rng")
SVE_BF16_ONLY = GRAVITON2.replace("asimddp", "asimddp sve svebf16")  # a different word, not "bf16"


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "flag"),
    [
        (EPYC_AVX2, "x86_64", None),
        (SKYLAKE_AVX512, "x86_64", None),  # AVX-512 without BF16: torch converts bf16 around each op
        (COOPER_LAKE, "x86_64", None),  # the first core's list decides (every core lists the same)
        (SKYLAKE_AVX512.replace("avx512_vnni", "avx512_vnni avx512_bf16"), "x86_64", "avx512_bf16"),
        (SAPPHIRE_RAPIDS, "x86_64", "amx_bf16"),
        (AMX_ONLY, "AMD64", "amx_bf16"),
        (GRAVITON2, "aarch64", None),
        (GRAVITON3, "aarch64", "bf16"),
        (GRAVITON3, "arm64", "bf16"),
        (SVE_BF16_ONLY, "aarch64", None),
        (GRAVITON3, "x86_64", None),  # ARM's Features list is no x86 flags list
        (SAPPHIRE_RAPIDS, "aarch64", None),
        (SAPPHIRE_RAPIDS, "ppc64le", None),  # an architecture without a known bf16 extension
        ("", "x86_64", None),
    ],
)
def test_native_bf16_is_read_from_the_cpus_extension_list(cpuinfo, machine, flag):
    assert native_bf16_flag(cpuinfo, machine) == flag


def test_a_cpu_without_native_bf16_computes_in_float32_and_says_why():
    choice = choose_compute_dtype(accelerator=False, master="auto", cpuinfo=EPYC_AVX2, machine="x86_64")
    assert choice.dtype is DType.FLOAT32
    assert choice.describe().startswith("compute dtype float32: this CPU has no native bfloat16 (no amx_bf16 or")
    arm = choose_compute_dtype(accelerator=False, master="fp32", cpuinfo=GRAVITON2, machine="aarch64")
    assert arm.dtype is DType.FLOAT32 and "(no bf16)" in arm.reason


def test_a_cpu_with_native_bf16_and_a_gpu_keep_bfloat16():
    cpu = choose_compute_dtype(accelerator=False, master="auto", cpuinfo=SAPPHIRE_RAPIDS, machine="x86_64")
    assert (cpu.dtype, cpu.reason) == (DType.BFLOAT16, "this CPU has native bfloat16 (amx_bf16)")
    gpu = choose_compute_dtype(accelerator=True, master="auto", cpuinfo=EPYC_AVX2, machine="x86_64")
    assert gpu.dtype is DType.BFLOAT16  # the host CPU does not decide for the GPU


def test_split_master_and_an_unreadable_cpuinfo():
    split = choose_compute_dtype(accelerator=False, master="split", cpuinfo=EPYC_AVX2, machine="x86_64")
    assert split.dtype is DType.BFLOAT16  # --master split stores the bf16 copy: fp32 would refuse it
    unknown = choose_compute_dtype(accelerator=False, master="auto", cpuinfo=None, machine="arm64")
    assert unknown.dtype is DType.FLOAT32 and "cannot read" in unknown.reason


def test_the_host_cpuinfo_is_read_for_a_cpu_run_only(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(SAPPHIRE_RAPIDS)
    assert default_compute_dtype(False, "auto", cpuinfo).dtype is DType.BFLOAT16
    cpuinfo.write_text(EPYC_AVX2)
    assert default_compute_dtype(False, "auto", cpuinfo).dtype is DType.FLOAT32
    assert default_compute_dtype(True, "auto", cpuinfo).dtype is DType.BFLOAT16
    assert default_compute_dtype(False, "auto", tmp_path / "missing").dtype is DType.FLOAT32


def test_unset_dtype_passes_the_split_rule_and_bench_computes_in_bfloat16():
    assert TrainConfig().dtype is None
    assert TrainConfig(master="split").dtype is None  # chosen later: bf16, which split needs
    assert str(engine_values(TrainConfig())["compute_dtype"]) == "torch.bfloat16"  # `slide bench`'s


# -- through `slide train` ----------------------------------------------------------------------------------
RUN = ["--device", "cpu", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3", "--steps", "2"]


@pytest.fixture
def host(tmp_path, monkeypatch):
    """This test's host CPU: the cpuinfo file the device defaults read, whose text the test sets."""
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(device_defaults, "CPUINFO", cpuinfo)
    return cpuinfo


def _train(run: Path, caplog, *extra: str) -> list[str]:
    from slide_hf.cli.main import main

    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["train", *RUN, "--output", str(run), *extra]) == 0
    return [record.getMessage() for record in caplog.records]


def _saved_dtype(run: Path) -> str:
    return json.loads((run / "options.json").read_text())["dtype"]


@pytest.mark.usefixtures("torch_kernels")
def test_train_chooses_float32_on_an_avx2_cpu_says_so_first_and_a_resume_keeps_it(tmp_path, host, caplog):
    host.write_text(EPYC_AVX2)
    lines = _train(tmp_path / "run", caplog)
    chosen = [i for i, line in enumerate(lines) if line.startswith("compute dtype")]
    assert chosen and lines[chosen[0]].startswith("compute dtype float32: this CPU has no native bfloat16")
    assert not any(line.startswith("data:") for line in lines[: chosen[0]])  # among the first lines
    assert any("device cpu (float32)" in line for line in lines)
    assert _saved_dtype(tmp_path / "run") == "float32"
    host.write_text(SAPPHIRE_RAPIDS)  # the run moved to a bf16 CPU: it keeps the dtype it trained in
    lines = _train(tmp_path / "run", caplog, "--resume", str(tmp_path / "run"), "--steps", "3")
    assert not any(line.startswith("compute dtype") for line in lines)
    assert any("device cpu (float32)" in line for line in lines)


@pytest.mark.usefixtures("torch_kernels")
def test_an_explicit_dtype_wins_over_the_cpus(tmp_path, host, caplog):
    host.write_text(EPYC_AVX2)
    lines = _train(tmp_path / "run", caplog, "--dtype", "bf16")
    assert not any(line.startswith("compute dtype") for line in lines)
    assert any("device cpu (bfloat16)" in line for line in lines)
    assert _saved_dtype(tmp_path / "run") == "bfloat16"


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ((), "float32"),  # as `slide train` chooses on this CPU, so the plan prices that run
        (("--dtype", "bf16"), "bfloat16"),
        (("--master", "split"), "bfloat16"),
    ],
)
def test_plan_takes_the_dtype_train_chooses(flags, dtype, host, slide):
    host.write_text(EPYC_AVX2)
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--seq-len", "32", *flags, "--json")
    assert status == 0, err
    assert json.loads(out)["dtype"] == dtype
