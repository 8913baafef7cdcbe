"""`slide`'s top level (slide_hf/cli/main.py): how a command's failure becomes one line and an exit status."""

from __future__ import annotations

import pytest
import torch

from slide_core.engine.workers import WorkerFailure
from slide_hf.cli import main as cli


def _fail_with(monkeypatch, command: str, error: BaseException) -> None:
    def run(args):
        raise error

    monkeypatch.setattr(f"slide_hf.cli.{command}.run", run)


def _worker_oom() -> WorkerFailure:
    """What the engine raises when its compute thread hits a device OOM: the OOM chained as the cause."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as oom:
            raise WorkerFailure("the compute worker failed") from oom
    except WorkerFailure as failure:
        return failure


@pytest.mark.parametrize(
    ("command", "argv", "budget"),
    [
        ("bench", ["--model", "test-llama", "--gpu-memory", "24"], "24.0 GiB allowed by --gpu-memory"),
        ("train", ["--model", "test-llama", "--data", "x.jsonl"], "the whole GPU"),
    ],
)
def test_gpu_out_of_memory_is_one_line_with_the_budget(monkeypatch, capsys, command, argv, budget):
    _fail_with(monkeypatch, command, _worker_oom())
    assert cli.main([command, *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "bug" not in err
    assert lines[0].startswith(f"slide {command}: error: the GPU ran out of memory beyond the plan")
    assert budget in lines[0] and "--batch-size" in lines[0] and "--seq-len" in lines[0]


def test_out_of_memory_found_as_the_context_too(monkeypatch, capsys):
    """An OOM caught and replaced without ``from`` still names the cause (``__context__``)."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("backward failed")  # noqa: B904 -- the implicit context is the point
    except RuntimeError as error:
        replaced = error
    assert isinstance(replaced.__context__, torch.OutOfMemoryError)
    _fail_with(monkeypatch, "bench", replaced)
    assert cli.main(["bench", "--model", "test-llama"]) == 2
    assert "ran out of memory beyond the plan" in capsys.readouterr().err


def test_other_failures_stay_internal_errors(monkeypatch, capsys):
    _fail_with(monkeypatch, "bench", WorkerFailure("the compute worker failed"))
    assert cli.main(["bench", "--model", "test-llama"]) == 1
    err = capsys.readouterr().err
    assert "internal error" in err and "out of memory" not in err


def test_a_collective_failure_is_one_line_not_a_bug(monkeypatch, capsys):
    """A rank whose collective failed because another rank stopped says so in one line (exit 3, so the launcher
    reports the other rank): its own run has no bug to report, the other rank's line says what went wrong."""
    from slide_core.distributed import CollectiveError

    try:
        try:
            raise CollectiveError("rank 1 of 2: the all-reduce of the loss failed; another rank has probably stopped")
        except CollectiveError as collective:
            raise WorkerFailure("the optimizer worker failed") from collective
    except WorkerFailure as failure:
        wrapped = failure
    _fail_with(monkeypatch, "train", wrapped)
    assert cli.main(["train", "--model", "test-llama"]) == 3
    err = capsys.readouterr().err
    assert err.strip() == (
        "slide train: error: rank 1 of 2: the all-reduce of the loss failed; another rank has probably stopped"
    )


def test_a_command_whose_parser_cannot_be_built_fails_every_command(slide, monkeypatch):
    """Every command's parser is built on each run, and the tests' ``slide`` fixture leaves none out: a
    command whose ``add_parser`` breaks fails loudly, whichever command was asked for."""

    def broken(commands):
        raise RuntimeError("export's add_parser broke")

    monkeypatch.setattr("slide_hf.cli.export.add_parser", broken)
    with pytest.raises(RuntimeError, match="export's add_parser broke"):
        slide("plan", "--help")


def test_lines_of_processes_sharing_stderr_never_mix_even_unbuffered(tmp_path):
    """The ranks of a data-parallel run share one stderr and fail at the same moment. Under
    ``PYTHONUNBUFFERED`` ``print`` writes a line's text and its newline separately, and two ranks' error
    lines came out spliced into one (rank 1's, then rank 0's whole line, then rank 1's newline). ``say``
    writes each line at once: two processes writing long lines as fast as they can, started together,
    leave every line whole."""
    import os
    import subprocess
    import sys
    import time

    start = time.time() + 3.0  # both processes past their imports, then writing at once
    code = (
        "import sys, time\nfrom slide_hf.errors import say\n"
        f"while time.time() < {start}: pass\n"
        "for i in range(4000):\n    say('slide train: error: ' + sys.argv[1] * 300 + ' ' + str(i))\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    read_end, write_end = os.pipe()
    writers = [subprocess.Popen([sys.executable, "-c", code, tag], stderr=write_end, env=env) for tag in "ab"]
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        lines = pipe.read().splitlines()
    assert [writer.wait(timeout=60) for writer in writers] == [0, 0]
    assert len(lines) == 8000
    whole = {f"slide train: error: {tag * 300} {i}" for tag in "ab" for i in range(4000)}
    assert set(lines) == whole


@pytest.mark.parametrize(("rank", "printed"), [("0", True), ("1", False), ("", True)])
def test_an_orderly_stop_is_said_once_for_every_rank(monkeypatch, capsys, rank, printed):
    """A signal stops every rank of a data-parallel run together (Note [Stop on every rank]), each with
    the same words; the console showed them once per rank. Rank 0 (or the only process) says it."""
    from slide_hf.errors import RunStopped

    monkeypatch.setenv("RANK", rank)
    _fail_with(monkeypatch, "train", RunStopped("stopped by SIGINT during the reference pass", 130))
    assert cli.main(["train", "--model", "tiny-llama", "--device", "cpu"]) == 130
    err = capsys.readouterr().err
    assert (err == "slide train: stopped by SIGINT during the reference pass\n") if printed else err == ""
