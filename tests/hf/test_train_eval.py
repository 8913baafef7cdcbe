"""`slide train` end to end on CPU/fp32: packed training data and evaluation, checked against transformers.

The model is a preset trained with the bundled byte tokenizer; its export carries that tokenizer, so the
reference side is exactly what a user would run afterwards: ``AutoModelForCausalLM.from_pretrained`` over
each document on its own, no packing.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer

from slide_hf.cli.main import main

SEQ = 96  # longer than every document: none is split
RUN = ("--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--seq-len", str(SEQ), "--lr", "1e-3")

DOCS = [
    "The sliding window keeps one layer on the device.",
    "Adam moments live in host memory.",
    "Short.",
    "Packing places whole documents side by side in one row of the batch.",
    "Position ids restart at every document.",
    "No token predicts the first token of the next document.",
    "Evaluation runs the same forward without touching optimizer state.",
    "The end.",
]


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _rows(data: Path) -> int:
    """How many packed rows `slide train` will make of ``data`` (the bundled byte tokenizer, SEQ)."""
    from slide_hf.data import DataOptions, load_dataset
    from slide_hf.tokenizer import byte_tokenizer

    return len(load_dataset(data, byte_tokenizer(), DataOptions(seq_len=SEQ)))


def _reference_loss(model_dir: Path, texts: list[str]) -> float:
    """transformers over each document separately: summed token losses over all documents' loss tokens.

    Each document is what the data pipeline makes of a text row: its tokens plus EOS, every token a label,
    the first one predicting nothing (it starts the document)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
            ids = torch.tensor([ids])
            logits = hf(input_ids=ids).logits.float()
            losses = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            total += float(losses)
            count += ids.shape[1] - 1
    return total / count


def test_eval_loss_equals_transformers_on_the_exported_weights(tmp_path, capsys):
    train = _jsonl(tmp_path / "train.jsonl", DOCS)
    held_out = _jsonl(tmp_path / "eval.jsonl", [*DOCS[:3], "A held-out sentence the model never trained on."])
    run = tmp_path / "run"
    argv = ["train", *RUN, "--data", train, "--eval-data", held_out, "--eval-every", "2"]
    argv += ["--steps", "3", "--batch-size", "2", "--output", run]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    evals = [r for r in _records(run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3]  # every 2 steps, and at the end
    final = evals[-1]
    expected = _reference_loss(run / "model", [*DOCS[:3], "A held-out sentence the model never trained on."])
    assert final["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert final["perplexity"] == pytest.approx(math.exp(final["eval_loss"]), rel=1e-9)
    assert "eval at step 3: eval_loss" in (run / "train.log").read_text()


def test_first_step_loss_does_not_depend_on_document_order_and_equals_separate_documents(tmp_path, capsys):
    losses = []
    for seed in (0, 1, 2):
        order = DOCS[:]
        random.Random(seed).shuffle(order)
        data = _jsonl(tmp_path / f"train{seed}.jsonl", order)
        run = tmp_path / f"run{seed}"
        # One step over every row: the step's documents are the whole file, whatever their order.
        rows = str(_rows(data))
        argv = ["train", *RUN, "--data", data, "--steps", "1", "--batch-size", rows, "--no-shuffle", "--output", run]
        assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
        losses.append(_records(run)[0]["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert losses[2] == pytest.approx(losses[0], rel=1e-6)
    # The first step's loss is the initial weights' loss: the same model, untrained, through transformers.
    init_run = tmp_path / "init"
    argv = ["train", *RUN, "--data", tmp_path / "train0.jsonl", "--steps", "1", "--lr", "0", "--output", init_run]
    argv += ["--batch-size", str(_rows(tmp_path / "train0.jsonl"))]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert losses[0] == pytest.approx(_reference_loss(init_run / "model", DOCS), rel=1e-5)


def test_eval_fraction_and_save_best_keep_the_best_checkpoint(tmp_path, capsys):
    data = _jsonl(tmp_path / "train.jsonl", DOCS * 4)
    run = tmp_path / "run"
    argv = ["train", *RUN, "--data", data, "--eval-fraction", "0.25", "--eval-every", "1", "--save-best"]
    argv += ["--steps", "4", "--batch-size", "2", "--keep-checkpoints", "1", "--output", run]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    evals = {r["step"]: r["eval_loss"] for r in _records(run) if "eval_loss" in r}
    assert sorted(evals) == [1, 2, 3, 4]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["step"] == min(evals, key=evals.get)
    assert best["eval_loss"] == pytest.approx(min(evals.values()))
    assert (run / best["path"]).is_dir()  # kept, whatever --keep-checkpoints pruned; relative to the run


def test_eval_does_not_change_training(tmp_path, capsys):
    data = _jsonl(tmp_path / "train.jsonl", DOCS)
    held_out = _jsonl(tmp_path / "eval.jsonl", DOCS[:2])
    runs = {}
    for name, extra in (("plain", []), ("evaluated", ["--eval-data", held_out, "--eval-every", "1"])):
        argv = ["train", *RUN, "--data", data, "--steps", "3", "--batch-size", "2", "--output", tmp_path / name]
        assert main([str(a) for a in [*argv, *extra]]) == 0, capsys.readouterr().err
        runs[name] = [r["loss"] for r in _records(tmp_path / name) if "eval_loss" not in r]
    assert runs["evaluated"] == runs["plain"]  # bit-identical
