"""The split master through slide-hf: loading, random init, export, `slide train --master`, resuming in the
other format, the option rules and the planner's prices.

A split master holds the same fp32 values as the fp32 slab (slide_core/split_master.py), so everything that
reads or writes it must give the same bits: the loaded and initialised masters, the exported files, the
losses and the trained model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from slide_core.host_params import HostParameters
from slide_hf import PRESETS, build_model, export_hf, init_random, load_config, load_weights
from slide_hf.errors import UserError
from slide_hf.options import MACHINE_OPTIONS, TrainConfig
from slide_hf.planner import ModelShape, PlanInputs, make_plan
from slide_hf.planner.traffic import h2d_bytes_per_param, host_bytes_per_param_step
from slide_hf.recipe import train

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def _same_master(split: HostParameters, fp32: HostParameters) -> None:
    for unit in fp32.model.units:
        assert torch.equal(split.read(unit).view(torch.int32), fp32.flat(unit).view(torch.int32)), unit.name


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


@pytest.mark.parametrize(
    "preset", ["test-llama", "test-gemma2", "test-qwen3-moe", "test-gemma4-moe", "test-gemma4-ple", "test-llama4"]
)
def test_split_master_loads_and_exports_as_the_fp32_one(reference, tmp_path, preset):
    ref = reference(preset)  # an HF model saved to ref.path and loaded into an fp32 master
    split = HostParameters(ref.model, master_format="split")
    load_weights(ref.model, split, ref.path)
    _same_master(split, ref.host)
    config = load_config(ref.path)
    from_fp32 = export_hf(ref.model, ref.host, config, tmp_path / "fp32", max_shard_bytes=40_000)
    from_split = export_hf(ref.model, split, config, tmp_path / "split", max_shard_bytes=40_000)
    assert _files(from_split) == _files(from_fp32)


def test_a_sharded_checkpoint_loads_into_a_split_master(reference):
    """Units whose tensors sit in several files: the loader keeps each file's reader open across units."""
    ref = reference("test-llama", max_shard_size="20KB")
    assert len(list(ref.path.glob("*.safetensors"))) > 3
    split = HostParameters(ref.model, master_format="split")
    load_weights(ref.model, split, ref.path)
    _same_master(split, ref.host)


def test_random_init_is_the_same_in_both_formats():
    config = PRESETS["test-gemma2"]()
    model = build_model(config)
    fp32, split = HostParameters(model), HostParameters(model, master_format="split")
    init_random(model, fp32, config, seed=7)
    init_random(model, split, config, seed=7)
    _same_master(split, fp32)


def test_overwriting_stores_what_editing_stores_without_decoding_first():
    """init_random writes every parameter through ``overwriting``, which skips the decode ``editing`` does:
    the planes must come out the same, padding included (zero, as fresh planes decode)."""
    config = PRESETS["test-gemma2"]()
    model = build_model(config)
    edited, overwritten = (HostParameters(model, master_format="split") for _ in range(2))
    generator = torch.Generator().manual_seed(3)
    for unit in model.units:
        values = {spec.name: torch.randn(spec.shape, generator=generator) for spec in unit.layout}
        for edit in (edited.editing, overwritten.overwriting):
            with edit(unit) as views:
                for name, view in views.items():
                    view.copy_(values[name])
    for unit in model.units:  # every element, padding included, bit for bit
        assert torch.equal(overwritten.read(unit).view(torch.int32), edited.read(unit).view(torch.int32)), unit.name


def _run(output: Path, master: str, **overrides) -> TrainConfig:
    settings = dict(
        model="tiny-llama",
        output=output,
        device="cpu",
        dtype="bfloat16",
        master=master,
        steps=4,
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        lr=3e-3,
        weight_decay=0.01,
        max_grad_norm=0.05,
        seed=3,
        metrics=output / "metrics.jsonl",
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_slide_train_with_a_split_master_is_bit_identical_and_resumes_in_fp32(tmp_path):
    fp32 = train(_run(tmp_path / "fp32", "fp32"))
    split = train(_run(tmp_path / "split", "split", save_every=2))
    assert _losses(tmp_path / "split/metrics.jsonl") == _losses(tmp_path / "fp32/metrics.jsonl")
    assert _files(split.model_dir) == _files(fp32.model_dir)
    # The split run's step-2 checkpoint, resumed with --master fp32: the same last two steps and model.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "split/checkpoints/step-00000002", resumed_dir / "checkpoints/step-00000002")
    resumed = train(_run(resumed_dir, "fp32", resume=resumed_dir))
    assert _losses(resumed_dir / "metrics.jsonl") == _losses(tmp_path / "fp32/metrics.jsonl")[2:]
    assert _files(resumed.model_dir) == _files(fp32.model_dir)


def test_the_master_option_is_validated_in_one_line():
    with pytest.raises(UserError, match=r"^--master split stores the bf16 copy .* needs --dtype bfloat16, got float32"):
        TrainConfig(master="split", dtype="float32")
    with pytest.raises(UserError, match="--master must be one of auto, fp32, split"):
        TrainConfig(master="bf16")
    assert TrainConfig(master="auto", dtype="float32").master == "auto"  # auto resolves to fp32 there
    assert "master" in MACHINE_OPTIONS  # the same values stored another way: a resume may change it


def test_the_planner_prices_the_split_master():
    shape = ModelShape(
        embedding_numel=64_000_000,
        block_numels=(200_000_000,) * 8,
        head_numel=64_000_000,
        params=1_728_000_000,
        block_params=1_600_000_000,
        tied=False,
        hidden_size=4096,
        num_heads=32,
        head_dim=128,
        kv_dim=1024,
        intermediate_size=11008,
        vocab_size=16_000,
    )
    fp32 = make_plan(PlanInputs(shape, batch_size=1, seq_len=128))
    split = make_plan(PlanInputs(shape, batch_size=1, seq_len=128, master_format="split"))
    assert h2d_bytes_per_param("fp32") == 4 and h2d_bytes_per_param("split") == 2
    assert split.pcie_s < fp32.pcie_s  # the h2d direction binds PCIe here, and it halves
    assert split.host_breakdown["master_fp32"] == fp32.host_breakdown["master_fp32"] + shape.total_numel // 8
    # Split in fp32 is refused where the options are built, by the one rule `slide train` applies too.
    with pytest.raises(UserError, match="--master split stores the bf16 copy"):
        TrainConfig.for_command("plan", master="split", dtype="fp32")
    before, after = host_bytes_per_param_step("fp32", "fp32", 2), host_bytes_per_param_step("split", "fp32", 2)
    assert before["optimizer"] == after["optimizer"]  # the master's 8 bytes per update either way
    assert (before["dma"], after["dma"]) == (2 * 4 + 2, 2 * 2 + 2)  # two loads and one gradient per step


@pytest.mark.parametrize("command", [["train", "--device", "cpu", "--steps", "1"], ["plan", "--model", "tiny-llama"]])
def test_split_with_fp32_compute_is_one_line_on_the_command_line(capsys, tmp_path, command):
    from slide_hf.cli import main as cli

    extra = ["--output", str(tmp_path / "run")] if command[0] == "train" else []
    status = cli.main([*command, *extra, "--dtype", "float32", "--master", "split"])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "--master split stores the bf16 copy the GPU computes with" in lines[0], lines[0]
