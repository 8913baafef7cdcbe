"""``--optimizer-state fp32|bf16|int8`` through slide_hf: the option's validation, a resumed run keeps the
saved format bit for bit and refuses another, and the planner prices each format's host bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from slide_hf.errors import UserError
from slide_hf.recipe import TrainConfig, train

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def _config(output: Path, **overrides) -> TrainConfig:
    base = dict(
        output=output,
        device="cpu",
        dtype="float32",
        steps=6,
        seq_len=32,
        batch_size=2,
        lr=3e-3,
        weight_decay=0.01,
        seed=3,
        metrics=output / "metrics.jsonl",
    )
    base.update(overrides)
    return TrainConfig(**base)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_the_option_is_checked_in_one_line() -> None:
    with pytest.raises(UserError, match=r"--optimizer-state must be one of fp32, bf16, int8, got 'fp16'"):
        TrainConfig(optimizer_state="fp16")


@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_a_compact_state_run_resumes_bit_identically(tmp_path: Path, state_format: str) -> None:
    from safetensors.torch import load_file

    full = train(_config(tmp_path / "full", save_every=3, optimizer_state=state_format, max_grad_norm=0.5))
    options = json.loads((tmp_path / "full/options.json").read_text())
    assert options["optimizer_state"] == state_format
    saved = json.loads((tmp_path / "full/checkpoints/step-00000003/state.json").read_text())
    assert saved["extra"]["config"]["optimizer_state"] == state_format
    expected_dtype = {"bf16": "bfloat16", "int8": "int8"}[state_format]
    assert saved["arrays"]["exp_avg"]["dtype"] == expected_dtype  # stored compact
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step-00000003", resumed_dir / "checkpoints/step-00000003")
    resumed = train(_config(resumed_dir, resume=resumed_dir, optimizer_state=state_format, max_grad_norm=0.5))
    assert _losses(resumed_dir / "metrics.jsonl") == _losses(tmp_path / "full/metrics.jsonl")[3:]
    want = load_file(next(full.model_dir.glob("*.safetensors")))
    got = load_file(next(resumed.model_dir.glob("*.safetensors")))
    assert all(torch.equal(want[key], got[key]) for key in want)


def test_resuming_with_another_state_format_is_refused(tmp_path: Path) -> None:
    train(_config(tmp_path / "run", steps=2, save_every=2, optimizer_state="bf16"))
    with pytest.raises(UserError, match=r"holds bf16 optimizer state; this run uses int8"):
        train(_config(tmp_path / "run", steps=4, resume=tmp_path / "run", optimizer_state="int8"))


def test_the_cli_resumes_with_the_saved_format_and_refuses_another(tmp_path: Path, capsys) -> None:
    """``--resume DIR`` brings ``--optimizer-state`` back from the run's options; another value is refused
    in one line naming both."""
    from slide_hf.cli.main import main

    run = str(tmp_path / "run")
    common = ["--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2", "--save-every", "2"]
    assert main(["train", "--output", run, "--steps", "2", "--optimizer-state", "bf16", *common]) == 0
    assert main(["train", "--resume", run, "--steps", "4"]) == 0
    saved = json.loads((tmp_path / "run/checkpoints/step-00000004/state.json").read_text())
    assert saved["arrays"]["exp_avg"]["dtype"] == "bfloat16"
    capsys.readouterr()
    assert main(["train", "--resume", run, "--steps", "6", "--optimizer-state", "int8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--optimizer-state was 'bf16'" in err[0] and "is 'int8' now" in err[0]


def test_the_planner_prices_each_format() -> None:
    from slide_hf.planner import PlanInputs, make_plan
    from slide_hf.planner.inputs import ModelShape

    shape = ModelShape(
        embedding_numel=64 * 1024,
        block_numels=(1024 * 1024,) * 4,
        head_numel=64 * 1024,
        params=4 * 1024 * 1024 + 128 * 1024,
        block_params=1024 * 1024,
        tied=False,
        hidden_size=256,
        num_heads=4,
        head_dim=64,
        kv_dim=256,
        intermediate_size=1024,
        vocab_size=256,
    )
    plans = {
        fmt: make_plan(PlanInputs(shape, optimizer_state=fmt, offload_optimizer="nvme", nvme_fraction=0.5))
        for fmt in ("fp32", "bf16", "int8")
    }
    state = {fmt: plan.host_breakdown["optimizer_state"] for fmt, plan in plans.items()}
    assert state["bf16"] * 2 == state["fp32"]
    assert state["int8"] == pytest.approx(state["fp32"] * (2 + 8 / 64) / 8, rel=1e-6)
    assert plans["bf16"].disk_bytes * 2 == plans["fp32"].disk_bytes
    # bf16 updates faster than fp32; int8 saves memory but is bound by its arithmetic (planner/timing.py)
    assert plans["bf16"].update_s < plans["fp32"].update_s < plans["int8"].update_s
    with pytest.raises(UserError, match=r"--optimizer-state must be one of fp32, bf16, int8, got .fp8."):
        PlanInputs(shape, optimizer_state="fp8")
