"""slide_hf/data/mixture.py: weighted sampling over several --data sources, seeded and resumable, as users
drive it (`slide train --data a --data b --data-weights 3,1`, the Python API, `slide data`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import slide_hf
from slide_hf.cli.main import main
from slide_hf.data.mixture import mixture_counts, mixture_order

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def _sources(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"alpha record {i} of the first source."}) + "\n" for i in range(24)))
    b.write_text("".join(json.dumps({"text": f"BETA {i}: SECOND SOURCE, SHOUTING."}) + "\n" for i in range(24)))
    return a, b


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_counts_add_up_and_follow_the_weights():
    assert mixture_counts([50, 50], [3, 1], 100) == [75, 25]
    assert mixture_counts([10, 10, 10], [1, 1, 1], 31) == [11, 10, 10]
    assert sum(mixture_counts([7, 3], [0.7, 0.3], 10)) == 10


@pytest.mark.parametrize("seed", [0, 1, 2**62])
def test_order_is_about_3_to_1_and_the_same_for_the_same_seed(seed):
    rows = [500, 500]
    first = mixture_order(rows, [3, 1], seed=seed, epoch=0)
    assert torch.equal(first, mixture_order(rows, [3, 1], seed=seed, epoch=0))
    assert not torch.equal(first, mixture_order(rows, [3, 1], seed=seed, epoch=1))
    assert not torch.equal(first, mixture_order(rows, [3, 1], seed=seed + 1, epoch=0))
    assert int((first < 500).sum()) == 750
    window = first[:100]  # interleaved: any stretch holds about 3:1
    assert 0.6 < float((window < 500).float().mean()) < 0.9


def test_slide_train_on_a_weighted_mixture_is_reproducible_and_resumes_bit_identically(tmp_path):
    a, b = _sources(tmp_path)
    run = ["train", "--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2"]
    run += ["--data", str(a), "--data", str(b), "--lr-schedule", "constant", "--lr", "3e-3", "--data-weights"]
    run, weighted = run[:-1], [*run, "3,1"]
    full, again = tmp_path / "full", tmp_path / "again"
    assert main([*weighted, "--steps", "6", "--save-every", "3", "--output", str(full)]) == 0
    assert main([*weighted, "--steps", "6", "--output", str(again)]) == 0
    assert _losses(full) == _losses(again)  # same seed, same order
    options = json.loads((full / "options.json").read_text())
    assert options["data"] == [str(a), str(b)] and options["data_weights"] == [3.0, 1.0]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints/step-00000003", resumed / "checkpoints/step-00000003")
    shutil.copytree(full / "config", resumed / "config")
    shutil.copytree(full / "tokenizer", resumed / "tokenizer")
    assert main(["train", "--resume", str(resumed)]) == 0
    assert _losses(resumed) == _losses(full)[3:]
    other = tmp_path / "other"
    assert main([*run, "--data-weights", "1,3", "--steps", "6", "--output", str(other)]) == 0
    assert _losses(other) != _losses(full)  # the weights change what is drawn


def test_the_python_api_takes_lists(tmp_path):
    a, b = _sources(tmp_path)
    summary = slide_hf.train(
        "tiny-llama",
        data=[str(a), b],
        data_weights=[1, 1],
        output=tmp_path / "run",
        device="cpu",
        dtype="float32",
        seq_len=32,
        batch_size=2,
        steps=2,
        eval_fraction=0.2,
    )
    assert summary.steps == 2


def test_slide_data_reports_each_sources_share(tmp_path, capsys):
    a, b = _sources(tmp_path)
    b.write_text(b.read_text() * 3)  # three times the rows of a
    argv = ["data", "--data", str(a), "--data", str(b), "--seq-len", "64", "--no-packing", "--show", "0"]
    assert main([*argv, "--json", "--data-weights", "3,1"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    shares = summary["sources"]
    assert [s["name"] for s in shares] == [str(a), str(b)]
    assert [s["rows"] for s in shares] == [24, 72] and [s["row_share"] for s in shares] == [0.25, 0.75]
    assert [s["sampled_share"] for s in shares] == [0.75, 0.25]
    assert sum(s["tokens"] for s in shares) == summary["tokens"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"source {a}: 24 rows (25.0%)" in out and f"source {b}: 72 rows (75.0%)" in out
    assert main([*argv, "--data-weights", "3"]) == 2
    assert "--data-weights gives 1 weight(s) for 2 --data source(s)" in capsys.readouterr().err
