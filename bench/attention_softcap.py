"""Gemma-2 attention with its logit cap: eager vs flex_attention, forward+backward time and peak memory.

One 9B-shaped attention layer (16 query heads, 8 key/value heads, head_dim 256, queries scaled by
256^-0.5, scores capped at 50 * tanh(s / 50)) at 4096 tokens in bf16, run through transformers' own
attention functions with the masks transformers' mask builders make for each implementation, exactly as
the slide-hf adapters call them (slide_hf/adapters/attention.py picks flex_attention for capped layers
on CUDA). Inputs are random normal, scaled so the cap acts. Time is the median of ``--repeats`` timed
forward+backward passes after ``--warmup`` untimed ones (the first compiles flex's kernels, reported
apart); memory is the peak allocated during one pass minus what was allocated before it (q, k, v and the
upstream gradient). The error column compares each output with eager attention in fp32. ``sdpa`` can be
added to ``--impls`` as a speed yardstick: it drops the cap, and its error column shows by how much.

    python bench/attention_softcap.py       # meant to finish within a minute on an H200, mostly compiling flex
    python bench/attention_softcap.py --layer-types full_attention,sliding_attention --window 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads (gemma-2-9b: 16)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--query-scalar", type=int, default=256, help="query_pre_attn_scalar (9b: 256)")
    p.add_argument("--softcap", type=float, default=50.0, help="attn_logit_softcapping (every Gemma 2: 50)")
    p.add_argument("--window", type=int, default=4096, help="sliding_window of the sliding layers")
    p.add_argument("--score-std", type=float, default=40.0, help="std of the scaled scores before the cap")
    p.add_argument("--layer-types", default="full_attention", help="comma-separated: full_attention,sliding_attention")
    p.add_argument("--impls", default="eager,flex_attention", help="comma-separated: eager,flex_attention,sdpa")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of eager/sdpa (no flex backward)")
    return p.parse_args(argv)


class _Heads(nn.Module):
    """What transformers' attention functions read from the attention module that calls them."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.head_dim = head_dim
        self.is_causal = True


def _config(args: argparse.Namespace, implementation: str) -> Any:
    from transformers import Gemma2Config

    config = Gemma2Config(
        num_hidden_layers=2,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        query_pre_attn_scalar=args.query_scalar,
        attn_logit_softcapping=args.softcap,
        sliding_window=args.window,
    )
    config._attn_implementation = implementation
    return config


def _mask(args: argparse.Namespace, implementation: str, layer_type: str, dtype: torch.dtype) -> Any:
    """The mask transformers builds for ``layer_type`` under ``implementation`` (None, a tensor or a
    BlockMask), from the same builders, with the same arguments, as the adapters' ``prepare_inputs``."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    build = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
    probe = torch.empty((args.batch, args.seq, 0), dtype=dtype, device=args.device)
    return build(
        config=_config(args, implementation),
        inputs_embeds=probe,
        attention_mask=None,
        past_key_values=None,
        position_ids=None,
    )


def _attention_fn(implementation: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """q, k, v (B, H, S, D) and the output's upstream gradient (B, S, Hq, D), random normal; q and k
    scaled so the scaled scores have std ``--score-std`` and the cap is far from the identity."""
    generator = torch.Generator(device=device).manual_seed(0)
    b, s, d = args.batch, args.seq, args.head_dim
    scale = (args.score_std * args.query_scalar**0.5 / d**0.5) ** 0.5
    q = torch.randn(b, args.heads, s, d, device=device, generator=generator) * scale
    k = torch.randn(b, args.kv_heads, s, d, device=device, generator=generator) * scale
    v = torch.randn(b, args.kv_heads, s, d, device=device, generator=generator)
    dout = torch.randn(b, s, args.heads, d, device=device, generator=generator)
    return [q, k, v, dout]


class _Clock:
    """Milliseconds of one pass: CUDA events on the GPU, the wall clock on the CPU (smoke runs)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # note: a host sync, outside the timed passes

    def time_ms(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            began = time.perf_counter()
            fn()
            return (time.perf_counter() - began) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # note: a host sync per timed pass
        return start.elapsed_time(end)

    def peak_bytes(self, fn: Callable[[], Any]) -> Any:
        """What ``fn`` allocates at its peak beyond what was allocated before it, and its result."""
        if not self.cuda:
            return None, fn()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, result


def run_case(args: argparse.Namespace, implementation: str, layer_type: str, reference: torch.Tensor) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    q, k, v, dout = (t.to(dtype) for t in _inputs(args, device))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    module = _Heads(args.heads, args.kv_heads, args.head_dim).eval()
    fn = _attention_fn(implementation)
    mask = _mask(args, implementation, layer_type, dtype)
    clock = _Clock(device)
    window = args.window if layer_type == "sliding_attention" else None

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        out, _ = fn(
            module, *leaves, mask, dropout=0.0, scaling=args.query_scalar**-0.5, sliding_window=window,
            softcap=args.softcap,
        )  # fmt: skip
        out.backward(dout)
        return out

    clock.sync()
    began = time.perf_counter()
    out = step()
    clock.sync()
    first_s = time.perf_counter() - began
    for _ in range(args.warmup):
        step()
    times = [clock.time_ms(step) for _ in range(args.repeats)]
    for t in leaves:
        t.grad = None
    del out
    peak, out = clock.peak_bytes(step)
    out = out.detach().float()
    if not out.abs().sum().item():
        raise RuntimeError(f"{implementation}: the attention output is all zeros")
    err = ((out - reference).norm() / reference.norm()).item()
    return {
        "layer_type": layer_type,
        "attention": implementation,
        "fwd_bwd_ms": round(statistics.median(times), 3),
        "first_call_s": round(first_s, 2),
        "peak_mib": None if peak is None else round(peak / MIB, 1),
        "rel_err_vs_eager_fp32": float(f"{err:.3g}"),
    }


def eager_fp32(args: argparse.Namespace, layer_type: str) -> torch.Tensor:
    """The exact reference: transformers' eager Gemma-2 attention on fp32 copies of the same inputs."""
    q, k, v, _ = _inputs(args, torch.device(args.device))
    module = _Heads(args.heads, args.kv_heads, args.head_dim).eval()
    mask = _mask(args, "eager", layer_type, torch.float32)
    with torch.no_grad():
        out, _ = _attention_fn("eager")(
            module, q, k, v, mask, dropout=0.0, scaling=args.query_scalar**-0.5, softcap=args.softcap
        )
    return out.float()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (flex_attention has no CPU backward); --device cpu smoke-runs eager/sdpa")
    rows = []
    for layer_type in args.layer_types.split(","):
        reference = eager_fp32(args, layer_type)
        for implementation in args.impls.split(","):
            rows.append(run_case(args, implementation, layer_type, reference))
            torch.cuda.empty_cache()
        del reference
    shape = (
        f"batch {args.batch}, seq {args.seq}, {args.heads} q / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
        f"softcap {args.softcap}, window {args.window}, {args.dtype}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}"
    )
    print(f"Gemma-2 attention ({shape})\n")
    print("| layer type | attention | fwd+bwd ms | first call s | peak MiB | rel. err vs eager fp32 |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(
            f"| {r['layer_type']} | {r['attention']} | {r['fwd_bwd_ms']:.2f} | {r['first_call_s']:.1f} "
            f"| {peak} | {r['rel_err_vs_eager_fp32']:.2e} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"shape": shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
