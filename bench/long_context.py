"""The Python side of bench/long_context.sh: the card's matmul rate, and the table of the long-sequence runs.

    python bench/long_context.py matmul                                  # bf16 TFLOP/s of this GPU
    python bench/long_context.py attention --model M --seq-len N         # one layer's attention, s (JSON)
    python bench/long_context.py summarize OUT_DIR [--matmul-tflops X]   # OUT_DIR's runs as a markdown table

Each run is `slide bench --json OUT_DIR/run-<model>-<seq_len>.json` at batch 1; each plan, `slide plan --json`
into OUT_DIR/plan-<model>.json (the longest --seq-len the GPU budget allows, and what limits it). A run is
ok when it exited 0 with finite losses, its GPU peak is within the plan's + 3 % and its host peak within the
plan's + 5 %, as bench/gpu_matrix.py holds its rows. Beside its tokens/s, the step's FLOP bound: the dense
matmuls (6 FLOPs per parameter and token) and attention's score and value products (12 x layers x hidden x
seq_len per token; slide_hf/setup.py's ``flops_per_token``, the FLOPs `slide bench` reports its TFLOP/s on),
at the matmul rate measured in the same call. The engine's recompute forward is work the bound does not
credit, so a tiled run that is compute-bound reaches about 3/4 of it.

Beside it, the step's own bound: the work the step runs, each kind at the rate measured for it in the same
call. Its dense matmuls are 8 FLOPs per block parameter and token (forward, the backward's recompute forward,
and the backward's two products) and 6 per LM-head parameter (the fused loss computes the head once each
way), at the matmul rate; its attention is each layer's attention forward twice (forward and recompute) and
its backward once, timed at this sequence length on this card (``attention``: SDPA, causal, batch 1, the
model's heads). What a run reaches of that bound is what the engine loses to transfers, waits and the
work around the matmuls; the first bound says what a whole step's FLOPs would reach with no recompute.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GPU_SLACK = 1.03
HOST_SLACK = 1.05


@dataclass
class Run:
    """One run's facts, read from its `slide bench` JSON (or its absence: ``error``)."""

    model: str
    seq_len: int
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    gpu_peak_gib: float | None = None
    gpu_plan_gib: float | None = None
    host_peak_gib: float | None = None
    host_plan_gib: float | None = None
    flops_per_token: float | None = None
    dense_flops_per_token: float | None = None  # what the step's matmuls run, recompute included
    layers: int | None = None
    attention_s: tuple[float, float] | None = None  # one layer's attention forward and backward, measured
    seq_tile: int | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failures

    def bound_tokens_per_s(self, matmul_tflops: float | None) -> float | None:
        """Tokens/s if every FLOP of the step ran at ``matmul_tflops``."""
        if not matmul_tflops or not self.flops_per_token:
            return None
        return matmul_tflops * 1e12 / self.flops_per_token

    def step_bound_tokens_per_s(self, matmul_tflops: float | None) -> float | None:
        """Tokens/s if the step's dense matmuls (recompute included) ran at ``matmul_tflops`` and each layer's
        attention (forward twice, backward once) took the time measured for it, and nothing else took time."""
        if not matmul_tflops or not self.dense_flops_per_token or not self.attention_s or not self.layers:
            return None
        forward_s, backward_s = self.attention_s
        seconds = self.seq_len * self.dense_flops_per_token / (matmul_tflops * 1e12)
        seconds += self.layers * (2 * forward_s + backward_s)
        return self.seq_len / seconds


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Dense matmuls and attention, forward and backward, per token (slide_hf/setup.py's formula)."""
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def dense_flops_per_token(params: int, hidden: int, vocab: int, tied: bool) -> float:
    """The step's matmul FLOPs per token as the engine runs them: 8 per block parameter (forward, recompute
    forward, backward's two products), 6 per LM-head parameter (its fused loss runs once each way), none for
    the embedding's lookup. ``params`` counts the embedding once, and the head too when it is not tied."""
    head = vocab * hidden
    blocks = params - head - (0 if tied else head)
    return 8.0 * blocks + 6.0 * head


def read_attention(path: Path) -> tuple[float, float] | None:
    """(forward s, backward s) of one layer's attention from ``attention``'s JSON, where it was measured."""
    if not path.exists() or not path.read_text().strip():
        return None
    timed = json.loads(path.read_text())
    return float(timed["forward_s"]), float(timed["backward_s"])


def read_run(path: Path, model: str, seq_len: int, hidden: int | None, *, peaks: bool = True) -> Run:
    """The run of ``model`` at ``seq_len`` from ``path`` (its `slide bench` JSON), checked (its peaks against
    the plan's unless ``peaks`` is False: the CPU dry run, whose tiny models' host peak is the process's)."""
    run = Run(model, seq_len)
    if not path.exists():
        log = path.with_suffix(".log")
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
        run.error = last[-1][:200] if last else "no result"
        return run
    result = json.loads(path.read_text())
    slide = result["slide"]
    run.losses = list(slide["losses"])
    run.tokens_per_s = slide.get("tokens_per_s")
    run.gpu_peak_gib, run.gpu_plan_gib = slide.get("gpu_peak_gib"), slide.get("planned_gpu_peak_gib")
    run.host_peak_gib, run.host_plan_gib = slide.get("host_peak_rss_gib"), slide.get("planned_host_peak_gib")
    run.seq_tile = slide.get("seq_tile")
    layers = int(result.get("layers", {}).get("run") or 0)
    if hidden and layers:
        run.flops_per_token = flops_per_token(int(slide["params"]), layers, hidden, seq_len)
    shape = _shape(model)
    if shape is not None:
        run.dense_flops_per_token = dense_flops_per_token(int(slide["params"]), shape.hidden, shape.vocab, shape.tied)
    run.layers = layers or None
    run.attention_s = read_attention(path.with_name(f"attention-{model}-{seq_len}.json"))
    check(run, peaks=peaks)
    return run


def check(run: Run, *, peaks: bool = True) -> None:
    """Fail ``run`` on a non-finite (or absent) loss and, with ``peaks``, on a peak past the plan's slack."""
    if not run.losses or not all(isinstance(x, int | float) and math.isfinite(x) for x in run.losses):
        run.failures.append(f"losses not finite: {run.losses}")
    if not peaks:
        return
    for what, measured, planned, slack in (
        ("GPU", run.gpu_peak_gib, run.gpu_plan_gib, GPU_SLACK),
        ("host", run.host_peak_gib, run.host_plan_gib, HOST_SLACK),
    ):
        if measured and planned and measured > planned * slack:
            run.failures.append(
                f"{what} peak {measured:.2f} GiB > plan {planned:.2f} GiB + {round((slack - 1) * 100)} %"
            )


@dataclass(frozen=True)
class Longest:
    """What `slide plan` says of one model under the larger GPU budget."""

    model: str
    longest_seq_len: int | None
    limit: str
    seq_tile: int | None
    fits: bool | None
    problem: str | None


def read_plan(path: Path, model: str) -> Longest:
    """``path``: `slide plan --json` at the longest length asked; beside it ``*-longest.json``, the plan at the
    longest length it found (its tile, and whether the host's RAM holds it too)."""
    if not path.exists() or not path.read_text().strip():
        return Longest(model, None, "no plan", None, None, "no plan")
    plan = json.loads(path.read_text())
    at_longest = path.with_name(f"{path.stem}-longest.json")
    if at_longest.exists() and at_longest.read_text().strip():
        plan_longest = json.loads(at_longest.read_text())
        tile, fits, problem = plan_longest.get("seq_tile"), plan_longest.get("fits"), plan_longest.get("problem")
    else:
        tile, fits, problem = plan.get("seq_tile"), None, None
    return Longest(model, plan.get("longest_seq_len"), plan.get("longest_seq_len_limit") or "", tile, fits, problem)


def markdown(runs: list[Run], longest: list[Longest], matmul_tflops: float | None) -> str:
    rate = f"{matmul_tflops:.0f} TFLOP/s bf16 matmul" if matmul_tflops else "no matmul rate (the CPU)"
    lines = [
        f"Long sequences at batch 1 ({rate}; FLOP bound: 6 x params + 12 x layers x hidden x seq_len per token)",
        "",
        "| model | seq-len | tile | result | tok/s | FLOP bound tok/s | of bound | step's own bound tok/s | of it "
        "| GPU peak / plan GiB | host peak / plan GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        result = "ok" if run.ok else "FAIL: " + (run.error or "; ".join(run.failures))
        bound = run.bound_tokens_per_s(matmul_tflops)
        share = f"{run.tokens_per_s / bound:.0%}" if bound and run.tokens_per_s else ""
        own = run.step_bound_tokens_per_s(matmul_tflops)
        own_share = f"{run.tokens_per_s / own:.0%}" if own and run.tokens_per_s else ""
        lines.append(
            f"| {run.model} | {run.seq_len:,} | {run.seq_tile or 'untiled'} | {result} | {_num(run.tokens_per_s)} "
            f"| {_num(bound)} | {share} | {_num(own)} | {own_share} "
            f"| {_pair(run.gpu_peak_gib, run.gpu_plan_gib)} | {_pair(run.host_peak_gib, run.host_plan_gib)} |"
        )
    lines += [
        "",
        "| model | longest seq-len (slide plan) | limited by | tile | fits this host |",
        "|---|---|---|---|---|",
    ]
    for entry in longest:
        fits = "yes" if entry.fits else ("no: " + (entry.problem or "")[:160] if entry.fits is False else "")
        length = f"{entry.longest_seq_len:,}" if entry.longest_seq_len else "-"
        lines.append(f"| {entry.model} | {length} | {entry.limit} | {entry.seq_tile or 'untiled'} | {fits} |")
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return f"{value:,.0f}" if value else ""


def _pair(measured: float | None, planned: float | None) -> str:
    return f"{measured:.2f} / {planned:.2f}" if measured is not None and planned is not None else ""


@dataclass(frozen=True)
class Shape:
    """What the bounds need of a model's config (no weights read)."""

    hidden: int
    vocab: int
    tied: bool
    heads: int
    kv_heads: int
    head_dim: int


def _shape(model: str) -> Shape | None:
    from slide_hf import resolve_model

    try:
        config, _ = resolve_model(model)
    except Exception:  # a model this tree cannot resolve: no bound for it, the run's row still prints
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    if not hidden or not heads:
        return None
    return Shape(
        hidden=hidden,
        vocab=int(config.vocab_size),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
    )


def time_attention(model: str, seq_len: int, *, reps: int = 3) -> dict[str, float]:
    """One layer's attention of ``model`` at batch 1 and ``seq_len`` tokens: SDPA, causal, its keys and values
    widened to the query heads as the HF path does, in bf16 on a GPU (fp32 on the CPU, for the dry run).
    The medians of ``reps`` timed forwards and forward-and-backwards after one untimed of each."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    shape = _shape(model)
    if shape is None:
        raise SystemExit(f"cannot read {model}'s config")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        size = (1, heads, seq_len, shape.head_dim)
        return torch.randn(size, device=device, dtype=dtype, generator=generator).requires_grad_(True)

    q = tensor(shape.heads)
    k, v = (tensor(shape.kv_heads) for _ in range(2))
    group = shape.heads // shape.kv_heads

    def forward() -> torch.Tensor:
        wide_k, wide_v = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (k, v))
        return F.scaled_dot_product_attention(q, wide_k, wide_v, is_causal=True)

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    out_grad = torch.randn((1, shape.heads, seq_len, shape.head_dim), device=device, dtype=dtype, generator=generator)
    with torch.no_grad():
        forward_s = timed(forward)
    both_s = timed(lambda: torch.autograd.grad(forward(), (q, k, v), out_grad))
    return {"forward_s": forward_s, "backward_s": max(both_s - forward_s, 0.0)}


def summarize(
    out: Path, models: list[str], seq_lens: list[int], matmul_tflops: float | None, *, peaks: bool = True
) -> str:
    runs, longest = [], []
    for model in models:
        shape = _shape(model)
        hidden = shape.hidden if shape is not None else None  # for the attention FLOPs
        for seq_len in seq_lens:
            runs.append(read_run(out / f"run-{model}-{seq_len}.json", model, seq_len, hidden, peaks=peaks))
        longest.append(read_plan(out / f"plan-{model}.json", model))
    text = markdown(runs, longest, matmul_tflops)
    summary = {
        "matmul_tflops": matmul_tflops,
        "runs": [
            {
                **run.__dict__,
                "ok": run.ok,
                "bound_tokens_per_s": run.bound_tokens_per_s(matmul_tflops),
                "step_bound_tokens_per_s": run.step_bound_tokens_per_s(matmul_tflops),
            }
            for run in runs
        ],
        "longest": [entry.__dict__ for entry in longest],
    }
    (out / "long_context.json").write_text(json.dumps(summary, indent=1))
    (out / "long_context.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("matmul", help="print this GPU's bf16 matmul TFLOP/s")
    attention = commands.add_parser("attention", help="time one layer's attention at a length (JSON)")
    attention.add_argument("--model", required=True)
    attention.add_argument("--seq-len", type=int, required=True)
    table = commands.add_parser("summarize", help="the runs in OUT_DIR as a markdown table")
    table.add_argument("out", type=Path)
    table.add_argument("--models", required=True, help="comma-separated, as the runs were named")
    table.add_argument("--seq-lens", required=True, help="comma-separated")
    table.add_argument("--matmul-tflops", type=float, default=None)
    table.add_argument("--no-peak-checks", action="store_true", help="the CPU dry run: report peaks, check none")
    args = parser.parse_args(argv)
    if args.command == "matmul":
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_matrix import measure_matmul_tflops

        print(f"{measure_matmul_tflops():.1f}")
        return 0
    if args.command == "attention":
        print(json.dumps(time_attention(args.model, args.seq_len)))
        return 0
    models = [m for m in args.models.split(",") if m]
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    text = summarize(args.out, models, seq_lens, args.matmul_tflops, peaks=not args.no_peak_checks)
    print(text)
    return 0 if "FAIL" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
