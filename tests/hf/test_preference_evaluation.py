"""Evaluation of held-out pairs under `slide train --objective dpo|simpo` (``--eval-data``, ``--eval-fraction``;
slide_hf/preference/run.py, Note [A head per pair set]).

Each evaluation's ``eval_loss`` and TRL-named ``eval_rewards/*`` and ``eval_logps/*`` are held against an
independent computation, as test_preference_exactness.py holds training: transformers' own forward in
float64 on the weights the run evaluated (its weights-only saves and its export), the DPO, IPO and SimPO
losses written there from their papers, and for DPO the reference log-probabilities of the starting weights.
A run with evaluation trains bit for bit as one without; a resumed run with evaluation ends bit for bit on
the uninterrupted one and runs neither reference pass again; ``--save-best`` keeps the lowest eval loss; and
each malformed evaluation input is refused in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_preference_exactness import CASES, STEPS, Case, _completion_logps, _exported, _loss, _records, _rows
from test_preference_exactness import _setup as _setup_training
from test_preference_exactness import _train as _train_run
from transformers import AutoModelForCausalLM

import slide_hf
from slide_hf.data import DataOptions
from slide_hf.data.dataset import held_out
from slide_hf.data.preference import load_pair_split, load_pairs
from slide_hf.errors import UserError
from slide_hf.preference.head import METRIC_NAMES
from slide_hf.preference.tags import decode_tags
from slide_hf.progress import Progress
from slide_hf.run_export import weights_dir

pytest.importorskip("transformers")

EVAL_PAIRS = 5
"""Held-out pairs: an odd count, so the last evaluation micro-batch holds one pair."""
RTOL = 1e-5
"""Of the float64 computation. A value that cancels -- a reward, a small difference of two completions'
log-probabilities (after a step a hundredth of a nat against several), or IPO's squared loss as its margin
nears the target -- may be as far from it as ``NOISE_FACTOR`` times transformers' own fp32 forward is,
whose rounding alone puts such a value up to 3e-5 of itself away (IPO's rejected reward after one step,
its loss after three)."""
NOISE_FACTOR = 4.0
METRICS = METRIC_NAMES  # TRL's names; the independent computation below spells each one out

pytestmark = pytest.mark.usefixtures("torch_kernels")


def _held_out_records(case: Case, count: int = EVAL_PAIRS) -> list[dict[str, Any]]:
    """Pairs of the training pairs' kind that the run never trains on (the numbers go on past them)."""
    return _records(case.pairs + count)[case.pairs :]


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _setup(case: Case, tmp_path: Path, held: list[dict[str, Any]] | None = None) -> tuple[Any, Path, Path]:
    _, tokenizer, data = _setup_training(case, tmp_path)
    eval_data = _write(tmp_path / "eval.jsonl", _held_out_records(case) if held is None else held)
    return tokenizer, data, eval_data


def _train(case: Case, tmp_path: Path, data: Path, output: str, **extra: Any) -> tuple[list, list]:
    """``(step records, evaluation records)`` of a run of ``case`` (test_preference_exactness's options)."""
    evaluations: list[dict[str, Any]] = []
    steps = _train_run(case, tmp_path, data, output, on_eval=evaluations.append, **extra)
    return steps, evaluations


def _timeless(evaluations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluation records less their wall time: what two runs of the same evaluations share, bit for bit."""
    return [{key: value for key, value in e.items() if key != "eval_time_s"} for e in evaluations]


def _model(path: Path, dtype: torch.dtype = torch.float64) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").to(dtype).eval()


def _independent_evaluation(
    case: Case, policy_dir: Path, reference_dir: Path, tokenizer: Any, dtype: torch.dtype
) -> dict[str, float]:
    """The evaluation record of the held-out pairs at ``policy_dir``'s weights, from the papers' losses,
    transformers' forward in ``dtype``."""
    rows = _rows(tokenizer, _held_out_records(case), packing=case.packing)
    every = slice(0, len(rows.input_ids))
    with torch.no_grad():
        policy = _completion_logps(_model(policy_dir, dtype), rows, every)
        reference = _completion_logps(_model(reference_dir, dtype), rows, every) if case.objective == "dpo" else None
    losses, chosen, rejected = _loss(case, policy, reference)
    averaged = case.objective == "simpo" or case.options.get("dpo_loss") == "ipo"
    logp_c, logp_r, counts = policy
    if averaged:
        logp_c, logp_r = logp_c / counts[0], logp_r / counts[1]
    assert len(losses) == EVAL_PAIRS
    return {
        "eval_loss": losses.mean().item(),
        "eval_rewards/chosen": chosen.mean().item(),
        "eval_rewards/rejected": rejected.mean().item(),
        "eval_rewards/accuracies": (chosen > rejected).double().mean().item(),
        "eval_rewards/margins": (chosen - rejected).mean().item(),
        "eval_logps/chosen": logp_c.mean().item(),
        "eval_logps/rejected": logp_r.mean().item(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-dpo-smoothed", "llama-ipo", "qwen3-simpo", "qwen3-dpo-packed"])
def test_evaluation_matches_an_independent_computation(name: str, tmp_path: Path) -> None:
    """Every evaluation (after each step, ``--eval-every 1``) against the weights it evaluated: the
    weights-only saves of steps 1 and 2, the export of step 3."""
    case = CASES[name]
    tokenizer, data, eval_data = _setup(case, tmp_path)
    steps, evaluations = _train(case, tmp_path, data, "run", eval_data=eval_data, eval_every=1, save_weights_every=1)
    assert len(steps) == STEPS and [e["step"] for e in evaluations] == list(range(1, STEPS + 1))
    run = tmp_path / "run"
    for record in evaluations:
        step = record["step"]
        weights = run / "model" if step == STEPS else weights_dir(run, step)
        expected = _independent_evaluation(case, weights, tmp_path / "model", tokenizer, torch.float64)
        fp32 = _independent_evaluation(case, weights, tmp_path / "model", tokenizer, torch.float32)
        assert record["eval_loss_tokens"] == EVAL_PAIRS  # the divisor: the pairs
        assert "perplexity" not in record
        for key, value in expected.items():
            error, hf_error = abs(record[key] - value), abs(fp32[key] - value)
            assert error <= max(RTOL * abs(value), NOISE_FACTOR * hf_error), (step, key, record[key], value, fp32[key])
        if case.options.get("dpo_loss") != "ipo":  # IPO's (h - 1 / (2 beta))^2 cancels as h nears its target
            assert abs(record["eval_loss"] - expected["eval_loss"]) <= RTOL * expected["eval_loss"]
    # The evaluation moved with training (the test can tell one evaluation from another).
    assert evaluations[0]["eval_loss"] != evaluations[-1]["eval_loss"]
    # The run's log has each evaluation's line, and metrics.jsonl its records.
    lines = (run / "train.log").read_text()
    assert f"eval at step {STEPS}: eval_loss {evaluations[-1]['eval_loss']:.4f}  reward acc" in lines
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_loss"] for r in logged if "eval_loss" in r] == [e["eval_loss"] for e in evaluations]
    assert all(f"eval_{key}" in r for r in logged if "eval_loss" in r for key in METRICS)


@pytest.mark.slow
def test_evaluation_changes_no_training_bit(tmp_path: Path) -> None:
    """A DPO run evaluated after every step trains as the run without evaluation: the same step records
    (loss and metrics) and the same weights, bit for bit (Note [A head per pair set])."""
    case = CASES["qwen3-dpo"]
    _, data, eval_data = _setup(case, tmp_path)
    plain, none = _train(case, tmp_path, data, "plain")
    evaluated, evaluations = _train(case, tmp_path, data, "evaluated", eval_data=eval_data, eval_every=1)
    assert not none and len(evaluations) == STEPS
    for ours, theirs in zip(evaluated, plain, strict=True):
        for key in ("loss", "grad_norm", *METRICS):
            assert ours[key] == theirs[key], key
    ours_weights, theirs_weights = _exported(tmp_path / "evaluated"), _exported(tmp_path / "plain")
    assert ours_weights.keys() == theirs_weights.keys()
    for key in ours_weights:
        assert torch.equal(ours_weights[key], theirs_weights[key]), key


@pytest.mark.slow
def test_resume_with_evaluation_is_bit_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DPO run with held-out pairs stopped after step 2 and resumed: the uninterrupted run's steps,
    evaluations and weights, bit for bit, and neither reference pass runs again (Note [Reference pass once
    per run]): the training pairs' and the held-out pairs' saved log-probabilities are read."""
    case = CASES["qwen3-dpo"]
    _, data, eval_data = _setup(case, tmp_path)
    options = {"eval_data": eval_data, "eval_every": 1}
    whole, whole_evals = _train(case, tmp_path, data, "whole", **options)
    first, first_evals = _train(case, tmp_path, data, "parts", steps=2, save_every=1, **options)
    saved = sorted((tmp_path / "parts/.data-cache/reference").glob("logps-*.pt"))
    assert len(saved) == 2  # the training pairs' and the held-out pairs'
    stamps = [path.stat().st_mtime_ns for path in saved]
    rest: list[dict[str, Any]] = []
    rest_evals: list[dict[str, Any]] = []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slide.train"):
        slide_hf.train(resume=tmp_path / "parts", steps=STEPS, on_step=rest.append, on_eval=rest_evals.append)
    assert not any("micro-batches in" in line for line in caplog.messages)  # no pass ran
    assert sum("reference log-probabilities of" in line and " from " in line for line in caplog.messages) == 2
    assert [path.stat().st_mtime_ns for path in saved] == stamps
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    assert _timeless(first_evals + rest_evals) == _timeless(whole_evals)
    ours_weights, theirs_weights = _exported(tmp_path / "parts"), _exported(tmp_path / "whole")
    for key in theirs_weights:
        assert torch.equal(ours_weights[key], theirs_weights[key]), key


@pytest.mark.slow
def test_ref_model_is_the_held_out_pairs_reference_too(tmp_path: Path) -> None:
    """``--ref-model`` naming a copy of the starting model: both reference passes run on its engine, before
    training's, and every evaluation is the default reference's, bit for bit."""
    import shutil

    case = CASES["llama-dpo-smoothed"]
    _, data, eval_data = _setup(case, tmp_path)
    shutil.copytree(tmp_path / "model", tmp_path / "ref")
    _, default = _train(case, tmp_path, data, "default", eval_data=eval_data, eval_every=1)
    _, named = _train(case, tmp_path, data, "named", eval_data=eval_data, eval_every=1, ref_model=tmp_path / "ref")
    assert len(sorted((tmp_path / "named/.data-cache/reference").glob("logps-*.pt"))) == 2
    assert _timeless(named) == _timeless(default)


@pytest.mark.slow
def test_save_best_keeps_the_lowest_eval_loss(tmp_path: Path) -> None:
    """``--save-best`` under DPO: the held-out pairs prefer what training learns to reject (their chosen
    and rejected swapped), so the eval loss climbs after the first step; the best checkpoint is the
    lowest evaluation's, and model/ holds its weights, whose loss on the held-out pairs is that record's."""
    case = CASES["qwen3-dpo"]
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in _held_out_records(case)]
    tokenizer, data, eval_data = _setup(case, tmp_path, swapped)
    _, evaluations = _train(
        case, tmp_path, data, "run", eval_data=eval_data, eval_every=1, save_best=True, keep_checkpoints=1
    )
    losses = {e["step"]: e["eval_loss"] for e in evaluations}
    best = min(losses, key=losses.__getitem__)
    assert best < STEPS and losses[STEPS] > losses[best], f"test setup: the last step must not be the best {losses}"
    run = tmp_path / "run"
    saved = json.loads((run / "checkpoints/best.json").read_text())
    assert saved["step"] == best and saved["eval_loss"] == losses[best]
    assert (run / saved["path"]).is_dir()
    assert json.loads((run / "model/slide-export.json").read_text()) == {"step": best}
    rows = _rows(tokenizer, swapped, packing=False)
    every = slice(0, len(rows.input_ids))
    with torch.no_grad():
        policy = _completion_logps(_model(run / "model"), rows, every)
        reference = _completion_logps(_model(tmp_path / "model"), rows, every)
    assert losses[best] == pytest.approx(_loss(case, policy, reference)[0].mean().item(), rel=RTOL)


# -- the split by pair -------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_eval_fraction_holds_out_whole_pairs_as_sft_holds_out_records(tmp_path: Path, packing: bool) -> None:
    """``--eval-fraction``: the pairs SFT's rule holds out (slide_hf/data/dataset.py's ``held_out``, by the
    record's index and the seed), a pair's chosen and rejected always together; each side's rows are those
    of a file holding its pairs alone, bit for bit."""
    from test_data_tokenizer import QWEN3, chat_tokenizer

    tokenizer = chat_tokenizer(QWEN3)
    records = _records(24)
    data = _write(tmp_path / "pairs.jsonl", records)
    options = DataOptions(seq_len=512, packing=packing)
    fraction, seed = 0.25, 3
    train, held = load_pair_split(data, tokenizer, options, eval_fraction=fraction, seed=seed)
    chosen = [i for i in range(len(records)) if held_out(seed, 0, i, fraction)]
    assert 0 < len(chosen) < len(records)
    assert (train.stats.examples, held.stats.examples) == (len(records) - len(chosen), len(chosen))
    alone = {
        "train": load_pairs(_write(tmp_path / "t.jsonl", [r for i, r in enumerate(records) if i not in chosen]),
                            tokenizer, options),
        "eval": load_pairs(_write(tmp_path / "e.jsonl", [records[i] for i in chosen]), tokenizer, options),
    }  # fmt: skip
    for split, rows in (("train", train), ("eval", held)):
        assert torch.equal(rows.input_ids, alone[split].input_ids), split
        assert torch.equal(rows.labels, alone[split].labels), split
        assert rows.digest == alone[split].digest
        _, completions = decode_tags(rows.labels)
        for row in range(len(rows)):  # each row holds both completions of each of its pairs
            numbers = set(completions[row][completions[row] >= 0].tolist())
            assert numbers and all(n ^ 1 in numbers for n in numbers)
    assert held.source.endswith("(eval split)")


# -- hostile inputs ----------------------------------------------------------------------------------------
def _hostile_run(tmp_path: Path, model_dir: Path, records: list[dict[str, Any]], **options: Any) -> str:
    data = _write(tmp_path / "pairs.jsonl", records)
    with pytest.raises(UserError) as error:
        slide_hf.train(
            model_dir, data=data, output=tmp_path / "run", device="cpu", dtype="float32", seq_len=512,
            batch_size=1, steps=1, objective="dpo", **options,
        )  # fmt: skip
    message = str(error.value)
    assert "\n" not in message
    return message


def _pairs_all_held(count: int, fraction: float) -> int:
    """A seed that holds out every one of ``count`` pairs at ``fraction``."""
    return next(seed for seed in range(10_000) if all(held_out(seed, 0, i, fraction) for i in range(count)))


def _pairs_none_held(count: int, fraction: float) -> int:
    return next(seed for seed in range(10_000) if not any(held_out(seed, 0, i, fraction) for i in range(count)))


def test_hostile_evaluation_inputs_are_one_line_each(tmp_path: Path) -> None:
    case = CASES["qwen3-dpo"]
    _setup_training(case, tmp_path)
    model_dir = tmp_path / "model"
    records = _records(3)
    missing = _write(tmp_path / "missing.jsonl", [records[0], {"prompt": "Hi", "chosen": "Hello."}])
    message = _hostile_run(tmp_path, model_dir, records, eval_data=missing)
    assert "missing.jsonl:2" in message and "no 'rejected'" in message
    empty = _write(tmp_path / "empty.jsonl", [])
    message = _hostile_run(tmp_path, model_dir, records, eval_data=empty)
    assert "eval_data" in message and message.endswith(f"{empty} holds no preference pair")
    seed = _pairs_none_held(3, 0.05)
    message = _hostile_run(tmp_path, model_dir, records, eval_fraction=0.05, seed=seed)
    assert "eval_fraction" in message and "0.05 holds out none of the 3 pair(s)" in message and "raise it" in message
    seed = _pairs_all_held(3, 0.9)
    message = _hostile_run(tmp_path, model_dir, records, eval_fraction=0.9, seed=seed)
    assert "eval_fraction" in message and "0.9 holds out all 3 pair(s)" in message and "lower it" in message


def test_slide_train_refuses_an_empty_eval_file_in_one_line(tmp_path: Path, slide: Any) -> None:
    case = CASES["qwen3-dpo"]
    _, data, _ = _setup(case, tmp_path)
    empty = _write(tmp_path / "empty.jsonl", [])
    status, _, err = slide(
        "train", "--model", tmp_path / "model", "--data", data, "--eval-data", empty, "--objective", "simpo",
        "--device", "cpu", "--seq-len", "512", "--steps", "1", "--output", tmp_path / "run",
    )  # fmt: skip
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert status == 2 and len(lines) == 1 and "holds no preference pair" in lines[0] and "Traceback" not in err


def test_the_evaluation_line_of_a_preference_run() -> None:
    """The progress line: the held-out pairs' reward accuracy and margin in place of a perplexity."""
    record = {"step": 4, "eval_loss": 0.5, "eval_rewards/accuracies": 0.75, "eval_rewards/margins": 1.25}
    progress = Progress(4, first_step=0, has_gpu=False, log_every=1)
    with pytest.MonkeyPatch.context() as patch:
        lines: list[str] = []
        patch.setattr("slide_hf.progress.log.info", lambda line, *args: lines.append(line % args if args else line))
        progress.evaluation(record)
        progress.evaluation({"step": 4, "eval_loss": 2.0, "perplexity": 7.389})
    assert lines == [
        "eval at step 4: eval_loss 0.5000  reward acc 0.75  margin 1.25",
        "eval at step 4: eval_loss 2.0000  perplexity 7.389",
    ]


def test_a_step_sums_its_counts_and_metrics_in_one_host_collective(tmp_path: Path, monkeypatch) -> None:
    """A DPO step's token count, stop signals and TRL metrics are added over the ranks together: one host
    collective a step (this process's group counts them), and the metrics still reach the log."""
    from slide_core.collectives import SingleProcess

    case = CASES["qwen3-dpo"]
    _setup_training(case, tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(SingleProcess, "all_reduce_host_", lambda self, tensor, what: calls.append(what))
    monkeypatch.setattr(SingleProcess, "sum_counts", lambda self, counts, what: calls.append(what) or list(counts))
    data = _write(tmp_path / "pairs.jsonl", _records(4))
    steps: list[dict[str, Any]] = []
    slide_hf.train(
        tmp_path / "model", data=data, output=tmp_path / "run", device="cpu", dtype="float32", seq_len=512,
        batch_size=1, steps=2, objective="dpo", on_step=steps.append,
    )  # fmt: skip
    assert calls.count("the sum of the step's real tokens, signals and metrics") == 2
    assert not [
        what for what in calls if "preference metrics" in what or ("real tokens" in what and "metrics" not in what)
    ]
    assert all(name in record for record in steps for name in METRIC_NAMES)
