"""`slide train --init-from`: a new run from a finished run's weights and AdamW state, against a reference
that shares no training code with slide: transformers' model and loss, ``torch.optim.AdamW`` (weight decay on
tensors of two or more dimensions) under transformers' cosine schedule for run A, then the same optimizer
object, its moments and per-parameter step counts untouched, at run B's constant lr. Run B's exported weights
must equal that reference to 1e-5 of each tensor's norm (fp32 on the CPU); an AdamW restarted from zero, or
one whose bias correction restarted at step 1, lands 1e-3 or more away.

``--init-weights-only`` is the same against a fresh ``torch.optim.AdamW`` over A's final weights. Then the
refusals, one line each, and the step numbering of a run started so and resumed.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

import slide_hf
from slide_hf import PRESETS
from slide_hf.cli.main import main
from slide_hf.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter

STEPS_A, STEPS_B, ACCUM, BATCH, SEQ = 4, 3, 2, 2, 24
LR_A, WARMUP_A, LR_B = 3e-3, 1, 1e-3
WEIGHT_DECAY, BETAS, EPS = 0.1, (0.9, 0.999), 1e-6  # EPS: Note [Conditioning of the comparison], reference tests
RTOL = 1e-5
"""Per tensor, ``|ours - reference| / |reference|``. Two fp32 runs of the same arithmetic in another order end
about 1e-6 apart here; carrying the moments wrongly (zeros, or the bias correction of step 1) moves each
weight by about one lr step, 1e-3 of the tensor or more."""


@dataclass
class Rows:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def _documents(vocab: int) -> list[list[int]]:
    """One document a row (``--no-packing``), in file order (``--no-shuffle``): every row of run A's steps."""
    g = torch.Generator().manual_seed(1)
    lengths = (SEQ, SEQ - 7)
    return [torch.randint(0, vocab, (lengths[i % 2],), generator=g).tolist() for i in range(STEPS_A * ACCUM * BATCH)]


def _rows(documents: list[list[int]], pad_id: int) -> Rows:
    """Each document a row, padding unlabelled; labels HF-aligned (the model shifts them)."""
    ids, labels, positions = [], [], []
    for doc in documents:
        fill = SEQ - len(doc)
        ids.append(doc + [pad_id] * fill)
        labels.append(doc + [-100] * fill)
        positions.append(list(range(SEQ)))
    return Rows(torch.tensor(ids), torch.tensor(labels), torch.tensor(positions))


def _steps(rows: Rows, count: int) -> Iterator[list[slice]]:
    """The micro-batches of the first ``count`` steps: a new run reads the data from its start."""
    for step in range(count):
        first = step * ACCUM * BATCH
        yield [slice(first + i * BATCH, first + (i + 1) * BATCH) for i in range(ACCUM)]


def _adamw(hf: Any) -> torch.optim.AdamW:
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    rest = [p for p in hf.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR_A, betas=BETAS, eps=EPS)


def _train(hf: Any, optimizer: torch.optim.Optimizer, rows: Rows, steps: int, lr_of_step: Any) -> list[float]:
    """Train ``hf`` in place with ``optimizer``; ``lr_of_step(step)`` sets each step's lr. Each step's loss
    is its micro-batches' token-weighted mean, as slide's."""
    losses = []
    for step, micro in enumerate(_steps(rows, steps)):
        lr_of_step(step)
        tokens = sum(int((rows.labels[m, 1:] != -100).sum()) for m in micro)
        total = 0.0
        for m in micro:
            count = int((rows.labels[m, 1:] != -100).sum())
            out = hf(rows.input_ids[m], labels=rows.labels[m], position_ids=rows.position_ids[m], use_cache=False)
            loss_sum = out.loss * count  # HF returns the mean over this micro-batch
            (loss_sum / tokens).backward()
            total += loss_sum.item()
        losses.append(total / tokens)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class RunA:
    """Run A (slide) and the reference of it, after A's steps: its model and optimizer, ready to go on."""

    root: Path
    model_dir: Path
    data: Path
    run: Path
    hf: Any
    optimizer: torch.optim.AdamW
    rows: Rows


COMMON: dict[str, Any] = dict(
    device="cpu", dtype="float32", seq_len=SEQ, batch_size=BATCH, grad_accum=ACCUM, packing=False, no_shuffle=True,
    weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, save_dtype="float32",
)  # fmt: skip


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> RunA:
    root = tmp_path_factory.mktemp("init_from")
    config = PRESETS["test-llama"](vocab_size=300)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    hf.save_pretrained(root / "model")
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(str(root / "model"))
    documents = _documents(config.vocab_size)
    data = root / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in documents))
    records: list[dict[str, Any]] = []
    slide_hf.train(
        root / "model", data=data, output=root / "a", steps=STEPS_A, lr=LR_A, lr_schedule="cosine",
        warmup_steps=WARMUP_A, on_step=records.append, **COMMON,
    )  # fmt: skip

    rows = _rows(documents, tokenizer.pad_token_id)
    optimizer = _adamw(hf)
    schedule = get_cosine_schedule_with_warmup(optimizer, WARMUP_A, STEPS_A)  # transformers', not slide's
    lrs: list[float] = []

    def scheduled(step: int) -> None:
        if step:
            schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])

    losses = _train(hf, optimizer, rows, STEPS_A, scheduled)
    assert [r["lr"] for r in records] == pytest.approx(lrs, rel=1e-6, abs=1e-12)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    return RunA(root, root / "model", data, root / "a", hf, optimizer, rows)


def _exported(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_close(model_dir: Path, reference: Any) -> None:
    exported, state = _exported(model_dir), reference.state_dict()
    assert exported and set(exported) <= set(state) and len(exported) >= len(state) - 1  # the tied head
    for key, ours in exported.items():
        truth = state[key].detach()
        error = (ours - truth).norm().item() / truth.norm().item()
        assert error <= RTOL, f"{key}: {error:.2e} of its norm from the reference"


def _copies(run_a: RunA) -> tuple[Any, torch.optim.AdamW]:
    """A copy of run A's reference model, and its optimizer's state carried over to the copy's parameters."""
    hf = AutoModelForCausalLM.from_config(run_a.hf.config, attn_implementation="eager").float().eval()
    hf.load_state_dict(run_a.hf.state_dict())
    optimizer = _adamw(hf)
    optimizer.load_state_dict(run_a.optimizer.state_dict())  # moments and per-parameter step counts
    return hf, optimizer


def test_init_from_continues_adamw_under_a_new_schedule(run_a: RunA, tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    slide_hf.train(
        data=run_a.data, output=tmp_path / "b", init_from=run_a.run, steps=STEPS_B, lr=LR_B,
        lr_schedule="constant", on_step=records.append, **COMMON,
    )  # fmt: skip
    hf, optimizer = _copies(run_a)
    steps_seen = {int(state["step"]) for state in optimizer.state.values()}
    assert steps_seen == {STEPS_A}  # what B's bias correction counts on from
    losses = _train(hf, optimizer, run_a.rows, STEPS_B, lambda step: _set_lr(optimizer, LR_B))
    _assert_close(tmp_path / "b/model", hf)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    assert [r["step"] for r in records] == list(range(1, STEPS_B + 1))  # B's own steps, not the Adam count
    assert [r["lr"] for r in records] == [LR_B] * STEPS_B


def test_init_weights_only_starts_adamw_afresh(run_a: RunA, tmp_path: Path) -> None:
    slide_hf.train(
        data=run_a.data, output=tmp_path / "b", init_from=run_a.run / "checkpoints" / f"step-{STEPS_A:08d}",
        init_weights_only=True, steps=STEPS_B, lr=LR_B, lr_schedule="constant", **COMMON,
    )  # fmt: skip
    hf, _ = _copies(run_a)
    optimizer = _adamw(hf)  # zero moments, step 0
    _train(hf, optimizer, run_a.rows, STEPS_B, lambda step: _set_lr(optimizer, LR_B))
    _assert_close(tmp_path / "b/model", hf)


def test_a_run_started_so_resumes_with_its_own_step_numbers(run_a: RunA, tmp_path: Path) -> None:
    """Its checkpoints record the Adam steps before it; a resume numbers its steps on from the run's own,
    and goes on bit-identically to the run that was not interrupted."""
    options = dict(data=run_a.data, init_from=run_a.run, lr=LR_B, lr_schedule="linear", **COMMON)
    whole: list[dict[str, Any]] = []
    slide_hf.train(output=tmp_path / "whole", steps=STEPS_B, on_step=whole.append, **options)
    part: list[dict[str, Any]] = []
    slide_hf.train(output=tmp_path / "part", steps=STEPS_B, save_every=1, **options)
    shutil.rmtree(tmp_path / f"part/checkpoints/step-{STEPS_B:08d}")
    shutil.rmtree(tmp_path / "part/model")
    slide_hf.train(resume=tmp_path / "part", steps=STEPS_B, on_step=part.append)
    assert [r["step"] for r in part] == [STEPS_B]
    assert part[0]["loss"] == whole[-1]["loss"] and part[0]["lr"] == whole[-1]["lr"]
    state = json.loads((tmp_path / f"part/checkpoints/step-{STEPS_B:08d}/state.json").read_text())
    assert state["extra"]["init_from"]["adam_step"] == STEPS_A
    assert state["extra"]["engine"]["step"] == STEPS_A + STEPS_B
    want, got = _exported(tmp_path / "whole/model"), _exported(tmp_path / "part/model")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_warning_of_a_finished_run_resumed_names_init_from(tmp_path: Path, caplog) -> None:
    common = dict(device="cpu", dtype="float32", seq_len=16, batch_size=2, lr=1e-3, lr_schedule="cosine")
    slide_hf.train(output=tmp_path / "a", steps=2, **common)
    slide_hf.train(resume=tmp_path / "a", steps=3)
    warned = [r.getMessage() for r in caplog.records if "had decayed to its floor" in r.getMessage()]
    assert len(warned) == 1 and "init_from=" in warned[0], warned


# -- refusals, one line each -----------------------------------------------------------------------------------
def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slide train: error: "), err
    return err[0].removeprefix("slide train: error: ")


REFUSALS = [
    (
        "another model",
        ["--model", "tiny-llama"],
        r"--init-from .*: the checkpoint's model differs from this run's \(it trained --model .*model\): ",
    ),
    (
        "another optimizer state format",
        ["--optimizer-state", "bf16"],
        r"--init-from .*: checkpoint .*step-00000004 holds its AdamW state in fp32 and this run keeps "
        r"--optimizer-state bf16; give --optimizer-state fp32 to carry it exactly, or --init-weights-only",
    ),
    (
        "overwriting the run it starts from",
        ["--output", "{a}", "--overwrite"],
        r"--init-from (\S+) is in \1, whose files from an earlier run --overwrite would remove .*; copy it "
        r"elsewhere first, or choose another --output",
    ),
    (
        "with --resume",
        ["--resume", "{a}"],
        r"--init-from starts a new run from a checkpoint's weights and AdamW state, and --resume continues a "
        r"run in its own directory; give one",
    ),
]


@pytest.mark.parametrize(("case", "extra", "message"), REFUSALS, ids=[row[0] for row in REFUSALS])
def test_refusals(run_a: RunA, tmp_path: Path, capsys, case: str, extra: list[str], message: str) -> None:
    argv = ["--init-from", str(run_a.run), "--output", str(tmp_path / "b"), "--device", "cpu", "--steps", "1"]
    argv += [item.format(a=run_a.run) for item in extra]
    said = _refused(argv, capsys)
    assert re.match(message, said), said
    assert not (tmp_path / "b" / "model").exists()
    assert (run_a.run / "checkpoints" / f"step-{STEPS_A:08d}" / "state.json").is_file()  # nothing removed


@pytest.mark.parametrize(
    ("case", "make", "message"),
    [
        ("a missing path", lambda root, run: root / "missing", "no such directory"),
        ("a file", lambda root, run: _touch(root / "file.txt"), "no such directory"),
        ("a folder with no checkpoint", lambda root, run: _mkdir(root / "empty"), "no checkpoint found in"),
        ("a checkpoint without its run", lambda root, run: _lone_checkpoint(root, run), "has no config/config.json"),
    ],
)
def test_a_path_that_is_no_run_or_checkpoint(
    run_a: RunA, tmp_path: Path, capsys, case: str, make: Any, message: str
) -> None:
    path = make(tmp_path, run_a.run)
    said = _refused(["--init-from", str(path), "--model", "tiny-llama", "--output", str(tmp_path / "b")], capsys)
    assert said.startswith(f"--init-from {path}: ") and message in said, said


def test_init_weights_only_needs_init_from(tmp_path: Path, capsys) -> None:
    said = _refused(["--init-weights-only", "--output", str(tmp_path / "b")], capsys)
    assert said == "--init-weights-only applies only with --init-from RUN: it says what to take of that run"


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _lone_checkpoint(root: Path, run: Path) -> Path:
    """A checkpoint copied out of its run: nothing beside it says what model it is."""
    source = run / "checkpoints" / f"step-{STEPS_A:08d}"
    return Path(shutil.copytree(source, root / "copied" / source.name))
