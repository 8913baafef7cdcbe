"""Checkpoint and resume through `slide train`: bit-identical continuation, kill -9 safety, corruption."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
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
        steps=8,
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        lr=3e-3,
        weight_decay=0.01,
        lr_schedule="cosine",
        warmup_steps=2,
        seed=3,
        metrics=output / "metrics.jsonl",
    )
    base.update(overrides)
    return TrainConfig(**base)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_resume_after_4_of_8_steps_is_bit_identical(tmp_path: Path, max_grad_norm: float) -> None:
    """With clipping that triggers, the checkpoint also carries whether the next step defers its host
    updates (Note [Deferred clipped steps]), which decides their rounding."""
    full = train(_config(tmp_path / "full", save_every=4, max_grad_norm=max_grad_norm))
    if max_grad_norm:
        norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
        assert all(norm > max_grad_norm for norm in norms), "test setup: every step must clip"
    # Interrupted run: the same job, resumed from its step-4 checkpoint in a fresh output directory.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step-00000004", resumed_dir / "checkpoints/step-00000004")
    resumed = train(_config(resumed_dir, resume=resumed_dir, max_grad_norm=max_grad_norm))
    assert resumed.steps == 4
    assert _losses(resumed_dir / "metrics.jsonl") == _losses(tmp_path / "full/metrics.jsonl")[4:]
    want, got = _weights(full.model_dir), _weights(resumed.model_dir)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_corrupt_checkpoint_is_named(tmp_path: Path) -> None:
    train(_config(tmp_path / "run", steps=2, save_every=2))
    master = tmp_path / "run/checkpoints/step-00000002/shard-00000-of-00001.bin"
    data = bytearray(master.read_bytes())
    data[len(data) // 2] ^= 0xFF
    master.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard-00000-of-00001\.bin fails its checksum in block 0 of exp_avg"):
        train(_config(tmp_path / "again", steps=4, resume=tmp_path / "run"))
    master.write_bytes(bytes(data[:100]))
    with pytest.raises(UserError, match="truncated"):
        train(_config(tmp_path / "again2", steps=4, resume=tmp_path / "run"))


@pytest.mark.slow  # a fresh Python process: seconds of imports
@pytest.mark.timeout(120)
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    output = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        import slide_core.checkpoint.writer as ckpt
        from slide_hf.recipe import TrainConfig, train
        original = ckpt._write_source  # every array streams (Engine.checkpoint_arrays)
        calls = []
        def slow_write(handle, *args):
            calls.append(handle.name)
            if "step-00000004" in str(handle.name):
                Path({str(tmp_path / "saving")!r}).touch()
                time.sleep(60)  # killed here, mid-save
            return original(handle, *args)
        ckpt._write_source = slow_write
        train(TrainConfig(output=Path({str(output)!r}), device="cpu", dtype="float32", steps=6, seq_len=32,
                          batch_size=2, save_every=2, lr=3e-3))
        """
    )
    env = dict(os.environ)  # with torch_kernels' backend
    process = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 90
    while not (tmp_path / "saving").exists():
        assert process.poll() is None, "training exited before the save under test"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    from slide_core.checkpoint import find_latest

    assert find_latest(output).name == "step-00000002"
    resumed = train(
        _config(
            tmp_path / "resumed",
            steps=6,
            grad_accum=1,
            lr=3e-3,
            lr_schedule="linear",
            warmup_steps=0,
            weight_decay=0.0,
            seed=0,
            resume=output,
        )
    )
    assert resumed.steps == 4


# -- lr schedule across a resume ------------------------------------------------------------------------------
def _lrs(path: Path) -> list[float]:
    return [json.loads(line)["lr"] for line in path.read_text().splitlines() if "lr" in json.loads(line)]


def test_a_longer_resume_continues_the_lr_curve_instead_of_replanning_it(tmp_path: Path, caplog) -> None:
    """A run stopped at step 4 of 8 (cosine, warmup 2) and resumed with --steps 12 keeps its first 4 lrs,
    goes on from the lr it had at step 4 down to 0 at step 12; a replanned curve would jump back up."""
    from slide_core import LRSchedule

    train(_config(tmp_path / "full", save_every=4))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step-00000004", run / "checkpoints/step-00000004")
    with caplog.at_level("INFO", logger="slide.train"):
        train(_config(run, resume=run, steps=12, save_every=4))
    want = LRSchedule(3e-3, "cosine", 2, 8).extend(4, 12)
    assert _lrs(run / "metrics.jsonl") == [want.lr_at(step) for step in range(4, 12)]
    assert _lrs(run / "metrics.jsonl")[0] == _lrs(tmp_path / "full/metrics.jsonl")[4]  # no jump at the resume
    replanned = LRSchedule(3e-3, "cosine", 2, 12).lr_at(4)
    assert replanned > 1.2 * want.lr_at(4)  # the test means something: replanning would jump
    assert any("lr continues from" in r.getMessage() for r in caplog.records)
    # Resumed again with the same length, the extended curve comes back from the checkpoint.
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints/step-00000008", again / "checkpoints/step-00000008")
    train(_config(again, resume=again, steps=12))
    assert _lrs(again / "metrics.jsonl") == _lrs(run / "metrics.jsonl")[4:]


def test_a_finished_run_resumed_longer_stays_at_its_floor_and_says_so(tmp_path: Path, caplog) -> None:
    train(_config(tmp_path / "run", steps=4, warmup_steps=0, min_lr_ratio=0.1))
    with caplog.at_level("INFO", logger="slide.train"):
        train(_config(tmp_path / "run", steps=6, warmup_steps=0, min_lr_ratio=0.1, resume=tmp_path / "run"))
    lrs = _lrs(tmp_path / "run/metrics.jsonl")
    assert lrs[4:] == pytest.approx([3e-4, 3e-4])  # the floor, 0.1 x 3e-3, not the top of a new curve
    assert any("decayed to its floor" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


# -- changed data ---------------------------------------------------------------------------------------------
def _write_docs(path: Path, word: str, count: int = 40) -> None:
    path.write_text("".join(json.dumps({"text": f"{word} document {i} about windows."}) + "\n" for i in range(count)))


def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path: Path) -> None:
    import slide_hf

    data = tmp_path / "d.jsonl"
    _write_docs(data, "first")
    common = dict(device="cpu", dtype="float32", seq_len=32, batch_size=2, lr=3e-3)
    slide_hf.train(data=data, output=tmp_path / "run", steps=2, **common)
    os.utime(data, (1, 1))  # a new modification time alone is no change
    slide_hf.train(resume=tmp_path / "run", steps=3)
    _write_docs(data, "second")
    with pytest.raises(UserError) as error:
        slide_hf.train(resume=tmp_path / "run", steps=4)
    message = str(error.value)
    assert f"data='{data.resolve()}' changed since" in message and "allow_data_change=" in message
    assert "\n" not in message and not (tmp_path / "run/checkpoints/step-00000004").exists()
    slide_hf.train(resume=tmp_path / "run", steps=4, allow_data_change=True)
    assert (tmp_path / "run/checkpoints/step-00000004").is_dir()


def test_the_cli_names_the_changed_data_file_in_one_line(tmp_path: Path, capsys) -> None:
    from slide_hf.cli.main import main

    data = tmp_path / "d.jsonl"
    _write_docs(data, "first")
    common = ["--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2"]
    assert main(["train", *common, "--data", str(data), "--output", str(tmp_path / "run"), "--steps", "2"]) == 0
    _write_docs(data, "first", count=30)  # fewer examples: the saved position would point elsewhere
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "3"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--data {data.resolve()} changed since" in line and "--allow-data-change" in line and "rows" in line


# -- checkpoints: one write per step, retention, best.json, the disk -------------------------------------------
def _eval_config(output: Path, **overrides) -> TrainConfig:
    return _config(output, eval_fraction=0.2, eval_every=1, save_best=True, **overrides)


def test_save_best_keeps_at_most_keep_plus_best_and_writes_each_step_once(tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    seen: list[int] = []

    def count(_record) -> None:
        seen.append(len(list((run / "checkpoints").glob("step-*"))))

    import slide_hf

    with caplog.at_level("INFO", logger="slide.train"):
        slide_hf.train(
            output=run,
            device="cpu",
            dtype="float32",
            steps=6,
            seq_len=32,
            batch_size=2,
            lr=3e-3,
            eval_fraction=0.2,
            eval_every=1,
            save_every=1,
            save_best=True,
            keep_checkpoints=2,
            on_step=count,
        )
    assert max(seen) <= 3 and len(list((run / "checkpoints").glob("step-*"))) <= 3
    written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint written to")]
    assert len(written) == len(set(written)) == 6  # each step saved once, by the evaluation or --save-every
    best = json.loads((run / "checkpoints/best.json").read_text())
    assert (run / best["path"]).is_dir()


def test_best_json_is_relative_to_the_run_and_resumes_from_another_directory(tmp_path: Path, monkeypatch) -> None:
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    train(_eval_config(Path("run"), steps=3, keep_checkpoints=1))
    best = json.loads((here / "run/checkpoints/best.json").read_text())
    assert best["path"] == f"checkpoints/step-{best['step']:08d}"
    monkeypatch.chdir(elsewhere)
    run = here / "run"
    train(_eval_config(run, steps=5, keep_checkpoints=1, resume=run))
    after = json.loads((run / "checkpoints/best.json").read_text())
    assert after["eval_loss"] <= best["eval_loss"] and (run / after["path"]).is_dir()


def test_an_output_disk_too_small_for_one_checkpoint_is_refused_before_training(tmp_path: Path, monkeypatch) -> None:
    import slide_hf
    from slide_hf.planner import output_disk

    monkeypatch.setattr(output_disk, "free_bytes", lambda directory: 10 * 2**20)
    steps: list[dict] = []
    with pytest.raises(UserError) as error:
        slide_hf.train(
            output=tmp_path / "run", device="cpu", dtype="float32", steps=3, seq_len=32, on_step=steps.append
        )
    message = str(error.value)
    assert "10.0 MiB free" in message and "one checkpoint takes" in message and "output=" in message
    assert not steps and not (tmp_path / "run").exists()
