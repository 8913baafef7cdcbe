"""Does a compact Adam state train like fp32? Train curves of ``--optimizer-state fp32``, ``bf16`` and ``int8``.

The same model, from the same initialisation, on the same batches, is trained once per state format
through the engine (``slide_core.engine.Engine`` with slide_hf's model, init and device plugins, every
unit host-updated so the host kernels under test do every update). The data is real text that every
machine has offline: the Python standard library's own ``.py`` files (``sysconfig``'s ``stdlib``),
tokenised as raw bytes by a byte-level tokenizer built here (ids 0-255 are the bytes, 256 ends a file;
no Hub access needed). Every 50th file is held out; its text is cut into fixed windows for the eval loss,
measured every ``--eval-every`` steps.

Sizes: ``0.5b`` is Qwen2.5-0.5B's block shape (hidden 896, 14 heads, 2 KV heads, MLP 4864, tied
embeddings) with 34 layers instead of 24, since a byte vocabulary drops the 136M-parameter embedding
matrix: ~0.51B parameters. ``tiny`` (hidden 64, 2 layers) is a CPU smoke test.

Writes to ``--out``: ``<format>.json`` per run as it finishes (train and eval curves, s/step, and the
settings it ran with), then ``curves.json`` (all runs), ``summary.md`` (final eval losses and their
differences to fp32) and ``curves.png`` (train and eval losses per format: matplotlib when installed, else
a plain raster drawn here with the colours listed in ``summary.md``). A format whose ``<format>.json`` in
``--out`` ran with the same settings is not trained again, and the reports cover every format found there:
the runs can be split over several invocations (``--formats fp32``, then ``--formats bf16``, ...), each
ending with the reports of all runs so far. ``--fresh`` trains every named format again.

    python bench/state_fidelity.py --size 0.5b --steps 500 --out fidelity/        # on a GPU; s/step per format in summary.md
    python bench/state_fidelity.py --size tiny --steps 5 --out /tmp/fidelity      # CPU smoke test
    python bench/state_fidelity.py --size 0.5b --formats int8 --out fidelity/      # adds int8 to the runs there
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import struct
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any

import torch

try:
    import slide_core  # noqa: F401
except ImportError:  # running from a checkout without the packages installed
    root = Path(__file__).resolve().parents[1] / "packages"
    sys.path[:0] = [str(root / "slide-core" / "src"), str(root / "slide-hf" / "src")]

FORMATS = ("fp32", "bf16", "int8")
EOS = 256
VOCAB = 257
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    ),
    "0.5b": dict(
        hidden_size=896, num_hidden_layers=34, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
    ),
}
COLOURS = {"fp32": (31, 119, 180), "bf16": (255, 127, 14), "int8": (44, 160, 44)}


# -- data --------------------------------------------------------------------------------------------------
def stdlib_tokens(eval_every_nth_file: int = 50) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train tokens, held-out tokens, file count): the stdlib's .py files, sorted by path, as bytes with
    an end-of-file token between files; every ``eval_every_nth_file``-th file is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no .py files under {root}")
    texts: dict[bool, bytearray] = {False: bytearray(), True: bytearray()}
    ends: dict[bool, list[int]] = {False: [], True: []}
    for index, path in enumerate(files):
        held = index % eval_every_nth_file == 0
        texts[held] += path.read_bytes()
        texts[held].append(0)  # where the end-of-file token goes (a byte array holds 0-255 only)
        ends[held].append(len(texts[held]) - 1)

    def tokens(held: bool) -> torch.Tensor:
        ids = torch.frombuffer(texts[held], dtype=torch.uint8).to(torch.int64)
        ids[torch.tensor(ends[held], dtype=torch.int64)] = EOS
        return ids

    return tokens(False), tokens(True), len(files)


def train_batches(tokens: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """Random windows, the same for every format: one (batch, seq) int64 tensor per step."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq, (steps, batch), generator=gen)
    return [torch.stack([tokens[s : s + seq] for s in row.tolist()]) for row in starts]


def eval_batches(tokens: torch.Tensor, count: int, batch: int, seq: int) -> list[torch.Tensor]:
    """Consecutive windows from the start of the held-out text (fewer if it is short)."""
    windows = min(count * batch, tokens.numel() // seq)
    if windows < 1:
        raise SystemExit("the held-out text is shorter than one --seq-len window")
    rows = tokens[: windows * seq].view(windows, seq)
    return [rows[i : i + batch] for i in range(0, windows, batch)]


# -- one run -----------------------------------------------------------------------------------------------
def run_format(state_format: str, args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    from slide_core import AdamWConfig, HostParameters, LRSchedule
    from slide_core.engine import Engine, EngineConfig
    from slide_core.optim import build_optimizer
    from slide_hf import build_model, init_random
    from slide_hf.setup import make_device

    config = AutoConfig.for_model(
        "qwen2", vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=max(2048, args.seq_len),
        rope_theta=1000000.0, **SIZES[args.size],
    )  # fmt: skip
    model = build_model(config)
    device = make_device(args.device)
    dtype = torch.bfloat16 if device.is_accelerator else torch.float32
    adam = AdamWConfig(weight_decay=args.weight_decay, state_format=state_format, state_seed=args.seed)
    optimizer = build_optimizer(args.optimizer, adam)
    schedule = LRSchedule(args.lr, "cosine", args.warmup_steps, args.steps)
    engine_config = EngineConfig(compute_dtype=dtype, max_grad_norm=args.max_grad_norm)
    train, evals = [], []
    with device:
        host = HostParameters(model)
        init_random(model, host, config, seed=args.seed)  # the same initialisation for every format
        params = sum(unit.layout.param_numel for unit in model.units)
        with Engine(model, device, host, optimizer, engine_config) as engine:
            step_s = []  # each step's wall time; the first (compiles, allocates) is left out of s/step
            for step, ids in enumerate(data["train"]):
                began = time.perf_counter()
                result = engine.step([(ids, ids)], lr=schedule.lr_at(step))
                step_s.append(time.perf_counter() - began)
                train.append([step + 1, result.loss])
                if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                    measured = [engine.evaluate([(ids, ids)]) for ids in data["eval"]]
                    loss = sum(m.loss_sum for m in measured) / sum(m.loss_tokens for m in measured)
                    evals.append([step + 1, loss])
                    print(f"{state_format} step {step + 1}: train {result.loss:.4f}  eval {loss:.4f}", flush=True)
            timed = step_s[1:] or step_s
            state_bytes = sum(t.numel() * t.element_size() for t in engine.host_state.state_slabs.values())
    return {
        "state_format": state_format,
        "optimizer": type(optimizer).__name__,
        "params": params,
        "host_state_bytes": state_bytes,
        "s_per_step": sum(timed) / len(timed),
        "train": train,
        "eval": evals,
    }


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs of one format the same run (every option but where the results go)."""
    return {k: v for k, v in vars(args).items() if k not in ("out", "formats", "fresh")}


def earlier_runs(out: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The runs already in ``out`` that ran with ``settings``, by format; others are ignored (and
    overwritten if trained again)."""
    found = {}
    for fmt in FORMATS:
        path = out / f"{fmt}.json"
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(run, dict) and run.get("settings") == settings and run.get("train"):
            found[fmt] = run
    return found


# -- reports -----------------------------------------------------------------------------------------------
def summary_markdown(runs: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    base = runs.get("fp32")
    lines = [
        f"# State fidelity: {meta['size']} ({meta['params']:,} parameters), {meta['steps']} steps, "
        f"{meta['train_tokens_per_step']:,} tokens/step, stdlib .py bytes",
        "",
        "| state | final eval loss | vs fp32 | vs fp32 (%) | train loss (mean of last 10%) | host state | s/step | colour |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for fmt, run in runs.items():
        final = run["eval"][-1][1]
        tail = run["train"][-max(1, len(run["train"]) // 10) :]
        train_mean = sum(loss for _, loss in tail) / len(tail)
        if base is not None:
            diff = final - base["eval"][-1][1]
            versus = f"{diff:+.4f} | {100 * diff / base['eval'][-1][1]:+.2f}%"
        else:
            versus = "n/a | n/a"
        colour = "#{:02x}{:02x}{:02x}".format(*COLOURS.get(fmt, (0, 0, 0)))
        lines.append(
            f"| {fmt} | {final:.4f} | {versus} | {train_mean:.4f} | {run['host_state_bytes'] / 2**20:.1f} MiB | "
            f"{run['s_per_step']:.3f} | {colour} |"
        )
    return "\n".join(lines) + "\n"


def write_png(path: Path, runs: dict[str, dict[str, Any]]) -> str:
    """Train (left) and eval (right) loss per format; matplotlib when installed, else a plain raster."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_png(path, runs)
        return "raster (matplotlib not installed; colours in summary.md)"
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for fmt, run in runs.items():
        colour = tuple(c / 255 for c in COLOURS.get(fmt, (0, 0, 0)))
        steps, losses = zip(*run["train"], strict=True)
        left.plot(steps, _smooth(list(losses)), label=fmt, color=colour, linewidth=1)
        steps, losses = zip(*run["eval"], strict=True)
        right.plot(steps, losses, label=fmt, color=colour, marker="o", markersize=3)
    left.set(title="train loss (EMA 0.9)", xlabel="step", ylabel="loss")
    right.set(title="held-out loss", xlabel="step")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return "matplotlib"


def _smooth(values: list[float], beta: float = 0.9) -> list[float]:
    out, average = [], None
    for value in values:
        average = value if average is None else beta * average + (1 - beta) * value
        out.append(average)
    return out


def _raster_png(path: Path, runs: dict[str, dict[str, Any]], width: int = 900, height: int = 360) -> None:
    """Two panels of polylines on white, each panel scaled to its curves; written as an RGB PNG."""
    pixels = bytearray(b"\xff" * (width * height * 3))

    def put(x: int, y: int, colour: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            i = 3 * (y * width + x)
            pixels[i : i + 3] = bytes(colour)

    def line(x0: float, y0: float, x1: float, y1: float, colour: tuple[int, int, int]) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0), 1))
        for k in range(n + 1):
            put(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), colour)

    panel_w = width // 2
    for panel, key in enumerate(("train", "eval")):
        curves = {
            fmt: (
                run[key]
                if key == "eval"
                else [[s, v] for (s, _), v in zip(run[key], _smooth([v for _, v in run[key]]), strict=True)]
            )
            for fmt, run in runs.items()
        }
        points = [p for curve in curves.values() for p in curve]
        if not points:
            continue
        x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
        y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
        left, right, top, bottom = panel * panel_w + 30, (panel + 1) * panel_w - 10, 10, height - 30
        for a, b in (
            ((left, top), (right, top)),
            ((right, top), (right, bottom)),
            ((right, bottom), (left, bottom)),
            ((left, bottom), (left, top)),
        ):
            line(*a, *b, (0, 0, 0))

        def to_px(step: float, loss: float, lo=(x_lo, y_lo), hi=(x_hi, y_hi), box=(left, right, top, bottom)):
            sx = (step - lo[0]) / (hi[0] - lo[0]) if hi[0] > lo[0] else 0.5
            sy = (loss - lo[1]) / (hi[1] - lo[1]) if hi[1] > lo[1] else 0.5
            return box[0] + sx * (box[1] - box[0]), box[3] - sy * (box[3] - box[2])

        for fmt, curve in curves.items():
            colour = COLOURS.get(fmt, (0, 0, 0))
            for (s0, l0), (s1, l1) in itertools.pairwise(curve):
                line(*to_px(s0, l0), *to_px(s1, l1), colour)
    rows = b"".join(b"\x00" + bytes(pixels[y * width * 3 : (y + 1) * width * 3]) for y in range(height))

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )


# -- main --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=tuple(SIZES), default="0.5b")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated (default fp32,bf16,int8)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4, help="held-out micro-batches per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="a slide device plugin (default auto: cuda when visible)")
    p.add_argument("--optimizer", default="auto", help="auto (numba kernels when numba runs), fused-adamw, torch-adamw")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--fresh", action="store_true", help="train the named formats even where --out has their runs")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        p.error(f"--formats must name some of {', '.join(FORMATS)}, got {args.formats!r}")
    if args.steps < 1 or args.eval_every < 1 or args.batch_size < 1 or args.seq_len < 2:
        p.error("--steps, --eval-every, --batch-size must be >= 1 and --seq-len >= 2")
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    if args.device in ("auto", "cpu") and not torch.cuda.is_available():
        os.environ.setdefault("SLIDE_KERNELS_BACKEND", "torch")  # the fused loss's CPU path, not the interpreter
    args.out.mkdir(parents=True, exist_ok=True)

    train_tokens, held_out, files = stdlib_tokens()
    data = {
        "train": train_batches(train_tokens, args.steps, args.batch_size, args.seq_len, args.seed),
        "eval": eval_batches(held_out, args.eval_batches, args.batch_size, args.seq_len),
    }
    print(
        f"stdlib: {files} files, {train_tokens.numel():,} train bytes, {held_out.numel():,} held out; "
        f"{len(data['eval'])} eval batches",
        flush=True,
    )
    settings = run_settings(args)
    done = {} if args.fresh else earlier_runs(args.out, settings)
    for fmt in formats:
        if fmt in done:
            print(f"{fmt}: kept the run in {args.out / f'{fmt}.json'} (same settings; --fresh trains it again)")
            continue
        done[fmt] = {**run_format(fmt, args, data), "settings": settings}
        (args.out / f"{fmt}.json").write_text(json.dumps(done[fmt], indent=1))
    runs = {fmt: done[fmt] for fmt in FORMATS if fmt in done}
    first = next(iter(runs.values()))
    meta = {
        "size": args.size,
        "params": first["params"],
        "steps": args.steps,
        "train_tokens_per_step": args.batch_size * args.seq_len,
        "tokenizer": "bytes (0-255) + end of file (256), built in bench/state_fidelity.py",
        "data": f"{files} stdlib .py files of Python {sys.version.split()[0]}; every 50th held out",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    (args.out / "curves.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    summary = summary_markdown(runs, meta)
    meta["png"] = write_png(args.out / "curves.png", runs)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    finite = all(math.isfinite(loss) for run in runs.values() for _, loss in run["eval"])
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
