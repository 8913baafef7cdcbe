"""slide-hf's side of data parallel (docs/distributed.md): `slide_hf.data.batches` gives each rank its rows
of every step's global batch, which together are exactly one process's batch at ``batch_size x
world_size``; ``python -m slide_hf`` is the entry a launcher such as torchrun starts; and `slide train`
in 2 real gloo processes trains what one process does at the same global batch."""

from __future__ import annotations

import json
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slide_core.checkpoint import read_state
from slide_core.testing import launch_ranks, wait_ranks
from slide_hf.data import Batches, Dataset, DataStats
from slide_hf.errors import UserError


def _numbered(n: int, seq_len: int = 3) -> Dataset:
    """``n`` int32 rows whose every token is the row's index."""
    ids = torch.arange(n, dtype=torch.int32).unsqueeze(1).repeat(1, seq_len)
    positions = torch.arange(seq_len, dtype=torch.int32).repeat(n, 1)
    stats = DataStats(n, n, n * seq_len, n * seq_len, 0.0, 0, 0)
    return Dataset(ids, ids + 1000, positions, "numbered", stats)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_ranks_rows_together_are_one_process_batch(world_size: int, shuffle: bool) -> None:
    data = _numbered(37)
    one = Batches(data, batch_size=2 * world_size, grad_accum=2, shuffle=shuffle, seed=3)
    ranks = [
        Batches(data, batch_size=2, grad_accum=2, shuffle=shuffle, seed=3, rank=rank, world_size=world_size)
        for rank in range(world_size)
    ]
    assert all(batches.steps_per_epoch == one.steps_per_epoch for batches in ranks)
    for _ in range(2 * one.steps_per_epoch + 1):  # across epochs, each with its own order
        want = one.next_step()
        got = [batches.next_step() for batches in ranks]
        for index, micro in enumerate(want):
            parts = [step[index] for step in got]
            assert all(part.input_ids.shape == (2, 3) for part in parts)
            for field in range(3):
                assert torch.equal(torch.cat([part[field] for part in parts]), micro[field])
        assert all(batches.position == one.position for batches in ranks)  # the position is global


def test_too_few_rows_for_the_ranks() -> None:
    with pytest.raises(UserError) as info:
        Batches(_numbered(11), batch_size=2, grad_accum=2, shuffle=True, seed=0, rank=1, world_size=3)
    assert str(info.value) == "numbered yields 11 rows; one step needs 12 (--batch-size 2 x --grad-accum 2 x 3 ranks)"
    with pytest.raises(ValueError, match="rank 3 is not in a world of size 3"):
        Batches(_numbered(12), batch_size=2, grad_accum=2, shuffle=True, seed=0, rank=3, world_size=3)


def test_python_dash_m_slide_hf_is_the_cli(monkeypatch, capsys) -> None:
    """``python -m slide_hf`` runs slide_hf/__main__.py as ``__main__``; runpy does what ``-m`` does, in this
    process (a fresh interpreter would spend seconds importing torch to print one line)."""
    monkeypatch.setattr(sys, "argv", ["slide_hf", "train", "--no-such-flag"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("slide_hf", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("slide: error: unrecognized arguments: --no-such-flag")


# ---- `slide train` in real gloo processes ------------------------------------------------------------------
RUN = ("train", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--lr", "1e-3")
EVAL = ("--eval-fraction", "0.25")  # evaluated after the last step
STEPS = 3
LAUNCH_TIMEOUT_S = 120.0


def _slide_train(
    output: Path, batch_size: int, world_size: int, *extra: str, launched: bool | None = None
) -> list[tuple[int, str]]:
    """``python -m slide_hf train ...`` in ``world_size`` processes with torchrun's environment variables
    (by default none for one process: ``launched`` says otherwise); each process's (exit code, stderr),
    every process killed after the timeout."""
    args = ["--steps", str(STEPS), "--save-every", "2", "--batch-size", str(batch_size), "--output", str(output)]
    return wait_ranks(_start_train(world_size, *args, *EVAL, *extra, launched=launched), LAUNCH_TIMEOUT_S)


def _start_train(world_size: int, *args: str, launched: bool | None = None) -> list[subprocess.Popen]:
    """Start ``python -m slide_hf`` + ``RUN`` + ``args`` in ``world_size`` processes (see _slide_train)."""
    command = [sys.executable, "-m", "slide_hf", *RUN, *args]
    with_variables = world_size > 1 if launched is None else launched
    return launch_ranks(command, world_size, launched=with_variables, stdout=subprocess.DEVNULL)


def _losses(run: Path, key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [record[key] for record in records if key in record]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """One `slide train` run in 2 gloo processes, 1 row per rank and step, checkpoints at steps 2 and 3."""
    dp = tmp_path_factory.mktemp("dp") / "run"
    for rank, (code, err) in enumerate(_slide_train(dp, batch_size=1, world_size=2)):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return dp


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The same run in one plain process (no launcher's variables) at the same global batch, 2 rows per step:
    what the 2-process run and the 1-process run under torchrun are compared with (one run serves both)."""
    one = tmp_path_factory.mktemp("one") / "run"
    ((code, err),) = _slide_train(one, batch_size=2, world_size=1)
    assert code == 0, err[-3000:]
    return one


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model" / "model.safetensors"))


@pytest.mark.slow
def test_slide_train_in_two_processes_matches_one_process(two_ranks: Path, one_process: Path) -> None:
    """Two ranks with 1 row each train exactly what one process does with 2 rows: the same per-step
    losses and the same exported weights; rank 0 alone writes the run's files, and every rank its shards
    into each checkpoint's step directory, beside the manifest."""
    dp, one = two_ranks, one_process
    want = _losses(one)
    assert len(want) == STEPS
    assert _losses(dp) == pytest.approx(want, rel=1e-5)
    want_eval = _losses(one, "eval_loss")  # each rank evaluates its share of the rows; the sums are summed
    assert len(want_eval) == 1 and _losses(dp, "eval_loss") == pytest.approx(want_eval, rel=1e-5)
    assert _losses(dp, "eval_loss_tokens") == _losses(one, "eval_loss_tokens")
    weights, got = _weights(one), _weights(dp)
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        relative = float((got[name] - tensor).norm() / tensor.norm())  # Adam amplifies tiny gradients' rounding
        assert relative <= 1e-5, f"{name} differs by {relative:.2e} relative"
    assert not torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
    for step in (2, STEPS):
        checkpoint = dp / "checkpoints" / f"step-{step:08d}"
        manifest = read_state(checkpoint)
        assert (manifest["step"], manifest["world_size"]) == (step, 2)
        shards = [sum(hi - lo for lo, hi in shard["parts"]["master"]["intervals"]) for shard in manifest["shards"]]
        whole = read_state(one / "checkpoints" / f"step-{step:08d}")["arrays"]["master"]["numel"]
        assert sum(shards) == whole == manifest["arrays"]["master"]["numel"] and 0 < shards[1] <= shards[0]
    assert (dp / "options.json").is_file() and (dp / "train.log").is_file()
    assert not list((dp / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_one_process_under_torchrun_runs_the_collective_path(one_process: Path, tmp_path: Path) -> None:
    """torchrun with one process (its variables set, WORLD_SIZE=1) opens a group and runs the sharded path
    with one shard per unit (Note [One rank under torchrun]): the same losses and exported weights as the
    plain single process, and the same checkpoint layout (a manifest and one shard of every unit whole)."""
    ((code, err),) = _slide_train(tmp_path / "launched", 2, 1, launched=True)
    assert code == 0, err[-3000:]
    plain, launched = one_process, tmp_path / "launched"
    assert _losses(launched) == pytest.approx(_losses(plain), rel=1e-6)
    want, got = _weights(plain), _weights(launched)
    for name, tensor in want.items():
        assert float((got[name] - tensor).norm() / tensor.norm()) <= 1e-6, name
    checkpoint = launched / "checkpoints" / f"step-{STEPS:08d}"
    plain_checkpoint = plain / "checkpoints" / f"step-{STEPS:08d}"
    assert read_state(checkpoint)["world_size"] == read_state(plain_checkpoint)["world_size"] == 1
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(p.name for p in plain_checkpoint.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_process_under_torchrun_on_a_gpu_matches_the_plain_run(tmp_path: Path) -> None:
    """The same on a GPU in bf16: one process under torchrun runs the sharded path through NCCL (a
    reduce-scatter and an all-gather of one rank each) and trains what the plain process trains."""
    cuda = ("--device", "cuda", "--dtype", "bfloat16")
    ((code, err),) = _slide_train(tmp_path / "plain", 2, 1, *cuda)
    assert code == 0, err[-3000:]
    ((code, err),) = _slide_train(tmp_path / "launched", 2, 1, *cuda, launched=True)
    assert code == 0, err[-3000:]
    plain, launched = tmp_path / "plain", tmp_path / "launched"
    assert len(_losses(plain)) == STEPS
    assert _losses(launched) == pytest.approx(_losses(plain), rel=1e-5)
    assert _losses(launched, "eval_loss") == pytest.approx(_losses(plain, "eval_loss"), rel=1e-5)
    want, got = _weights(plain), _weights(launched)
    for name, tensor in want.items():
        assert float((got[name].float() - tensor.float()).norm() / tensor.float().norm()) <= 1e-5, name
    assert read_state(launched / "checkpoints" / f"step-{STEPS:08d}")["extra"]["world_size"] == 1


@pytest.mark.slow
def test_two_processes_resume_their_checkpoint_bit_identically(two_ranks: Path, tmp_path: Path) -> None:
    """Resumed in 2 processes from the step-2 checkpoint (each rank its shards), the last step's loss and
    the exported weights equal the uninterrupted run's bit for bit."""
    step2 = two_ranks / "checkpoints" / "step-00000002"
    resumed = tmp_path / "resumed"
    for rank, (code, err) in enumerate(_slide_train(resumed, 1, 2, "--resume", str(step2))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    assert _losses(resumed) == _losses(two_ranks)[2:]
    want, got = _weights(two_ranks), _weights(resumed)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


@pytest.mark.slow
def test_one_process_resumes_a_checkpoint_of_two(two_ranks: Path, tmp_path: Path) -> None:
    """`slide train --resume` in one process (2 rows per step: the same global batch) reads both ranks'
    shards of the step-2 checkpoint: the last step's loss and the exported weights equal the 2-process
    run's within 1e-5 relative (the ranks summed their gradients in another order)."""
    step2 = two_ranks / "checkpoints" / "step-00000002"
    alone = tmp_path / "alone"
    ((code, err),) = _slide_train(alone, 2, 1, "--resume", str(step2))
    assert code == 0, err[-3000:]
    assert _losses(alone) == pytest.approx(_losses(two_ranks)[2:], rel=1e-5)
    want, got = _weights(two_ranks), _weights(alone)
    for name, tensor in want.items():
        assert float((got[name] - tensor).norm() / tensor.norm()) <= 1e-5, name
    assert read_state(alone / "checkpoints" / f"step-{STEPS:08d}")["world_size"] == 1  # one process's


@pytest.mark.slow
def test_two_processes_offload_to_nvme(two_ranks: Path, tmp_path: Path) -> None:
    """Adam state and block inputs on the NVMe tiers under data parallel: each rank offloads its own shards
    into its own scratch folder, the run trains what the 2-process run in RAM does, and every rank removes
    its folder at the end."""
    nvme = tmp_path / "nvme"
    offload = ("--offload-optimizer", "nvme", "--offload-activations", "nvme", "--nvme-dir", str(nvme))
    run = tmp_path / "run"
    for rank, (code, err) in enumerate(_slide_train(run, 1, 2, *offload)):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    assert _losses(run) == pytest.approx(_losses(two_ranks), rel=1e-5)
    want, got = _weights(two_ranks), _weights(run)
    for name, tensor in want.items():
        assert float((got[name] - tensor).norm() / tensor.norm()) <= 1e-5, name
    assert not list(nvme.iterdir())  # every rank's scratch folder is gone


@pytest.mark.slow
def test_a_resume_keeps_the_global_batch(two_ranks: Path, monkeypatch) -> None:
    """The saved --batch-size is per process: another number of processes gets the same global batch, or
    one line when it cannot share it evenly."""
    from slide_hf.run_options import saved_options

    step2 = two_ranks / "checkpoints" / "step-00000002"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert saved_options(step2)[0]["batch_size"] == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError) as info:
        saved_options(step2)
    assert str(info.value) == (
        f"checkpoint {step2} stepped on 2 rows (--batch-size 1 x 2 process(es)), which 3 processes cannot "
        "share evenly; resume it with a number of processes that divides 2"
    )


@pytest.mark.slow
def test_slide_export_of_a_data_parallel_checkpoint(two_ranks: Path, tmp_path: Path, capsys) -> None:
    """`slide export` reads both ranks' shards of the last checkpoint into one master: the same weights as
    the run's own model/ export, which transformers loads."""
    from transformers import AutoModelForCausalLM

    from slide_hf.cli.main import main

    out = tmp_path / "exported"
    assert main(["export", str(two_ranks), str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"exported step {STEPS} of ")
    want, got = _weights(two_ranks), load_file(str(out / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.model.norm.weight.detach(), want["model.norm.weight"])


@pytest.mark.slow
def test_sigterm_to_one_rank_checkpoints_every_rank(tmp_path: Path) -> None:
    """Note [Stop on every rank]: SIGTERM to rank 1 alone; both ranks checkpoint the same step (a complete
    step directory with both ranks' shards), both exit with 143, rank 0 with the line saying how to continue
    (said once for the run: on a launch's shared console every rank's would repeat it), and the run resumes
    from it to the end."""
    run = tmp_path / "run"
    procs = _start_train(2, "--steps", "400", "--batch-size", "1", "--output", str(run))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            break
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    finished = wait_ranks(procs, LAUNCH_TIMEOUT_S)
    for rank, (code, err) in enumerate(finished):
        assert code == 128 + signal.SIGTERM, f"rank {rank}:\n{err[-3000:]}"
        said = "stopped by SIGTERM after step " in err and f"slide train --resume {run}" in err
        assert said == (rank == 0), err[-2000:]
    (step_dir,) = (run / "checkpoints").glob("step-*")
    stopped_at = read_state(step_dir)["step"]
    assert 2 <= stopped_at < 400
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "shard-00000-of-00002.bin",
        "shard-00001-of-00002.bin",
        "state.json",
    ]
    ((code, err),) = wait_ranks(_start_train(1, "--resume", str(run), "--steps", str(stopped_at + 2)), LAUNCH_TIMEOUT_S)
    assert code == 0, err[-3000:]
    assert [record["step"] for record in map(json.loads, metrics.read_text().splitlines()) if "loss" in record][
        -2:
    ] == [
        stopped_at + 1,
        stopped_at + 2,
    ]
