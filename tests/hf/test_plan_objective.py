"""The plan of a preference run (``--objective dpo|simpo``): the head's extra log-probability pass in the
step, DPO's reference pass before the first step, and `slide plan` taking the option as `slide train` does."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from slide_hf import setup
from slide_hf.errors import UserError
from slide_hf.planner import Bandwidths, PlanInputs, make_plan

pytest.importorskip("transformers")

Slide = Callable[..., tuple[int, str, str]]


def _model():
    from slide_core.testing import ToyConfig, ToyModel

    return ToyModel(ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=768, num_layers=6))


def _plan(objective: str, **changes: object):
    rates = Bandwidths(gpu_tflops=100.0, h2d_gbps=20.0, d2h_gbps=20.0)
    return make_plan(
        PlanInputs(_model(), batch_size=4, seq_len=128, bandwidths=rates, objective=objective, **changes)  # type: ignore[arg-type]
    )


def test_a_preference_head_runs_the_lm_head_once_more_per_token():
    """Its log-probabilities without grad: 2 FLOPs per head parameter and token beside SFT's fused 6."""
    sft, dpo, simpo = _plan("sft"), _plan("dpo"), _plan("simpo")
    shape = sft.shape
    extra = 2 * shape.vocab_size * shape.hidden_size * sft.tokens_per_step
    assert dpo.flops_per_step - sft.flops_per_step == pytest.approx(extra)
    assert simpo.flops_per_step == dpo.flops_per_step
    assert dpo.compute_s > sft.compute_s
    assert dpo.to_dict()["inputs"]["objective"] == "dpo"


def test_dpo_prices_its_reference_pass_per_step_of_pairs():
    """A forward of every row, each sliding unit loaded once per micro-batch: the larger of the forward's
    FLOPs and those loads. SimPO and SFT have none."""
    dpo = _plan("dpo")
    assert _plan("sft").reference_step_s is None and _plan("simpo").reference_step_s is None
    shape, inputs = dpo.shape, dpo.inputs
    tokens = inputs.batch_size * inputs.seq_len
    flops = tokens * (
        2 * shape.block_params
        + 2 * shape.vocab_size * shape.hidden_size
        + 4 * shape.num_blocks * inputs.seq_len * shape.num_heads * shape.head_dim
    )
    # Each unit loaded once per group of micro-batches (Note [Evaluation by groups]): beyond the first, as
    # many activations as one block's weights hold (both in the compute dtype), at most 8.
    block = max(shape.named_numels[name] for name in shape.block_names)
    group = min(8, 1 + block // (tokens * shape.hidden_size))
    assert 1 < group < 8
    loads = shape.params * 4 / group / 20e9  # nothing resident without a GPU budget; the fp32 master's 4 B/param
    assert dpo.reference_step_s == pytest.approx(max(flops / 100e12, loads), rel=1e-6)
    assert dpo.to_dict()["reference_step_s"] == dpo.reference_step_s
    twice = _plan("dpo", grad_accum=2)  # a step's worth of pairs is every micro-batch of it
    assert twice.reference_step_s == pytest.approx(2 * dpo.reference_step_s)


def test_an_unknown_objective_is_one_line():
    with pytest.raises(UserError, match=r"--objective must be one of sft, dpo, simpo, got 'ppo'"):
        _plan("ppo")


def test_the_run_plans_with_its_objective():
    """`slide train` and `slide plan` share plan_inputs: the objective reaches the plan from the options."""
    from slide_hf.options import TrainConfig

    cfg = TrainConfig(model="tiny-llama", objective="dpo", seq_len=64, batch_size=2)
    options = setup.RunOptions.from_config(cfg)
    assert options.objective == "dpo"
    inputs = setup.plan_inputs(
        _model(),
        options,
        accelerator=True,
        gpu_memory_bytes=None,
        bandwidths=Bandwidths(),
        optimizer=setup.unbuilt_optimizer(options),
    )
    assert inputs.objective == "dpo" and inputs.preference


@pytest.fixture
def _fused_loss_installed(monkeypatch) -> None:
    monkeypatch.setattr(setup, "fused_loss_available", lambda: True)


@pytest.mark.usefixtures("_fused_loss_installed")
def test_slide_plan_takes_the_objective(slide: Slide):
    base = ("plan", "--model", "tiny-llama", "--batch-size", "2", "--seq-len", "256", "--gpu-memory", "700MiB")
    status, out, err = slide(*base, "--objective", "dpo")
    assert status == 0, err
    assert "reference pass" in out and "once before the first step (--objective dpo" in out
    status, sft_out, err = slide(*base)
    assert status == 0, err
    assert "reference pass" not in sft_out
    status, out, err = slide(*base, "--objective", "dpo", "--json")
    assert status == 0, err
    found = _values(json.loads(out), "reference_step_s")
    assert found and all(isinstance(v, float) and v > 0 for v in found)
    status, out, err = slide(*base, "--objective", "ppo")
    assert status != 0 and "--objective" in err and "Traceback" not in err
    status, out, err = slide(*base, "--objective", "dpo", "--nproc-per-node", "2")  # as `slide train` runs it
    assert status == 0, err
    assert "reference pass" in out and "data parallel" in out.lower()


def test_the_reference_pass_logs_its_plan_beside_its_time(caplog):
    from slide_hf.preference import reference

    head = SimpleNamespace(collecting=False, reference=None)

    def start(device):
        head.reference = torch.zeros(4)
        head.collecting = True

    head.start_reference = start
    batches = [SimpleNamespace(input_ids=torch.zeros(2, 8, dtype=torch.long)) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger=reference.log.name):
        reference.compute_reference(lambda group: None, head, batches, torch.device("cpu"), 0.5)  # type: ignore[arg-type]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("reference pass: 48 tokens"))
    assert line.endswith("; planned 1.5 s")  # three micro-batches are one evaluation: no rate after the first


def test_the_reference_pass_logs_its_rate_after_the_first_evaluation(caplog):
    """The first evaluation warms the kernels up; the rate of the rest is the pass's steady one, what
    bench/preference.py holds against the forward's FLOP bound."""
    from slide_hf.preference import reference

    head = SimpleNamespace(collecting=False, reference=None)

    def start(device):
        head.reference = torch.zeros(4)
        head.collecting = True

    head.start_reference = start
    evaluations = []
    batches = [
        SimpleNamespace(input_ids=torch.zeros(2, 8, dtype=torch.long)) for _ in range(3 * reference.MAX_EVAL_GROUP)
    ]
    with caplog.at_level(logging.INFO, logger=reference.log.name):
        reference.compute_reference(evaluations.append, head, batches, torch.device("cpu"), 0.5)  # type: ignore[arg-type]
    assert len(evaluations) == 3
    rest = 16 * sum(len(group) for group in evaluations[1:])
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("reference pass: 384 tokens"))
    assert f"; after the first evaluation: {rest} tokens in " in line, line


def _values(tree: object, key: str) -> list[object]:
    """Every value of ``key`` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        return [v for k, v in tree.items() if k == key] + [x for v in tree.values() for x in _values(v, key)]
    if isinstance(tree, list):
        return [x for v in tree for x in _values(v, key)]
    return []
