"""The Python side of bench/preference.sh: the pair file, the card's matmul rate, and the table of the DPO run
against an SFT run on the same tokens.

    python bench/preference.py data OUT_DIR --pairs N --seq-len L   # OUT_DIR/pairs.jsonl and OUT_DIR/sft.jsonl
    python bench/preference.py matmul                                # bf16 TFLOP/s of this GPU
    python bench/preference.py summarize OUT_DIR --model M [--matmul-tflops X] [--no-peak-checks]

Why an SFT run beside the DPO one: DPO's steps run the engine SFT runs, with one more LM-head matmul (the
log-probabilities, docs/preference.md), so its policy tokens/s should reach SFT's on the same rows (target
>= 0.9). The SFT file holds each pair's chosen and rejected sequences as two prompt/completion records, in
the pair's order: with both sequences of a pair filling half a row, SFT packs them two a row as DPO keeps a
pair in one, so both runs compute the same tokens per step (the table shows both counts).

The sequences are sized for the bundled byte tokenizer every preset trains with (one token a byte, no
download): a prompt and a completion of about ``(seq_len / 2 - 32) / 2`` bytes each, the 32 left for the chat
template's markers, BOS and EOS, so no sequence is truncated.

DPO's reference pass is forward-only over every row once (slide_hf/preference/reference.py logs its tokens
and time). Its bound: 2 FLOPs per active parameter and token (the embedding, a lookup, is not a matmul
unless tied to the head) plus attention's forward products, 4 x layers x hidden x seq_len per token (a third
of the 12 slide_hf/setup.py counts for forward and backward), at the matmul rate measured in the same call
(target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_SLACK = 1.03
HOST_SLACK = 1.05
POLICY_TARGET = 0.9
REFERENCE_TARGET = 0.9
TEMPLATE_BYTES = 32
"""Bytes of a sequence left for the chat template's role markers, BOS and EOS (the byte tokenizer's ~27)."""

_WORDS = (
    "the",
    "model",
    "reads",
    "a",
    "long",
    "prompt",
    "and",
    "answers",
    "with",
    "care",
    "about",
    "data",
    "rows",
    "tokens",
    "memory",
    "transfer",
    "block",
    "layer",
    "engine",
    "pass",
    "loss",
    "reward",
    "policy",
    "reference",
    "chosen",
    "rejected",
    "step",
    "batch",
    "host",
    "device",
    "stream",
    "weight",
    "update",
)
_REFERENCE_LINE = re.compile(r"reference pass: (\d+) tokens in (\d+) micro-batches in ([\d.]+) s")
_REFERENCE_STEADY = re.compile(r"after the first evaluation: (\d+) tokens in ([\d.]+) s")
_MODEL_LINE = re.compile(r": ([\d.]+)M params, (\d+) blocks")


# -- the data -------------------------------------------------------------------------------------------------
def text_of(length: int, rng: random.Random) -> str:
    """``length`` bytes of ASCII words: a byte tokenizer makes it exactly ``length`` tokens."""
    words: list[str] = []
    size = 0
    while size <= length:  # the joined words are size - 1 bytes
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length]


def pair_records(pairs: int, prompt_bytes: int, completion_bytes: int, seed: int = 0) -> list[dict[str, str]]:
    """``pairs`` deterministic records of prompt, chosen and rejected (the two always differ)."""
    rng = random.Random(seed)
    records = []
    for index in range(pairs):
        prompt = f"{index:06d} " + text_of(prompt_bytes - 7, rng)
        chosen = "yes " + text_of(completion_bytes - 4, rng)
        rejected = "no. " + text_of(completion_bytes - 4, rng)
        records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return records


def sft_records(pairs: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each pair's chosen, then its rejected sequence, as prompt/completion records (the same tokens)."""
    return [{"prompt": pair["prompt"], "completion": pair[which]} for pair in pairs for which in ("chosen", "rejected")]


def sized_for(seq_len: int) -> tuple[int, int]:
    """Prompt and completion bytes so that a pair's two sequences just fill a row of ``seq_len``."""
    budget = seq_len // 2 - TEMPLATE_BYTES
    if budget < 16:
        raise ValueError(f"--seq-len {seq_len} leaves no room for a pair (at least {2 * (TEMPLATE_BYTES + 16)})")
    return budget // 2, budget - budget // 2


def write_data(out: Path, pairs: int, seq_len: int, seed: int = 0) -> tuple[Path, Path]:
    """OUT/pairs.jsonl (DPO) and OUT/sft.jsonl (the same sequences for SFT)."""
    prompt_bytes, completion_bytes = sized_for(seq_len)
    records = pair_records(pairs, prompt_bytes, completion_bytes, seed)
    out.mkdir(parents=True, exist_ok=True)
    pair_path, sft_path = out / "pairs.jsonl", out / "sft.jsonl"
    pair_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sft_path.write_text("".join(json.dumps(r) + "\n" for r in sft_records(records)))
    return pair_path, sft_path


# -- reading the runs -----------------------------------------------------------------------------------------
@dataclass
class TrainRun:
    """One `slide train` run's facts, from its metrics.jsonl and train.log."""

    name: str
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)
    tokens_per_s: float | None = None  # the steps after the first (it compiles and warms caches)
    gpu_peak_gib: float | None = None
    gpu_plan_gib: float | None = None
    host_peak_gib: float | None = None
    host_plan_gib: float | None = None
    params: float | None = None
    reference_tokens: int | None = None
    reference_s: float | None = None
    # After the pass's first evaluation, which warms the kernels up (as the steps' rate leaves the first out)
    reference_steady_tokens: int | None = None
    reference_steady_s: float | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failures

    @property
    def reference_tokens_per_s(self) -> float | None:
        if not self.reference_tokens or not self.reference_s:
            return None
        return self.reference_tokens / self.reference_s

    @property
    def reference_steady_tokens_per_s(self) -> float | None:
        if not self.reference_steady_tokens or not self.reference_steady_s:
            return None
        return self.reference_steady_tokens / self.reference_steady_s


def steady_tokens_per_s(steps: list[dict[str, Any]]) -> float | None:
    """Real tokens over wall time of the steps after the first (all of them when there is only one)."""
    timed = steps[1:] or steps
    seconds = sum(float(s.get("step_time_s") or 0.0) for s in timed)
    return sum(int(s["tokens"]) for s in timed) / seconds if seconds > 0 else None


def planned_peaks(log_text: str) -> tuple[float, float] | None:
    """(GPU, host) GiB of the run's ``plan:`` line (GPU 0 on the CPU device, whose plan has none)."""
    for line in log_text.splitlines():
        if "plan: GPU peak" in line:
            words = line.split("plan: GPU peak", 1)[1].replace(",", " ").split()
            return float(words[0]), float(words[words.index("host") + 2])
        if "plan: host peak" in line:
            return 0.0, float(line.split("plan: host peak", 1)[1].split()[0])
    return None


def reference_pass(log_text: str) -> tuple[int, float] | None:
    """(tokens, seconds) of the reference pass's log line (slide_hf/preference/reference.py)."""
    found = _REFERENCE_LINE.search(log_text)
    return (int(found.group(1)), float(found.group(3))) if found else None


def reference_pass_steady(log_text: str) -> tuple[int, float] | None:
    """(tokens, seconds) of the reference pass after its first evaluation, where its log line has them."""
    line = _REFERENCE_LINE.search(log_text)
    found = _REFERENCE_STEADY.search(log_text, line.start()) if line else None
    return (int(found.group(1)), float(found.group(2))) if found else None


def read_train(run_dir: Path, name: str, *, peaks: bool = True) -> TrainRun:
    """The run in ``run_dir`` checked: finite losses and (with ``peaks``) its peaks within its plan's."""
    run = TrainRun(name)
    metrics, log_path = run_dir / "metrics.jsonl", run_dir / "train.log"
    if not metrics.exists():
        console = run_dir.with_suffix(".log")
        lines = [x for x in console.read_text(errors="replace").splitlines() if x.strip()] if console.exists() else []
        run.error = lines[-1][:200] if lines else "no result"
        return run
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "step" in r]
    run.losses = [r["loss"] for r in steps]
    run.tokens_per_step = [int(r["tokens"]) for r in steps]
    run.tokens_per_s = steady_tokens_per_s(steps)
    run.gpu_peak_gib = max((r.get("gpu_mem_peak_gb", 0.0) for r in steps), default=0.0) * 1e9 / 2**30
    run.host_peak_gib = max((r.get("host_rss_gb", 0.0) for r in steps), default=0.0) * 1e9 / 2**30
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    plan = planned_peaks(text)
    if plan is not None:
        run.gpu_plan_gib, run.host_plan_gib = plan
    model = _MODEL_LINE.search(text)
    run.params = float(model.group(1)) * 1e6 if model else None
    reference = reference_pass(text)
    if reference is not None:
        run.reference_tokens, run.reference_s = reference
    steady = reference_pass_steady(text)
    if steady is not None:
        run.reference_steady_tokens, run.reference_steady_s = steady
    check(run, peaks=peaks)
    return run


def check(run: TrainRun, *, peaks: bool = True) -> None:
    if not run.losses or not all(isinstance(x, int | float) and math.isfinite(x) for x in run.losses):
        run.failures.append(f"losses not finite: {run.losses}")
    if not peaks:
        return
    if run.host_plan_gib is None:
        run.failures.append("train.log has no 'plan:' line")
        return
    for what, measured, planned, slack in (
        ("GPU", run.gpu_peak_gib, run.gpu_plan_gib, GPU_SLACK),
        ("host", run.host_peak_gib, run.host_plan_gib, HOST_SLACK),
    ):
        if measured and planned and measured > planned * slack:
            run.failures.append(
                f"{what} peak {measured:.2f} GiB > plan {planned:.2f} GiB + {round((slack - 1) * 100)} %"
            )


# -- the bound ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the forward's FLOPs depend on, from the model's config."""

    layers: int
    hidden: int
    vocab: int
    tied: bool


def forward_flops_per_token(params: float, shape: Shape, seq_len: int) -> float:
    """Forward-only FLOPs per token: 2 per active parameter (an untied embedding, a lookup, excluded) and
    attention's score and value products, 4 x layers x hidden x seq_len."""
    active = params if shape.tied else params - shape.vocab * shape.hidden
    return 2.0 * active + 4.0 * shape.layers * shape.hidden * seq_len


def model_shape(model: str) -> Shape | None:
    """The model's shape from its config (no weights read), as `slide train` resolves it."""
    try:
        from slide_hf import resolve_model
        from slide_hf.presets import run_overrides

        config, _ = resolve_model(model, **run_overrides(model))
    except Exception:  # a model this tree cannot resolve: no bound, the rows still print
        return None
    text = getattr(config, "get_text_config", lambda: config)()
    return Shape(
        int(text.num_hidden_layers),
        int(text.hidden_size),
        int(text.vocab_size),
        bool(getattr(config, "tie_word_embeddings", False)),
    )


@dataclass(frozen=True)
class Report:
    dpo: TrainRun
    sft: TrainRun
    matmul_tflops: float | None
    reference_bound_tokens_per_s: float | None

    @property
    def policy_ratio(self) -> float | None:
        if not self.dpo.tokens_per_s or not self.sft.tokens_per_s:
            return None
        return self.dpo.tokens_per_s / self.sft.tokens_per_s

    @property
    def reference_share(self) -> float | None:
        rate = self.dpo.reference_steady_tokens_per_s or self.dpo.reference_tokens_per_s
        return rate / self.reference_bound_tokens_per_s if rate and self.reference_bound_tokens_per_s else None

    @property
    def failures(self) -> list[str]:
        problems = []
        for run in (self.dpo, self.sft):
            problems += [f"{run.name}: {p}" for p in ([run.error] if run.error else []) + run.failures]
        if self.dpo.ok and self.dpo.reference_tokens is None:
            problems.append("dpo: train.log has no reference pass line")
        return problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "dpo": {
                **self.dpo.__dict__,
                "reference_tokens_per_s": self.dpo.reference_tokens_per_s,
                "reference_steady_tokens_per_s": self.dpo.reference_steady_tokens_per_s,
            },
            "sft": self.sft.__dict__,
            "matmul_tflops": self.matmul_tflops,
            "policy_ratio": self.policy_ratio,
            "policy_target": POLICY_TARGET,
            "reference_bound_tokens_per_s": self.reference_bound_tokens_per_s,
            "reference_share": self.reference_share,
            "reference_target": REFERENCE_TARGET,
            "failures": self.failures,
        }


def build_report(out: Path, model: str, seq_len: int, matmul_tflops: float | None, *, peaks: bool = True) -> Report:
    dpo = read_train(out / "dpo", "dpo", peaks=peaks)
    sft = read_train(out / "sft", "sft", peaks=peaks)
    bound = None
    shape = model_shape(model) if matmul_tflops and dpo.params else None
    if matmul_tflops and shape and dpo.params:
        bound = matmul_tflops * 1e12 / forward_flops_per_token(dpo.params, shape, seq_len)
    return Report(dpo, sft, matmul_tflops, bound)


def markdown(report: Report, model: str) -> str:
    dpo, sft = report.dpo, report.sft
    rate = f"{report.matmul_tflops:.0f} TFLOP/s bf16 matmul" if report.matmul_tflops else "no matmul rate (CPU)"
    ratio, share = report.policy_ratio, report.reference_share
    lines = [
        f"DPO against SFT on the same tokens, {model} ({rate})",
        "",
        "| run | result | losses | tokens/step | tok/s (steps after the first) | GPU peak / plan GiB "
        "| host peak / plan GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in (dpo, sft):
        result = "ok" if run.ok else "FAIL: " + (run.error or "; ".join(run.failures))
        losses = ", ".join(f"{x:.4g}" for x in run.losses)
        tokens = ", ".join(f"{t:,}" for t in sorted(set(run.tokens_per_step)))
        lines.append(
            f"| {run.name} | {result} | {losses} | {tokens} | {_num(run.tokens_per_s)} | "
            f"{_pair(run.gpu_peak_gib, run.gpu_plan_gib)} | {_pair(run.host_peak_gib, run.host_plan_gib)} |"
        )
    lines += [
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| DPO policy tok/s / SFT tok/s | {_share(ratio)} | >= {POLICY_TARGET:.0%} |",
        f"| reference pass | {_num(dpo.reference_tokens)} tokens in {dpo.reference_s or 0:.2f} s: "
        f"{_num(dpo.reference_tokens_per_s)} tok/s | |",
        f"| reference pass after its first evaluation (kernels warm) | {_num(dpo.reference_steady_tokens)} tokens "
        f"in {dpo.reference_steady_s or 0:.2f} s: {_num(dpo.reference_steady_tokens_per_s)} tok/s | |",
        f"| reference pass / forward FLOP bound ({_num(report.reference_bound_tokens_per_s)} tok/s) "
        f"| {_share(share)} | >= {REFERENCE_TARGET:.0%} |",
    ]
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return f"{value:,.0f}" if value else "-"


def _share(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def _pair(measured: float | None, planned: float | None) -> str:
    return f"{measured:.2f} / {planned:.2f}" if measured is not None and planned is not None else ""


def summarize(
    out: Path, model: str, seq_len: int, matmul_tflops: float | None, *, peaks: bool = True
) -> tuple[str, Report]:
    report = build_report(out, model, seq_len, matmul_tflops, peaks=peaks)
    text = markdown(report, model)
    (out / "preference.json").write_text(json.dumps({"model": model, "seq_len": seq_len, **report.as_dict()}, indent=1))
    (out / "preference.md").write_text(text)
    return text, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="write OUT_DIR/pairs.jsonl and OUT_DIR/sft.jsonl")
    data.add_argument("out", type=Path)
    data.add_argument("--pairs", type=int, required=True)
    data.add_argument("--seq-len", type=int, required=True)
    data.add_argument("--seed", type=int, default=0)
    commands.add_parser("matmul", help="print this GPU's bf16 matmul TFLOP/s")
    table = commands.add_parser("summarize", help="the runs in OUT_DIR/dpo and OUT_DIR/sft as a markdown table")
    table.add_argument("out", type=Path)
    table.add_argument("--model", required=True)
    table.add_argument("--seq-len", type=int, required=True)
    table.add_argument("--matmul-tflops", type=float, default=None)
    table.add_argument("--no-peak-checks", action="store_true", help="the CPU dry run: report peaks, check none")
    args = parser.parse_args(argv)
    if args.command == "data":
        for path in write_data(args.out, args.pairs, args.seq_len, args.seed):
            print(path)
        return 0
    if args.command == "matmul":
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_matrix import measure_matmul_tflops

        print(f"{measure_matmul_tflops():.1f}")
        return 0
    text, report = summarize(args.out, args.model, args.seq_len, args.matmul_tflops, peaks=not args.no_peak_checks)
    print(text)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
