"""`slide train --objective dpo|simpo` (through ``slide_hf.train``, fp32 on the CPU) against a reference that
shares no code with it: transformers' own model, the DPO, IPO and SimPO losses written here from their
papers (with TRL's conventions: label smoothing as conservative DPO, IPO and SimPO on log-probabilities
averaged over each completion's tokens, SimPO's ``gamma`` subtracted after the beta scaling), the prompt and
completion tokens found here from the real chat template's own renders, rows built here (the chosen then
the rejected sequence of a pair in one row, positions restarting), and ``torch.optim.AdamW``.

Three steps of two accumulated micro-batches of two pairs: each step's loss is the mean over its four pairs,
and it must match to 1e-5. The weights after the three steps are judged, as in test_reference_exactness.py
(Note [Conditioning of the comparison]), against the same reference run in float64: every tensor within
1e-5 of its norm (``WEIGHT_RTOL``), and within ``UPDATE_TOL`` of its own total update or at worst ``NOISE_FACTOR`` times as
far as transformers' own fp32 run is (two fp32 runs differ by rounding alone: an untied head's rows of
tokens no completion uses take Adam steps of rounding-noise gradients, 1e-5 of the head's norm apart).
The metrics are checked against the reference too.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from safetensors.torch import load_file
from test_data_tokenizer import QWEN3, QWEN25, chat_tokenizer
from transformers import AutoModelForCausalLM

import slide_hf
from slide_hf import PRESETS

STEPS, ACCUM, BATCH, SEQ = 3, 2, 2, 512
PAIRS = STEPS * ACCUM * BATCH
LR, WEIGHT_DECAY, BETAS, EPS = 3e-3, 0.1, (0.9, 0.999), 1e-6
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
"""Per tensor, |ours - float64 reference| / |float64 reference|; or, where transformers' own fp32 run is
that far already (the CPU's matmul kernels set the rounding: on one 2-core machine its layer-1 ``o_proj``
lands 1.14e-5 of the norm from float64), at most ``NOISE_FACTOR`` times as far as it is."""
UPDATE_TOL = 1e-4
"""Per tensor, |ours - float64 reference| / |its update|: a wrong gradient is 1e-2 of an update or more."""
NOISE_FACTOR = 4.0

pytestmark = pytest.mark.usefixtures("torch_kernels")


@dataclass(frozen=True)
class Case:
    preset: str
    template: str
    objective: str
    options: dict[str, Any]
    packing: bool = False
    """Packed: pairs fill rows in file order (three or so a row), one row a micro-batch, twice the pairs."""

    @property
    def batch(self) -> int:
        return 1 if self.packing else BATCH

    @property
    def pairs(self) -> int:
        return 2 * PAIRS if self.packing else PAIRS


CASES = {
    "llama-dpo-smoothed": Case("test-llama", QWEN25, "dpo", {"beta": 0.1, "label_smoothing": 0.1}),
    "llama-ipo": Case("test-llama", QWEN25, "dpo", {"beta": 0.5, "dpo_loss": "ipo"}),
    "qwen3-dpo": Case("test-qwen3", QWEN3, "dpo", {"beta": 0.2}),
    "qwen3-simpo": Case("test-qwen3", QWEN3, "simpo", {"beta": 2.0, "gamma": 0.3, "label_smoothing": 0.05}),
    "qwen3-dpo-packed": Case("test-qwen3", QWEN3, "dpo", {"beta": 0.2}, packing=True),
}


# -- the data ----------------------------------------------------------------------------------------------
def _records(count: int = PAIRS) -> list[dict[str, Any]]:
    """Pairs as strings and in TRL's conversational format (a system message, and a prompt with an earlier
    exchange whose assistant turn is context, not trained)."""
    records: list[dict[str, Any]] = []
    for i in range(count):
        question = f"How many legs do {i + 2} cats have together?"
        good, bad = f"They have {4 * (i + 2)} legs.", f"Perhaps {i + 3} legs, or none."
        if i % 3 == 0:
            records.append({"prompt": question, "chosen": good, "rejected": bad})
        elif i % 3 == 1:
            prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
            records.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                }
            )
        else:
            prompt = [
                {"role": "user", "content": "Hello there."},
                {"role": "assistant", "content": "Hello! Ask away."},
                {"role": "user", "content": question},
            ]
            records.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad + " I am not sure."}],
                }
            )
    return records


def _messages(turns: Any, role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": turns}] if isinstance(turns, str) else list(turns)


def _sequence(tokenizer: Any, prompt: Any, completion: Any) -> tuple[list[int], int]:
    """Token ids of prompt + completion through the chat template, and where the completion starts: the
    prompt rendered with the generation prompt is a prefix of the whole conversation's render."""
    prompt_messages = _messages(prompt, "user")
    whole = tokenizer.apply_chat_template(prompt_messages + _messages(completion, "assistant"), tokenize=False)
    head = tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True)
    assert whole.startswith(head)
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    assert ids[: len(head_ids)] == head_ids
    return ids, len(head_ids)


@dataclass
class Rows:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    completion: torch.Tensor
    """(rows, seq): 2 * pair + rejected on each completion token, -1 elsewhere (aligned with the labels)."""


def _rows(tokenizer: Any, records: list[dict[str, Any]], *, packing: bool) -> Rows:
    """One pair a row, or packed: pairs side by side in file order, a new row when the next does not fit."""
    groups: list[list[tuple[list[int], list[int], list[int]]]] = []
    used = SEQ
    for number, record in enumerate(records):
        pair = []
        for side, key in enumerate(("chosen", "rejected")):
            tokens, start = _sequence(tokenizer, record["prompt"], record[key])
            assert len(tokens) <= SEQ // 2
            pair.append(
                (tokens, [-100] * start + tokens[start:], [-1] * start + [2 * number + side] * (len(tokens) - start))
            )
        size = sum(len(tokens) for tokens, _, _ in pair)
        if not packing or used + size > SEQ:
            groups.append([])
            used = 0
        groups[-1] += pair
        used += size
    ids, positions, labels, completion = [], [], [], []
    for group in groups:
        row, pos, lab, comp = [], [], [], []
        for tokens, labelled, owner in group:
            row += tokens
            pos += range(len(tokens))
            lab += labelled
            comp += owner
        fill = SEQ - len(row)
        pos += range(pos[-1] + 1, pos[-1] + 1 + fill)
        row += [tokenizer.pad_token_id] * fill
        lab += [-100] * fill
        comp += [-1] * fill
        ids.append(row)
        positions.append(pos)
        labels.append(lab)
        completion.append(comp)
    return Rows(torch.tensor(ids), torch.tensor(positions), torch.tensor(labels), torch.tensor(completion))


# -- the losses, from the papers -----------------------------------------------------------------------------
def _completion_logps(model: Any, rows: Rows, index: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of each completion in rows ``index`` (chosen, rejected, per pair), and
    each completion's token count; transformers' forward, next-token log-softmax."""
    out = model(rows.input_ids[index], position_ids=rows.position_ids[index], use_cache=False)
    logps = out.logits[:, :-1].float().log_softmax(-1)
    labels = rows.labels[index, 1:]
    owner = rows.completion[index, 1:]
    token_logps = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    numbers = sorted({int(n) for n in owner.unique() if n >= 0})
    sums = torch.stack([token_logps[owner == n].sum() for n in numbers])
    counts = torch.tensor([float((owner == n).sum()) for n in numbers], dtype=sums.dtype)
    return sums[0::2], sums[1::2], torch.stack([counts[0::2], counts[1::2]])


def _loss(case: Case, policy: tuple, reference: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the chosen and rejected rewards."""
    o = case.options
    chosen, rejected, counts = policy
    smoothing = o.get("label_smoothing", 0.0)
    if case.objective == "simpo":  # Meng et al. 2024, eq. 6, with the margin in reward units as TRL's simpo_gamma
        beta = o["beta"]
        avg_c, avg_r = chosen / counts[0], rejected / counts[1]
        z = beta * (avg_c - avg_r) - o["gamma"]
        loss = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
        return loss, beta * avg_c.detach(), beta * avg_r.detach()
    assert reference is not None
    ref_c, ref_r, _ = reference
    beta = o["beta"]
    if o.get("dpo_loss") == "ipo":  # Azar et al. 2023, eq. 17, on length-averaged log-probabilities (TRL)
        pc, pr, rc, rr = chosen / counts[0], rejected / counts[1], ref_c / counts[0], ref_r / counts[1]
        h = (pc - rc) - (pr - rr)
        return (h - 1 / (2 * beta)) ** 2, beta * (pc - rc).detach(), beta * (pr - rr).detach()
    z = beta * ((chosen - ref_c) - (rejected - ref_r))  # Rafailov et al. 2023, eq. 7; Mitchell's smoothing
    loss = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
    return loss, beta * (chosen - ref_c).detach(), beta * (rejected - ref_r).detach()


def _pairs_in(rows: Rows, index: slice) -> int:
    return len({int(n) for n in rows.completion[index].unique() if n >= 0}) // 2


def _reference_run(case: Case, model: Any, frozen: Any, rows: Rows) -> tuple[list[float], list[dict[str, float]]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    losses, metrics = [], []
    for step in range(STEPS):
        total, rewards = 0.0, []
        micros = [slice((step * ACCUM + m) * case.batch, (step * ACCUM + m + 1) * case.batch) for m in range(ACCUM)]
        pairs = sum(_pairs_in(rows, index) for index in micros)  # the step's loss is the mean over its pairs
        for index in micros:
            policy = _completion_logps(model, rows, index)
            reference = None
            if case.objective == "dpo":
                with torch.no_grad():
                    reference = _completion_logps(frozen, rows, index)
            loss, chosen_rewards, rejected_rewards = _loss(case, policy, reference)
            (loss.sum() / pairs).backward()
            total += loss.sum().item()
            values = policy if case.objective == "simpo" or case.options.get("dpo_loss") == "ipo" else None
            logp_c = (policy[0] / policy[2][0]) if values else policy[0]
            logp_r = (policy[1] / policy[2][1]) if values else policy[1]
            rewards.append((chosen_rewards, rejected_rewards, logp_c.detach(), logp_r.detach()))
        losses.append(total / pairs)
        c = torch.cat([r[0] for r in rewards])
        r = torch.cat([r[1] for r in rewards])
        metrics.append(
            {
                "rewards/chosen": c.mean().item(),
                "rewards/rejected": r.mean().item(),
                "rewards/accuracies": (c > r).float().mean().item(),
                "rewards/margins": (c - r).mean().item(),
                "logps/chosen": torch.cat([x[2] for x in rewards]).mean().item(),
                "logps/rejected": torch.cat([x[3] for x in rewards]).mean().item(),
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    return losses, metrics


# -- the test ------------------------------------------------------------------------------------------------
def _setup(case: Case, tmp_path: Path) -> tuple[Any, Any, Path]:
    tokenizer = chat_tokenizer(case.template)
    config = PRESETS[case.preset](vocab_size=len(tokenizer))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    hf.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(str(tmp_path / "model"))
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in _records(case.pairs)))
    return hf, tokenizer, data


def _train(case: Case, tmp_path: Path, data: Path, output: str = "run", **extra: Any) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    slide_hf.train(
        tmp_path / "model", data=data, output=tmp_path / output, device="cpu", dtype="float32",
        seq_len=SEQ, batch_size=case.batch, grad_accum=ACCUM, packing=case.packing, no_shuffle=True,
        lr=LR, lr_schedule="constant", warmup_steps=0, weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, save_dtype="float32",
        objective=case.objective, on_step=records.append, **{"steps": STEPS, **case.options, **extra},
    )  # fmt: skip
    return records


def _exported(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted((run / "model").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_preference_training_matches_an_independent_reference(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    hf, tokenizer, data = _setup(case, tmp_path)
    initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    frozen = copy.deepcopy(hf)
    hf64, frozen64 = copy.deepcopy(hf).double(), copy.deepcopy(hf).double()
    records = _train(case, tmp_path, data)

    rows = _rows(tokenizer, _records(case.pairs), packing=case.packing)
    assert len(rows.input_ids) >= STEPS * ACCUM * case.batch
    assert not case.packing or len(rows.input_ids) <= case.pairs // 2  # rows of several pairs
    expected, metrics = _reference_run(case, hf, frozen, rows)
    _reference_run(case, hf64, frozen64, rows)
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=LOSS_RTOL)
    for ours, theirs in zip(records, metrics, strict=True):
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key

    exported = _exported(tmp_path / "run")
    state, state64 = hf.state_dict(), hf64.state_dict()
    assert set(exported) <= set(state) and len(exported) >= len(state) - hf.config.tie_word_embeddings
    for key, ours in exported.items():
        truth = state64[key].detach()
        error = (ours.double() - truth).norm().item()
        hf_error = (state[key].double() - truth).norm().item()
        norm = truth.norm().item()
        assert error <= max(WEIGHT_RTOL * norm, NOISE_FACTOR * hf_error), (
            f"{key}: {error / norm:.2e} of its norm (fp32 HF: {hf_error / norm:.2e})"
        )
        update = (truth - initial[key]).norm().item()
        bound = max(UPDATE_TOL * update, NOISE_FACTOR * hf_error)
        assert update > 0 and error <= bound, (
            f"{key}: {error / update:.2e} of its update (fp32 HF: {hf_error / update:.2e})"
        )


@pytest.mark.slow
def test_resume_is_bit_exact_and_reuses_the_reference_pass(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DPO run stopped after step 2 and resumed ends with the uninterrupted run's weights, bit for bit,
    and the resumed run reads the saved reference log-probabilities instead of running the pass again
    (Note [Reference pass once per run])."""
    case = CASES["qwen3-dpo"]
    _, _, data = _setup(case, tmp_path)
    whole = _train(case, tmp_path, data, "whole")
    first = _train(case, tmp_path, data, "parts", steps=2, save_every=1)
    saved = sorted((tmp_path / "parts/.data-cache/reference").glob("logps-*.pt"))
    assert len(saved) == 1
    stamp = saved[0].stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level("INFO", logger="slide.train"):
        rest: list[dict[str, Any]] = []
        slide_hf.train(resume=tmp_path / "parts", steps=STEPS, on_step=rest.append)
    assert not any("reference pass:" in line for line in caplog.messages)
    assert any("reference log-probabilities of" in line and "from" in line for line in caplog.messages)
    assert saved[0].stat().st_mtime_ns == stamp
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    ours, theirs = _exported(tmp_path / "parts"), _exported(tmp_path / "whole")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
def test_ref_model_is_the_reference(tmp_path: Path) -> None:
    """``--ref-model`` naming a copy of the starting model trains exactly as the default reference does."""
    case = CASES["llama-dpo-smoothed"]
    _, _, data = _setup(case, tmp_path)
    import shutil

    shutil.copytree(tmp_path / "model", tmp_path / "ref")
    default = _train(case, tmp_path, data, "default")
    named = _train(case, tmp_path, data, "named", ref_model=tmp_path / "ref", steps=2, save_every=1)
    named += _train_more(tmp_path / "named")  # a resume reads the saved pass of --ref-model
    assert [r["loss"] for r in named] == [r["loss"] for r in default]
    assert all(math.isfinite(r["rewards/margins"]) for r in named)


def _train_more(run: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    slide_hf.train(resume=run, steps=STEPS, on_step=records.append)
    return records


@pytest.mark.slow
def test_dpo_after_sft_takes_the_sft_weights_as_its_reference(tmp_path: Path) -> None:
    """The two-stage recipe: SFT, then DPO with ``--init-from`` the SFT run. The reference pass's
    log-probabilities are transformers' own for the SFT run's exported weights."""
    case = CASES["qwen3-dpo"]
    _, tokenizer, data = _setup(case, tmp_path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}]}
            )
            + "\n"
            for r in _records()
            if isinstance(r["prompt"], str)
        )
    )
    slide_hf.train(
        tmp_path / "model", data=chats, output=tmp_path / "sft", device="cpu", dtype="float32", seq_len=SEQ,
        batch_size=1, steps=2, lr=LR, save_dtype="float32", packing=False,
    )  # fmt: skip
    slide_hf.train(
        tmp_path / "model", data=data, output=tmp_path / "dpo", device="cpu", dtype="float32", seq_len=SEQ,
        batch_size=BATCH, grad_accum=ACCUM, steps=1, packing=False, no_shuffle=True, lr=LR,
        objective="dpo", init_from=tmp_path / "sft", init_weights_only=True,
    )  # fmt: skip
    (saved,) = (tmp_path / "dpo/.data-cache/reference").glob("logps-*.pt")
    reference = torch.load(saved)
    sft = AutoModelForCausalLM.from_pretrained(tmp_path / "sft/model", attn_implementation="eager").float().eval()
    rows = _rows(tokenizer, _records(), packing=False)
    with torch.no_grad():
        chosen, rejected, _ = _completion_logps(sft, rows, slice(0, len(rows.input_ids)))
    expected = torch.stack([chosen, rejected], dim=1).reshape(-1)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eager").float().eval()
    with torch.no_grad():
        before = torch.stack(_completion_logps(base, rows, slice(0, len(rows.input_ids)))[:2], dim=1).reshape(-1)
    assert (reference - before).abs().max() > 1e-2  # the SFT steps moved them: the test can tell
