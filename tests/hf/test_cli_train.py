"""`slide train`, run in-process through `slide_hf.cli.main.main` on the CPU: every option, bad input, and
exactness against a plain transformers + torch AdamW loop."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open
from safetensors.torch import load_file

from slide_hf import PRESETS
from slide_hf.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

Slide = Callable[..., tuple[int, str, str]]

TINY = ("--device", "cpu", "--dtype", "float32", "--steps", "2", "--seq-len", "32", "--batch-size", "2")
"""tiny-llama (byte vocabulary) on the bundled text: ~0.2 s a run once warm."""

GRAD_NORM_PENDING = "--max-grad-norm is not available yet in this build; use --max-grad-norm 0"
RECORD_KEYS = {"step", "loss", "lr", "tokens", "tokens_per_s", "step_time_s", "gpu_mem_peak_gb", "host_rss_gb"}


def _run(slide: Slide, output: Path, *extra: str | Path, tiny: bool = True) -> list[dict]:
    """Train into ``output`` with a metrics file there; assert success; return the metrics records."""
    metrics = output / "metrics.jsonl"
    status, _, err = slide("train", "--output", output, "--metrics", metrics, *(TINY if tiny else ()), *extra)
    assert status == 0, err
    return _records(metrics)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _fails(slide: Slide, *argv: str | Path, match: str) -> str:
    """Assert exit 2 with exactly one stderr line, containing ``match``, and no traceback."""
    status, out, err = slide("train", *argv)
    assert status == 2, (status, out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("slide train: error: "), lines[0]
    assert match in lines[0], lines[0]
    return lines[0]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _safetensors_dtypes(model_dir: Path) -> set[torch.dtype]:
    dtypes = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            dtypes |= {handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    return {getattr(torch, {"F32": "float32", "BF16": "bfloat16"}.get(d, d)) for d in dtypes}


def _model_dir(path: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A `test-llama` HF directory (vocab = the byte tokenizer's), with the byte tokenizer saved in it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = PRESETS["test-llama"](vocab_size=BYTE_VOCAB_SIZE, **overrides)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    hf.to(dtype).save_pretrained(path)
    byte_tokenizer().save_pretrained(str(path))
    return hf.float()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("test-llama")
    _model_dir(path)
    return path


@pytest.fixture(scope="module")
def ids_data(tmp_path_factory) -> Path:
    """Eight `input_ids` lines of 32 byte tokens."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 256, (32,), generator=g).tolist()} for _ in range(8)]
    return _jsonl(tmp_path_factory.mktemp("data") / "ids.jsonl", rows)


# ---- the newcomer's command ---------------------------------------------------------------------------


def test_newcomer_default_run_learns_the_bundled_text(slide, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "first-run"
    status, out, err = slide("train", "--output", output)  # how long it takes is a benchmark's question
    assert status == 0, err
    assert f"model written to {output / 'model'}" in out
    # "trained 33 steps: loss 5.64 -> 2.97": tiny-llama, the demo's 3 epochs of 128-token rows of the
    # bundled text, linear decay.
    summary = next(line for line in out.splitlines() if line.startswith("trained "))
    steps, first, last = summary.split()[1], float(summary.split()[4]), float(summary.split()[6])
    assert int(steps) >= 20
    assert last < 0.65 * first, summary
    assert json.loads((output / "options.json").read_text())["seq_len"] == 128  # the demo's own row length
    assert (output / "model/config.json").is_file() and (output / "model/model.safetensors").is_file()
    assert (output / "model/tokenizer.json").is_file() and (output / "tokenizer/tokenizer.json").is_file()
    # --save-every 0: one checkpoint, of the final state, written before the export
    assert [p.name for p in (output / "checkpoints").iterdir()] == [f"step-{int(steps):08d}"]


def test_seq_len_defaults_to_the_models_context_length_when_shorter_than_2048(slide, tmp_path, ids_data):
    short = tmp_path / "short-context"
    _model_dir(short, max_position_embeddings=48)
    argv = ["--model", short, "--data", ids_data, "--device", "cpu", "--dtype", "float32", "--steps", "1"]
    _run(slide, tmp_path / "run", *argv, tiny=False)
    assert json.loads((tmp_path / "run/options.json").read_text())["seq_len"] == 48


def test_default_output_is_a_timestamped_run_directory(slide, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = slide("train", *TINY)
    assert status == 0, err
    (run,) = (tmp_path / "runs").iterdir()
    assert len(run.name) == len("20250101-120000-a1b2c3")  # a unique suffix: runs started together differ
    assert f"model written to {Path('runs') / run.name / 'model'}" in out
    assert (run / "model/config.json").is_file()


# ---- options ------------------------------------------------------------------------------------------


def test_config_toml_values_are_used_and_flags_win(slide, tmp_path):
    output, metrics = tmp_path / "run", tmp_path / "from-toml.jsonl"
    config = tmp_path / "run.toml"
    config.write_text(
        f'device = "cpu"\ndtype = "float32"\nsteps = 3\nseq_len = 32\nbatch_size = 2\nlr = 0.002\n'
        f'lr_schedule = "constant"\nno_shuffle = true\noutput = "{output}"\nmetrics = "{metrics}"\n'
    )
    status, out, err = slide("train", "--config", config)
    assert status == 0, err
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["lr"] == 0.002 and r["tokens"] == 64 for r in records)
    assert f"model written to {output / 'model'}" in out
    # Flags given on the command line beat the file.
    status, _, err = slide(
        "train", "--config", config, "--steps", "2", "--lr", "0.001", "--batch-size", "1", "--overwrite"
    )
    assert status == 0, err
    again = _records(metrics)[3:]  # the metrics file is appended to
    assert [(r["step"], r["lr"], r["tokens"]) for r in again] == [(1, 0.001, 32), (2, 0.001, 32)]


def test_config_toml_errors(slide, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    _fails(slide, "--config", bad, match=f"config file {bad}: unknown option 'stepz'")
    bad.write_text("steps = 2.5\n")
    _fails(slide, "--config", bad, match="steps must be int, got 2.5")
    bad.write_text('data = 5\nsteps = "3"\n')
    _fails(slide, "--config", bad, match="data must be Path, got 5")
    bad.write_text("steps = \n")
    _fails(slide, "--config", bad, match="is not valid TOML")
    _fails(slide, "--config", tmp_path / "none.toml", match="does not exist")


def test_model_directory(slide, tmp_path, model_dir):
    status, _, err = slide(
        "train", "--model", model_dir, *TINY, "--output", tmp_path / "run", "--lr-schedule", "constant",
        "--metrics", tmp_path / "m.jsonl",
    )  # fmt: skip
    assert status == 0, err
    records = _records(tmp_path / "m.jsonl")
    assert all(r["lr"] == 2e-5 for r in records)  # default lr for a checkpoint (1e-3 for presets)
    exported = json.loads((tmp_path / "run/model/config.json").read_text())
    assert exported["model_type"] == "llama" and exported["hidden_size"] == 64
    assert exported["vocab_size"] == BYTE_VOCAB_SIZE
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "run/model")  # loads with no missing keys
    assert len(AutoTokenizer.from_pretrained(tmp_path / "run/model")) == BYTE_VOCAB_SIZE


def test_preset_default_lr(slide, tmp_path):
    records = _run(slide, tmp_path / "run", "--lr-schedule", "constant")
    assert [r["lr"] for r in records] == [1e-3, 1e-3]


def test_data_formats(slide, tmp_path):
    text = _jsonl(tmp_path / "text.jsonl", [{"text": "The quick brown fox jumps over the lazy dog. " * 4}] * 4)
    chat = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, friend!"}]
    messages = _jsonl(tmp_path / "messages.jsonl", [{"messages": chat}] * 4)
    ids = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(i, i + 30))} for i in range(4)])
    for name, path in (("text", text), ("messages", messages), ("ids", ids)):
        records = _run(slide, tmp_path / name, "--data", path)
        assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records), name
        assert records[0]["padded_tokens"] == 64  # 2 rows of 32
        assert 0 < records[0]["loss_tokens"] <= records[0]["tokens"] <= 64  # tokens: without row padding


def test_dtype_bfloat16_and_float32(slide, tmp_path):
    fp32 = _losses(_run(slide, tmp_path / "fp32", "--dtype", "float32"))
    bf16 = _losses(_run(slide, tmp_path / "bf16", "--dtype", "bfloat16"))
    assert fp32 != bf16
    assert bf16 == pytest.approx(fp32, rel=0.02)


def test_shape_options_set_tokens_per_step(slide, tmp_path):
    records = _run(slide, tmp_path / "run", "--seq-len", "16", "--batch-size", "3", "--grad-accum", "2")
    tokens = [r["tokens"] for r in records]  # real tokens: a row ending a split text may end in padding
    assert tokens[0] == 16 * 3 * 2 and all(16 * 3 * 2 - 16 < count <= 16 * 3 * 2 for count in tokens), tokens


def test_grad_accum_equals_the_larger_batch(slide, tmp_path, ids_data):
    """Two micro-batches of 2 with no shuffle see the same rows as one of 4: the same loss."""
    common = ("--data", ids_data, "--no-shuffle", "--lr-schedule", "constant")
    accum = _losses(_run(slide, tmp_path / "a", *common, "--grad-accum", "2"))
    whole = _losses(_run(slide, tmp_path / "b", *common, "--batch-size", "4"))
    assert accum == pytest.approx(whole, rel=1e-5)


def test_steps_and_epochs(slide, tmp_path, ids_data):
    # 8 lines, 2 per step: 4 steps an epoch.
    base = ("--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2", "--data", ids_data)
    assert len(_run(slide, tmp_path / "one", *base, tiny=False)) == 4  # --epochs defaults to 1 for a file
    assert len(_run(slide, tmp_path / "two", *base, "--epochs", "2", tiny=False)) == 8
    assert len(_run(slide, tmp_path / "steps", *base, "--epochs", "2", "--steps", "3", tiny=False)) == 3
    _fails(slide, *base, "--epochs", "0", match="--epochs must be an integer in [1, 1000000], got 0")
    _fails(slide, *base, "--steps", "-1", match="--steps must be an integer >= 1, got -1")


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        ("constant", 0, [1.0, 1.0, 1.0, 1.0]),
        ("constant", 2, [0.0, 0.5, 1.0, 1.0]),
        ("linear", 0, [1.0, 0.75, 0.5, 0.25]),
        ("linear", 2, [0.0, 0.5, 1.0, 0.5]),
        ("cosine", 0, [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]),
        ("cosine", 1, [0.0, 1.0, 0.75, 0.25]),
    ],
)
def test_lr_schedule_and_warmup(slide, tmp_path, schedule, warmup, expected):
    records = _run(
        slide, tmp_path / "run", "--steps", "4", "--lr", "0.004", "--lr-schedule", schedule,
        "--warmup-steps", str(warmup),
    )  # fmt: skip
    assert [r["lr"] for r in records] == pytest.approx([0.004 * f for f in expected], abs=1e-12)


@pytest.fixture(scope="module")
def base_trajectory() -> dict[str, list[float]]:
    """The losses of the run without the flag, which every case of the next test compares with (one run)."""
    return {}


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lr", "0.01"),
        ("--weight-decay", "0.5"),
        ("--adam-beta1", "0.5"),
        ("--adam-beta2", "0.9"),
        ("--adam-eps", "0.001"),
    ],
)
def test_optimizer_options_change_the_trajectory(slide, tmp_path, flag, value, base_trajectory):
    # Adam's first update is lr * sign(g) whatever the betas; the third loss sees two updates.
    if "losses" not in base_trajectory:  # the same run for every flag: run by the first case, read by the rest
        base_trajectory["losses"] = _losses(_run(slide, tmp_path / "base", "--steps", "3", "--lr-schedule", "constant"))
    base = base_trajectory["losses"]
    other = _losses(_run(slide, tmp_path / "other", "--steps", "3", "--lr-schedule", "constant", flag, value))
    assert other[0] == base[0]  # the same initial weights and batch
    assert other[2] != base[2]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("--lr", "-1"), "--lr must be a finite number >= 0, got -1.0"),
        (("--weight-decay", "-0.1"), "--weight-decay must be a finite number >= 0, got -0.1"),
        (("--adam-beta1", "1"), "--adam-beta1 must be a finite number in [0, 1), got 1.0"),
        (("--adam-beta2", "-0.5"), "--adam-beta2 must be a finite number in [0, 1), got -0.5"),
        (("--adam-eps", "0"), "--adam-eps must be a finite number in [1.17549e-38, 1], got 0.0"),
        (("--warmup-steps", "-1"), "--warmup-steps must be an integer >= 0, got -1"),
        (("--max-grad-norm", "-1"), "--max-grad-norm must be a finite number >= 0, got -1.0"),
        (("--grad-accum", "0"), "--grad-accum must be an integer >= 1, got 0"),
        (("--block-slots", "0"), "--block-slots must be an integer in [1, 64], got 0"),
        (("--keep-checkpoints", "-1"), "--keep-checkpoints must be an integer in [0, 1000000], got -1"),
        (("--save-every", "-2"), "--save-every must be an integer >= 0, got -2"),
        (("--nvme-fraction", "1.5"), "--nvme-fraction must be a finite number in [0, 1], got 1.5"),
        (("--nvme-fraction", "-0.1"), "--nvme-fraction must be a finite number in [0, 1], got -0.1"),
    ],
)
def test_bad_option_values(slide, tmp_path, argv, match):
    _fails(slide, *TINY, "--output", tmp_path / "run", *argv, match=match)
    assert not (tmp_path / "run").exists()


def test_max_grad_norm(slide, tmp_path):
    assert len(_run(slide, tmp_path / "off", "--max-grad-norm", "0")) == 2
    status, _, err = slide("train", *TINY, "--output", tmp_path / "on", "--max-grad-norm", "1.0")
    if status == 2:  # clipping is being added to the engine; until then, this exact one-line refusal
        assert err.strip() == f"slide train: error: {GRAD_NORM_PENDING}"
    else:
        assert status == 0, err
        assert (tmp_path / "on/model/config.json").is_file()


def test_seed(slide, tmp_path):
    first = _losses(_run(slide, tmp_path / "a", "--seed", "1"))
    assert _losses(_run(slide, tmp_path / "b", "--seed", "1")) == first
    assert _losses(_run(slide, tmp_path / "c", "--seed", "2")) != first


def test_no_shuffle_makes_the_order_seed_independent(slide, tmp_path, model_dir, ids_data):
    # With a checkpoint the seed only draws the data order, so --no-shuffle removes its effect.
    common = ("--model", model_dir, "--data", ids_data, "--lr", "1e-3")
    fixed = [_losses(_run(slide, tmp_path / f"fixed{s}", *common, "--no-shuffle", "--seed", s)) for s in "12"]
    shuffled = [_losses(_run(slide, tmp_path / f"shuffled{s}", *common, "--seed", s)) for s in "12"]
    assert fixed[0] == fixed[1]
    assert shuffled[0] != shuffled[1]


def test_metrics_records(slide, tmp_path):
    metrics = tmp_path / "nested/dir/metrics.jsonl"  # parent directories are created
    status, _, err = slide("train", *TINY, "--steps", "3", "--output", tmp_path / "run", "--metrics", metrics)
    assert status == 0, err
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record.keys() >= RECORD_KEYS
        assert all(isinstance(record[k], int | float) and math.isfinite(record[k]) for k in RECORD_KEYS)
        assert record["loss"] > 0 and record["padded_tokens"] == 64  # 2 rows of 32
        assert 0 < record["loss_tokens"] <= record["tokens"] <= 64  # tokens: without row padding
        assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0
        assert record["tokens_per_s"] == pytest.approx(record["tokens"] / record["step_time_s"])
        assert record["gpu_mem_peak_gb"] == 0.0  # the CPU device
        assert 0.05 < record["host_rss_gb"] < 64
    _fails(slide, *TINY, "--output", tmp_path / "x", "--metrics", metrics / "sub.jsonl", match="cannot write metrics")


def test_save_every_and_keep_checkpoints(slide, tmp_path):
    _run(slide, tmp_path / "run", "--steps", "5", "--save-every", "1", "--keep-checkpoints", "2")
    kept = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000004", "step-00000005"]
    _run(slide, tmp_path / "three", "--steps", "4", "--save-every", "2", "--keep-checkpoints", "3")
    kept = sorted(p.name for p in (tmp_path / "three/checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000002", "step-00000004"]


def test_resume_smoke(slide, tmp_path):
    common = ("--lr-schedule", "constant", "--steps", "4")
    straight = _losses(_run(slide, tmp_path / "straight", *common))
    _run(slide, tmp_path / "first", "--lr-schedule", "constant", "--steps", "2", "--save-every", "2")
    resumed = _run(slide, tmp_path / "second", *common, "--resume", tmp_path / "first")
    assert [r["step"] for r in resumed] == [3, 4]
    assert _losses(resumed) == straight[2:]
    _fails(slide, *TINY, "--output", tmp_path / "x", "--resume", tmp_path / "nothing", match="no checkpoint found")


def test_gpu_memory_is_ignored_on_cpu(slide, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="slide.train"):
        assert len(_run(slide, tmp_path / "run", "--gpu-memory", "24GiB")) == 2
    assert "--gpu-memory is ignored on the CPU device" in caplog.text


def test_device_cuda_without_a_gpu(slide, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    _fails(slide, *TINY, "--device", "cuda", "--output", tmp_path / "run", match="--device cuda was asked for")


@pytest.mark.parametrize("flag", ["--offload-optimizer", "--offload-activations"])
def test_nvme_offload_needs_a_directory(slide, tmp_path, flag):
    _fails(slide, *TINY, "--output", tmp_path / "run", flag, "nvme", match=f"{flag} nvme needs --nvme-dir PATH")


def test_nvme_offload_matches_ram(slide, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ram = _run(slide, tmp_path / "ram")
    args = [
        "--offload-optimizer",
        "nvme",
        "--offload-activations",
        "nvme",
        "--nvme-dir",
        nvme,
        "--nvme-fraction",
        "0.5",
    ]
    offloaded = _run(slide, tmp_path / "nvme-run", *args)
    assert [r["loss"] for r in offloaded] == [r["loss"] for r in ram]


# ---- plugins: devices, tiers and optimizers chosen by name ----------------------------------------------

THIRD_PARTY = '''
from typing import ClassVar

from slide_core.devices.cpu import CPUDevice
from slide_core.optim.adamw import TorchAdamW
from slide_core.tiers.host_ram import HostRamTier


def _count(calls, name):
    calls[name] = calls.get(name, 0) + 1


class RecordingCPU(CPUDevice):
    """The CPU device, wrapped: it counts the uploads and events the engine asks of it."""

    calls: ClassVar[dict] = {}

    def copy_to_device(self, dst, src, role="h2d"):
        _count(RecordingCPU.calls, "copy_to_device")
        return super().copy_to_device(dst, src, role)

    def record_event(self, role, *, timing=False):
        _count(RecordingCPU.calls, "record_event")
        return super().record_event(role, timing=timing)


class CountingTier(HostRamTier):
    """Host RAM, counting what the engine stores and reads back."""

    name = "counting"
    calls: ClassVar[dict] = {}

    @classmethod
    def for_run(cls, request):
        _count(cls.calls, "for_run")
        return cls()

    def put(self, key, tensor):
        _count(CountingTier.calls, "put")
        return super().put(key, tensor)

    def get(self, key, out):
        _count(CountingTier.calls, "get")
        return super().get(key, out)


class CountingAdamW(TorchAdamW):
    """torch's AdamW, counting its steps."""

    calls: ClassVar[dict] = {}

    def step(self, *args, **kwargs):
        _count(CountingAdamW.calls, "step")
        return super().step(*args, **kwargs)


class NotAnOptimizer:
    pass
'''

ENTRY_POINTS = {
    "slide.devices": {"recording-cpu": "slide_third_party:RecordingCPU"},
    "slide.tiers": {"counting": "slide_third_party:CountingTier"},
    "slide.optimizers": {
        "counting-adamw": "slide_third_party:CountingAdamW",
        "bogus": "slide_third_party:NotAnOptimizer",
    },
}


@pytest.fixture
def third_party(install_distribution):
    """A throwaway distribution, installed for this test, with one plugin of each kind."""
    install_distribution("slide-third-party", {"slide_third_party": THIRD_PARTY}, ENTRY_POINTS)
    return importlib.import_module("slide_third_party")


def test_plugins_of_every_kind_are_used_by_slide_train(slide, tmp_path, third_party):
    built_in = _run(slide, tmp_path / "built-in", "--optimizer", "torch-adamw", "--offload-optimizer", "ram")
    plugged = _run(
        slide, tmp_path / "plugged", "--device", "recording-cpu", "--offload-optimizer", "counting",
        "--optimizer", "counting-adamw", "--nvme-fraction", "0.5",
    )  # fmt: skip
    assert _losses(plugged) == _losses(built_in)
    device, tier, optimizer = third_party.RecordingCPU, third_party.CountingTier, third_party.CountingAdamW
    assert device.calls["copy_to_device"] >= 2 * 6 and device.calls["record_event"] > 0  # 6 units, 2 steps
    assert tier.calls["for_run"] == 1 and tier.calls["put"] > 0 and tier.calls["get"] > 0
    assert optimizer.calls["step"] > 0
    options = json.loads((tmp_path / "plugged/options.json").read_text())
    assert (options["device"], options["offload_optimizer"], options["optimizer"]) == (
        "recording-cpu", "counting", "counting-adamw"
    )  # fmt: skip


def test_help_lists_the_installed_plugins(slide, third_party):
    status, out, _ = slide("train", "--help")
    assert status == 0
    text = " ".join(out.split())
    assert "one of auto, cpu, cuda, recording-cpu" in text
    assert "counting-adamw" in text and "fused-adamw" in text and "torch-adamw" in text
    assert "counting" in text and "nvme" in text and "ram" in text


@pytest.mark.parametrize(
    ("flag", "value", "listed"),
    [
        ("--device", "tpu", "auto, cpu, cuda"),
        ("--optimizer", "sgd", "auto, fused-adamw, torch-adamw"),
        ("--offload-optimizer", "tape", "ram, gds, hipfile, nvme, pinned"),
    ],
)
def test_an_unknown_plugin_name_is_one_line_listing_the_installed(slide, tmp_path, flag, value, listed):
    line = _fails(slide, *TINY, "--output", tmp_path / "run", flag, value, match=f"{flag} must be one of")
    assert listed in line and line.endswith(f"got {value!r}")
    assert not (tmp_path / "run").exists()


def test_a_missing_plugin_package_says_what_to_install(slide, tmp_path, monkeypatch):
    from slide_core import plugins

    listing = plugins._entry_points

    def without_slide_io(group):  # slide-io uninstalled, as far as entry points can tell
        return {name: ep for name, ep in listing(group).items() if ep.dist is None or ep.dist.name != "slide-io"}

    monkeypatch.setattr(plugins, "_entry_points", without_slide_io)
    _fails(
        slide, *TINY, "--output", tmp_path / "run", "--offload-optimizer", "nvme", "--nvme-dir", tmp_path,
        match="got 'nvme'; `nvme` needs slide-io: pip install slide-io",
    )  # fmt: skip


def test_a_plugin_of_the_wrong_kind_is_one_line(slide, tmp_path, third_party):
    _fails(
        slide, *TINY, "--output", tmp_path / "run", "--optimizer", "bogus",
        match="--optimizer bogus: slide.optimizers plugin 'bogus' is <class 'slide_third_party.NotAnOptimizer'>, "
        "not a subclass of Optimizer",
    )  # fmt: skip


def test_unwritable_nvme_dir(slide, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(
        slide, *TINY, "--output", tmp_path / "run", "--offload-optimizer", "nvme", "--nvme-dir", blocker / "sub",
        match="sub",
    )  # fmt: skip


def test_nvme_options_with_ram_offload(slide, tmp_path):
    """``--nvme-dir`` with every tier in RAM is harmless (a later resume may offload); ``--nvme-fraction``
    there would promise an offload that does not happen, so it is refused in one line."""
    records = _run(
        slide, tmp_path / "run", "--offload-optimizer", "ram", "--offload-activations", "ram",
        "--nvme-dir", tmp_path / "nvme",
    )  # fmt: skip
    assert len(records) == 2
    _fails(slide, "--device", "cpu", "--offload-optimizer", "ram", "--nvme-fraction", "0.25",
           match="--nvme-fraction 0.25 says which share of the units' Adam state goes to the --offload-optimizer tier")  # fmt: skip


def test_save_dtype(slide, tmp_path, model_dir):
    _run(slide, tmp_path / "bf16", "--save-dtype", "bfloat16")
    assert _safetensors_dtypes(tmp_path / "bf16/model") == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16/model/config.json").read_text())["dtype"] == "bfloat16"
    _run(slide, tmp_path / "auto", "--save-dtype", "auto")  # a preset has no dtype: float32
    assert _safetensors_dtypes(tmp_path / "auto/model") == {torch.float32}
    # auto keeps a checkpoint's own dtype; an explicit dtype overrides it.
    bf16_dir = tmp_path / "bf16-checkpoint"
    _model_dir(bf16_dir, dtype=torch.bfloat16)
    _run(slide, tmp_path / "auto-bf16", "--model", bf16_dir)
    assert _safetensors_dtypes(tmp_path / "auto-bf16/model") == {torch.bfloat16}
    _run(slide, tmp_path / "fp32", "--model", bf16_dir, "--save-dtype", "float32")
    assert _safetensors_dtypes(tmp_path / "fp32/model") == {torch.float32}


def test_block_slots_do_not_change_the_result(slide, tmp_path):
    want = _losses(_run(slide, tmp_path / "two", "--block-slots", "2", "--steps", "3"))
    for slots in ("1", "3"):
        assert _losses(_run(slide, tmp_path / slots, "--block-slots", slots, "--steps", "3")) == want


# ---- bad input: exit 2, one line naming the bad thing, no traceback -------------------------------------


def test_missing_data_file(slide, tmp_path):
    missing = tmp_path / "nope.jsonl"
    _fails(slide, *TINY, "--output", tmp_path / "run", "--data", missing, match=f"data file {missing} does not exist")


def test_malformed_data_line(slide, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": broken}\n')
    _fails(slide, *TINY, "--output", tmp_path / "run", "--data", data, match=f"{data}:2: not valid JSON")


def test_token_id_outside_the_vocabulary(slide, tmp_path):
    data = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3]}] * 3 + [{"input_ids": [1, 300]}])
    _fails(slide, *TINY, "--output", tmp_path / "run", "--data", data, match=f"{data}:4: token id 300 is outside")


def test_unsupported_architecture(slide, tmp_path):
    from transformers import BertConfig

    bert = tmp_path / "bert"
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(bert)
    byte_tokenizer().save_pretrained(str(bert))
    _fails(slide, *TINY, "--output", tmp_path / "run", "--model", bert, match="model_type 'bert'")


def test_negative_batch_size(slide, tmp_path):
    _fails(
        slide,
        *TINY,
        "--output",
        tmp_path / "run",
        "--batch-size",
        "-2",
        match="--batch-size must be an integer >= 1, got -2",
    )


def test_seq_len_beyond_the_model_positions(slide, tmp_path):
    _fails(slide, *TINY, "--output", tmp_path / "run", "--seq-len", "4096", match="--seq-len 4096 exceeds")


def test_unknown_preset(slide, tmp_path):
    line = _fails(slide, *TINY, "--output", tmp_path / "run", "--model", "llama-9000", match="unknown model")
    assert "'llama-9000'" in line and "tiny-llama" in line


def test_model_directory_that_does_not_exist(slide, tmp_path):
    _fails(slide, *TINY, "--output", tmp_path / "run", "--model", tmp_path / "gone", match="does not exist")


def test_preset_smaller_than_the_byte_tokenizer(slide, tmp_path):
    _fails(slide, *TINY, "--output", tmp_path / "run", "--model", "test-llama", match="the tokenizer has 259 tokens")


@pytest.mark.parametrize("save_every", ["0", "1"])
def test_unwritable_output_fails_before_training(slide, tmp_path, caplog, save_every):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    output = blocker / "run"
    with caplog.at_level("INFO", logger="slide.train"):
        line = _fails(slide, *TINY, "--output", output, "--save-every", save_every, match="cannot create output")
    assert str(output) in line
    assert "step 1/2" not in caplog.text  # refused up front, not after the training it would throw away


def test_step_without_labels_cannot_happen(slide, tmp_path):
    """Conversations whose reply --seq-len cuts off entirely carry no loss; they are skipped, not trained on."""
    cut = {"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"}]}
    fine = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "yes"}]}
    data = _jsonl(tmp_path / "chat.jsonl", [cut, cut, fine, fine])
    assert len(_run(slide, tmp_path / "run", "--data", data)) == 2
    _fails(slide, *TINY, "--output", tmp_path / "x", "--data", _jsonl(tmp_path / "cut.jsonl", [cut] * 4),
           match="holds no example with a token to train")  # fmt: skip


# ---- exactness ------------------------------------------------------------------------------------------


def test_float32_cpu_training_equals_transformers_and_adamw(slide, tmp_path, monkeypatch):
    # The head uses HF's own loss math here (as in test_engine_families), so the comparison isolates
    # slide's training path from the fused loss kernel's last-bit rounding.
    from slide_hf.adapters import base

    monkeypatch.setattr(base, "_fused_linear_cross_entropy", lambda: None)
    steps, lr, wd, betas, eps, pad = 3, 3e-3, 0.1, (0.8, 0.95), 1e-6, byte_tokenizer().pad_token_id
    hf = _model_dir(tmp_path / "model")
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 256, (32,), generator=g).tolist() for _ in range(4 * steps)]
    rows[5] = rows[5][:20]  # one short line: right-padded, its padding unlabelled
    data = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": r} for r in rows])
    records = _run(
        slide, tmp_path / "run", "--model", tmp_path / "model", "--data", data, "--no-shuffle",
        "--steps", str(steps), "--grad-accum", "2", "--lr", str(lr), "--lr-schedule", "constant",
        "--warmup-steps", "0", "--weight-decay", str(wd), "--adam-beta1", str(betas[0]),
        "--adam-beta2", str(betas[1]), "--adam-eps", str(eps), "--save-dtype", "float32",
    )  # fmt: skip

    # Reference: HF's model and loss, torch AdamW with HF's weight-decay convention (>= 2 dims), the same
    # batches in file order, each step's loss the token-weighted mean over its two micro-batches.
    ids = torch.full((len(rows), 32), pad)
    labels = torch.full((len(rows), 32), -100)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = labels[i, : len(row)] = torch.tensor(row)
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps
    )
    expected = []
    for step in range(steps):
        micro = [(ids[i : i + 2], labels[i : i + 2]) for i in (4 * step, 4 * step + 2)]
        step_tokens = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
        total = 0.0
        for mb_ids, mb_labels in micro:
            loss = hf(mb_ids, labels=mb_labels).loss * int((mb_labels[:, 1:] != -100).sum())
            (loss / step_tokens).backward()
            total += loss.item()
        expected.append(total / step_tokens)
        optimizer.step()
        optimizer.zero_grad()

    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["lr"] for r in records] == [lr] * steps
    assert _losses(records) == pytest.approx(expected, rel=1e-5)
    exported = load_file(tmp_path / "run/model/model.safetensors")
    state = hf.state_dict()
    assert set(exported) <= set(state) and len(exported) >= len(state) - 1  # a tied lm_head is stored once
    for key, have in exported.items():
        assert have.dtype == torch.float32, key
        want = state[key].detach()
        if key.endswith("k_proj.bias"):
            # Softmax ignores a constant added to every key: the true gradient is ~0, Adam amplifies noise.
            assert (have - want).abs().max() <= 2 * lr * steps
            continue
        err = ((have - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{key}: exported weights differ from the reference ({err:.2e})"


def test_wsd_and_the_lr_floor_from_flags_and_toml(slide, tmp_path):
    """--lr-schedule wsd with --decay-fraction, --decay-shape and --min-lr-ratio: the lrs the metrics record
    are the schedule's at every step; the same options from a TOML file give the same run."""
    from slide_core import LRSchedule

    options = ["--steps", "6", "--lr", "1e-3", "--warmup-steps", "1", "--lr-schedule", "wsd"]
    options += ["--decay-fraction", "0.5", "--decay-shape", "cosine", "--min-lr-ratio", "0.2"]
    lrs = [r["lr"] for r in _run(slide, tmp_path / "flags", *options)]
    want = LRSchedule(1e-3, "wsd", 1, 6, min_lr_ratio=0.2, decay_fraction=0.5, decay_shape="cosine")
    assert lrs == [want.lr_at(step) for step in range(6)]
    assert lrs[1] == lrs[2] == 1e-3 and lrs[3] == pytest.approx(1e-3) and 2e-4 < lrs[5] < lrs[4] < 1e-3
    toml = tmp_path / "run.toml"
    toml.write_text(
        'lr_schedule = "wsd"\ndecay_fraction = 0.5\ndecay_shape = "cosine"\nmin_lr_ratio = 0.2\n'
        "lr = 1e-3\nwarmup_steps = 1\nsteps = 6\n"
    )
    rest = ("--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2")
    assert [r["lr"] for r in _run(slide, tmp_path / "toml", "--config", toml, *rest, tiny=False)] == lrs


def test_cosine_floor_from_flags(slide, tmp_path):
    lrs = [
        r["lr"]
        for r in _run(
            slide, tmp_path / "run", "--steps", "4", "--lr", "1e-3", "--lr-schedule", "cosine", "--min-lr-ratio", "0.5"
        )
    ]
    assert lrs[0] == pytest.approx(1e-3) and all(lr >= 5e-4 for lr in lrs) and lrs[-1] < lrs[0]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--min-lr-ratio", "1"], "--min-lr-ratio must be a finite number in [0, 1), got 1.0"),
        (["--min-lr-ratio", "-0.1"], "--min-lr-ratio must be a finite number in [0, 1), got -0.1"),
        (["--decay-fraction", "0"], "--decay-fraction must be a finite number in (0, 1], got 0.0"),
        (["--decay-fraction", "1.5"], "--decay-fraction must be a finite number in (0, 1], got 1.5"),
        (["--lr-schedule", "constant", "--min-lr-ratio", "0.1"], "--lr-schedule constant has none"),
    ],
)
def test_bad_schedule_options_are_one_line(slide, tmp_path, argv, match):
    _fails(slide, *TINY, "--output", tmp_path / "x", *argv, match=match)
