"""Benchmark slide-kernels against eager PyTorch (and Liger-Kernel's fused linear CE) on a CUDA GPU.

Times forward+backward (median of ``triton.testing.do_bench``) and the extra peak memory
(``torch.cuda.max_memory_allocated`` during one fwd+bwd, minus what was allocated before it: the
inputs), at Llama-3.1-8B shapes by default. Prints a markdown table and, with ``--json``, writes the
numbers. Needs a CUDA device; ``--help`` works anywhere.

    python bench/kernel_bench.py --tokens 16384 --hidden 4096 --vocab 128256 --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import slide_kernels  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "slide-kernels" / "src"))

from slide_kernels import apply_rotary, geglu, linear_cross_entropy, rms_norm, swiglu
from slide_kernels.ops import linear_cross_entropy as lce_module

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch x seq)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336, help="MLP intermediate size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--ops",
        default="lce,rms_norm,rope,swiglu,geglu",
        help="comma-separated subset of lce,rms_norm,rope,swiglu,geglu",
    )
    p.add_argument(
        "--lce-chunk-mib",
        default="",
        help="comma-separated logits-chunk budgets (MiB) to sweep for our fused CE; default: the built-in one",
    )
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time, ms")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], None], grads: list[torch.Tensor], warmup: int, rep: int) -> float:
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, return_mode="median"))
    except TypeError:  # older triton without return_mode
        times = do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, quantiles=[0.5])
        return float(times if isinstance(times, float) else statistics.median(times))


def extra_peak_gib(fn: Callable[[], None], grads: list[torch.Tensor]) -> float:
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in grads:
        t.grad = None
    return peak / GIB


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(op, impl, fn, leaves, args, check=None) -> dict:
    row = {"op": op, "impl": impl}
    try:
        row["peak_extra_gib"] = round(extra_peak_gib(fn, leaves), 3)
        row["ms"] = round(time_ms(fn, leaves, args.warmup, args.rep), 3)
        if check is not None:
            row["rel_err_vs_eager"] = check()
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    for t in leaves:
        t.grad = None
    torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------
def grads_of(fn, leaves):
    for t in leaves:
        t.grad = None
    fn()
    out = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out


def bench_lce(args, dtype) -> list[dict]:
    n, h, v = args.tokens, args.hidden, args.vocab
    hidden = (torch.randn(n, h, device="cuda", dtype=dtype)).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=dtype) / math.sqrt(h)).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    target[torch.rand(n, device="cuda") < 0.1] = -100
    leaves = [hidden, weight]

    def eager():
        F.cross_entropy((hidden @ weight.T).float(), target).backward()

    def ours():
        linear_cross_entropy(hidden, weight, target).backward()

    rows = []
    ref = None
    try:
        ref = grads_of(eager, leaves)
        rows.append(measure("linear_cross_entropy", "eager torch", eager, leaves, args))
    except torch.OutOfMemoryError:
        rows.append({"op": "linear_cross_entropy", "impl": "eager torch", "error": "out of memory"})
    torch.cuda.empty_cache()

    def check_against_eager(fn):
        if ref is None:
            return None
        return lambda: max(rel_err(a, b) for a, b in zip(grads_of(fn, leaves), ref, strict=True))

    budgets = [float(x) for x in args.lce_chunk_mib.split(",") if x] or [None]
    default_budget = lce_module.CHUNK_LOGITS_BYTES
    for mib in budgets:
        lce_module.CHUNK_LOGITS_BYTES = default_budget if mib is None else int(mib * 2**20)
        chunk = lce_module._chunk_rows(n, v, hidden.element_size())
        label = f"slide_kernels (chunk {chunk} rows)"
        rows.append(measure("linear_cross_entropy", label, ours, leaves, args, check_against_eager(ours)))
    lce_module.CHUNK_LOGITS_BYTES = default_budget

    # Engine hook: the launcher adds grad_W into a gradient buffer that already exists (e.g. the
    # second micro-batch of gradient accumulation), so only grad_h and the chunk buffer are extra.
    grad_w_buffer = torch.zeros_like(weight)

    def ours_into_buffer():
        lce_module.linear_cross_entropy_forward(hidden.detach(), weight.detach(), target, grad_weight_out=grad_w_buffer)

    rows.append(
        measure(
            "linear_cross_entropy", "slide_kernels launcher, grad_W into existing buffer", ours_into_buffer, [], args
        )
    )

    # What the engine's head does: the autograd API writes grad_W into the slot's gradient buffer
    # (Unit.grads_in_forward) and autograd hands that buffer back; only grad_h and the chunk are new.
    def ours_engine_head():
        loss = linear_cross_entropy(hidden, weight, target, grad_weight_out=grad_w_buffer)
        torch.autograd.grad(loss, [hidden, weight])

    rows.append(
        measure(
            "linear_cross_entropy",
            "slide_kernels, grad_W written into the engine's slot",
            ours_engine_head,
            [],
            args,
            check_against_eager(
                lambda: linear_cross_entropy(hidden, weight, target, grad_weight_out=grad_w_buffer).backward()
            ),
        )
    )

    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:
        rows.append(
            {"op": "linear_cross_entropy", "impl": "liger-kernel", "error": f"not installed ({type(exc).__name__})"}
        )
    else:
        liger_loss = LigerFusedLinearCrossEntropyLoss()

        def liger():
            liger_loss(weight, hidden, target).backward()

        rows.append(measure("linear_cross_entropy", "liger-kernel", liger, leaves, args, check_against_eager(liger)))
    return rows


def hf_rms_norm(x, weight, eps=1e-6):
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(input_dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def pair(op, eager_fn, ours_fn, leaves, make_dout, args) -> list[dict]:
    douts = make_dout()

    def run(fn):
        def step():
            outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, douts)

        return step

    ref = grads_of(run(eager_fn), leaves)

    def check():
        return max(rel_err(a, b) for a, b in zip(grads_of(run(ours_fn), leaves), ref, strict=True))

    return [
        measure(op, "eager torch", run(eager_fn), leaves, args),
        measure(op, "slide_kernels", run(ours_fn), leaves, args, check),
    ]


def bench_rms_norm(args, dtype) -> list[dict]:
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(args.hidden, device="cuda", dtype=dtype, requires_grad=True)
    return pair(
        "rms_norm", lambda: hf_rms_norm(x, w), lambda: rms_norm(x, w), [x, w], lambda: (torch.randn_like(x),), args
    )


def bench_rope(args, dtype) -> list[dict]:
    s, d = args.tokens, args.head_dim
    # HF layout: projections are (B, S, H*D), viewed (B, S, H, D) and transposed to (B, H, S, D)
    q = torch.randn(1, s, args.heads, d, device="cuda", dtype=dtype).transpose(1, 2).detach().requires_grad_()
    k = torch.randn(1, s, args.kv_heads, d, device="cuda", dtype=dtype).transpose(1, 2).detach().requires_grad_()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.arange(s, device="cuda").float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return pair(
        "apply_rotary",
        lambda: hf_rope(q, k, cos, sin),
        lambda: apply_rotary(q, k, cos, sin),
        [q, k],
        lambda: (torch.randn(q.shape, device="cuda", dtype=dtype), torch.randn(k.shape, device="cuda", dtype=dtype)),
        args,
    )


def bench_glu(name, ours, eager, args, dtype) -> list[dict]:
    gate = torch.randn(args.tokens, args.intermediate, device="cuda", dtype=dtype, requires_grad=True)
    up = torch.randn(args.tokens, args.intermediate, device="cuda", dtype=dtype, requires_grad=True)
    return pair(
        name, lambda: eager(gate, up), lambda: ours(gate, up), [gate, up], lambda: (torch.randn_like(gate),), args
    )


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def markdown(rows: list[dict]) -> str:
    lines = [
        "| op | implementation | fwd+bwd ms (median) | speedup vs eager | extra peak GiB | max rel err vs eager |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    eager_ms = {r["op"]: r.get("ms") for r in rows if r["impl"] == "eager torch"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['impl']} | {r['error']} | | | |")
            continue
        base = eager_ms.get(r["op"])
        speedup = f"{base / r['ms']:.2f}x" if base and r["impl"] != "eager torch" else ""
        err = r.get("rel_err_vs_eager")
        err_s = f"{err:.1e}" if err is not None else ""
        lines.append(f"| {r['op']} | {r['impl']} | {r['ms']:.3f} | {speedup} | {r['peak_extra_gib']:.3f} | {err_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel_bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ops = {o.strip() for o in args.ops.split(",") if o.strip()}
    rows: list[dict] = []
    if "lce" in ops:
        rows += bench_lce(args, dtype)
    if "rms_norm" in ops:
        rows += bench_rms_norm(args, dtype)
    if "rope" in ops:
        rows += bench_rope(args, dtype)
    if "swiglu" in ops:
        rows += bench_glu("swiglu", swiglu, lambda g, u: F.silu(g) * u, args, dtype)
    if "geglu" in ops:
        rows += bench_glu("geglu", geglu, lambda g, u: F.gelu(g, approximate="tanh") * u, args, dtype)

    import triton

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "shapes": {
            k: getattr(args, k) for k in ("tokens", "hidden", "vocab", "heads", "kv_heads", "head_dim", "intermediate")
        },
    }
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {args.dtype}, {meta['shapes']}")
    print(markdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
