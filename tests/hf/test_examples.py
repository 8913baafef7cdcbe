"""examples/*.toml: every shipped config parses into a valid run, and its shape fits the machine it names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from slide_hf.cli import main as cli
from slide_hf.cli import train as train_cli
from slide_hf.options import TrainConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAME_SHAPE_PRESET = {"meta-llama/Llama-3.1-8B-Instruct": "llama3.1-8b", "Qwen/Qwen2.5-7B": "qwen2.5-7b"}
"""Hub models the examples name -> the preset of the same shape (CI has no network)."""


def _options(path: Path) -> dict:
    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--config", str(path)])
    return train_cli.given_options(args)


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.toml")) == [
        "chat-sft-8b-24gib.toml",
        "continued-pretraining-text.toml",
        "dpo-after-sft-8b-24gib.toml",
        "resume.toml",
    ]


@pytest.mark.parametrize(
    "name", ["chat-sft-8b-24gib.toml", "continued-pretraining-text.toml", "dpo-after-sft-8b-24gib.toml"]
)
def test_example_parses_and_its_plan_fits(name, capsys):
    options = _options(EXAMPLES / name)
    cfg = TrainConfig(**options)
    preset = SAME_SHAPE_PRESET[cfg.model]
    argv = ["plan", "--model", preset, "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len)]
    argv += ["--grad-accum", str(cfg.grad_accum), "--gpu-memory", cfg.gpu_memory, "--host-memory", "1TiB"]
    assert cli.main([*argv, "--json", "--check"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True
    gib = 2**30
    assert plan["gpu_peak_bytes"] <= int(cfg.gpu_memory.removesuffix("GiB")) * gib


def test_resume_example_continues_a_run(tmp_path, monkeypatch, torch_kernels, capsys):
    monkeypatch.chdir(tmp_path)
    run = ["--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3"]
    assert cli.main(["train", "--output", "runs/llama8b-chat", "--steps", "2", *run]) == 0
    options = _options(EXAMPLES / "resume.toml")
    assert options["resume"] == "runs/llama8b-chat" and options["steps"] == 3000
    capsys.readouterr()
    # Flags win over the file: three steps in all, one more than the saved run.
    status = cli.main(["train", "--config", str(EXAMPLES / "resume.toml"), "--steps", "3", "--device", "cpu"])
    assert status == 0, capsys.readouterr().err
    records = [json.loads(line) for line in Path("runs/llama8b-chat/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "eval_loss" not in r] == [1, 2, 3]
