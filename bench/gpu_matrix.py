"""The GPU acceptance run: every user-facing option and model family, run the way a user runs it, one row each.

    python bench/gpu_matrix.py --out DIR                         # on the GPU machine, about 8 minutes
    python bench/gpu_matrix.py --out DIR --rows qwen3.5,gemma3   # only the rows whose name contains these
    python bench/gpu_matrix.py --out DIR --fla-site DIR          # rows "+fla" import flash-linear-attention from DIR
    python bench/gpu_matrix.py --device cpu --quick --out DIR    # the same rows on tiny models, on the CPU

Each row is one `slide bench` or `slide train` process (a fresh process per row, because its host peak is
compared with the plan: a process's RSS does not shrink back between runs). A row is ok when:
- the command exits 0 and every loss is finite;
- the GPU peak is at most the plan's GPU peak + 3 % and the host peak at most the plan's host peak + 5 %;
- clipping rows: the gradient norm exceeded the threshold (the clip fired);
- each kind of streamed block (layer type, module class, parameter shapes) runs its forward and backward
  within 1.3x the time of the same kind resident on the GPU in the same run, and where no twin is resident,
  at no less than 15 % of the card's bf16 matmul rate (measured at the start of the run) on the block's
  active matmul FLOPs (2 per parameter and token forward, 6 backward: recompute + backward; a mixture of
  experts counts the experts a token is routed to, `num_experts_per_tok` of them, and its shared ones). A block that
  computes 15x slow fails its row either way.
Speed is checked on the GPU only; the CPU quick mode runs the same rows and checks on tiny models so this
script cannot rot between GPU runs (tests/hf/test_gpu_matrix.py).

Writes DIR/gpu_matrix.md (the command, date, tree, host and one table row per run; it goes into
docs/benchmarks.md) and DIR/gpu_matrix.json (every row's measurements), and exits 1 if a row failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_SLACK = 1.03
HOST_SLACK = 1.05
TWIN_RATIO = 1.3
MIN_MATMUL_SHARE = 0.15
ROW_TIMEOUT_S = 300


@dataclass(frozen=True)
class Row:
    """One user-facing run. ``model`` is the GPU run's preset, ``quick_model`` the tiny one of the same family."""

    name: str
    command: str  # "bench", "train", or "torchrun" (`slide train` as one process under torchrun)
    model: str
    quick_model: str
    args: tuple[str, ...] = ()
    layers: int | None = None  # bench --layers: the first N decoder layers (the host cannot hold the whole model)
    gpu_memory: str = "24"
    batch: int = 16  # bench rows: the largest micro-batch the plan fits in gpu_memory, up to 16 x 1024
    needs_fla: bool = False
    clip: float | None = None  # a --max-grad-norm this small fires on every step
    nvme: bool = False  # gets --nvme-dir
    needs_gpu: bool = False  # GPU-streamed updates: the CPU device refuses --update-placement gpu
    seq_len: int = 1024  # bench rows' --seq-len on the GPU
    quick_seq_len: int = 32  # ... and in the quick mode
    quick_args: tuple[str, ...] = ()  # added in the quick mode only
    pairs: bool = False  # train rows: --data is a preference pair file written for the row (bench/preference.py)


def rows() -> list[Row]:
    """Options on Llama-3.2-3B's shapes (its first 4 layers, with the full 128K-vocabulary embedding and head, at
    12 GiB), train-only features on tiny-llama, then every family at 24 GiB."""
    llama = dict(model="llama3.2-3b", quick_model="test-llama", layers=4, gpu_memory="12")
    options = [
        Row("state fp32", "bench", **llama),
        Row("state bf16", "bench", args=("--optimizer-state", "bf16"), **llama),
        Row("state int8", "bench", args=("--optimizer-state", "int8"), **llama),
        Row("state fp32, resident 0", "bench", args=("--resident-gib", "0"), **llama),
        Row("state bf16, resident 0", "bench", args=("--optimizer-state", "bf16", "--resident-gib", "0"), **llama),
        Row("state int8, resident 0", "bench", args=("--optimizer-state", "int8", "--resident-gib", "0"), **llama),
        Row("master fp32", "bench", args=("--master", "fp32"), **llama),  # the default is auto: split in bf16
        Row("master split, state bf16", "bench", args=("--master", "split", "--optimizer-state", "bf16"), **llama),
        Row("clipping fires", "bench", clip=1e-3, **llama),
        # Every unit streamed, the 128K-vocabulary embedding and head too: two staging sets of the tied
        # embedding and one fp32 sum of its two contributions (10.3 GiB with fp32 state; 16.6 GiB in all at
        # 16 x 1024) do not fit 12 or 16 GiB, which the plan refuses in one line; 20 GiB fits.
        Row("update gpu", "bench", args=("--update-placement", "gpu"), needs_gpu=True, **{**llama, "gpu_memory": "20"}),
        Row(
            "update gpu, master split, state bf16",
            "bench",
            args=("--update-placement", "gpu", "--master", "split", "--optimizer-state", "bf16"),
            needs_gpu=True,
            **{**llama, "gpu_memory": "20"},
        ),
        Row("update auto", "bench", args=("--update-placement", "auto"), **llama),
        Row(
            "state half on NVMe",
            "bench",
            args=("--offload-optimizer", "nvme", "--nvme-fraction", "0.5"),
            nvme=True,
            **llama,
        ),
    ]
    tiny = dict(model="tiny-llama", quick_model="tiny-llama", gpu_memory="24")
    train = [
        Row("train: activations on NVMe", "train", args=("--offload-activations", "nvme"), nvme=True, **tiny),
        Row("train: packing + evaluation", "train", args=("--eval-fraction", "0.25", "--eval-every", "2"), **tiny),
        Row("train: torchrun, 1 process", "torchrun", **tiny),
        Row("train: update gpu", "train", args=("--update-placement", "gpu"), needs_gpu=True, **tiny),
    ]
    families = [
        Row("qwen3.5 (torch linear attention)", "bench", "qwen3.5-9b", "test-qwen3.5", layers=4),
        Row("qwen3.5 +fla", "bench", "qwen3.5-9b", "test-qwen3.5", layers=4, needs_fla=True),
        Row("qwen3-next (torch linear attention)", "bench", "qwen3-next-80b-a3b", "test-qwen3-next", layers=4, batch=6),
        Row("qwen3-next +fla", "bench", "qwen3-next-80b-a3b", "test-qwen3-next", layers=4, batch=6, needs_fla=True),
        Row("gemma3", "bench", "gemma3-12b", "test-gemma3", layers=8),
        Row("gemma4", "bench", "gemma4-31b", "test-gemma4", layers=4),
        Row("gemma4 per-layer embeddings", "bench", "gemma4-e2b", "test-gemma4-ple", layers=22),
        Row("llama4", "bench", "llama4-scout-text", "test-llama4", layers=2, gpu_memory="72"),
        Row("deepseek-v3 (moonlight)", "bench", "moonlight-16b-a3b", "test-deepseek-v3", layers=3),
        Row("glm4", "bench", "glm4-9b", "test-glm4", layers=4),
        Row("olmo2", "bench", "olmo2-7b", "test-olmo2", layers=4),
        Row("olmo3", "bench", "olmo3-7b", "test-olmo3", layers=4),
        Row("granite", "bench", "granite-3.3-8b", "test-granite", layers=4),
        Row("ministral3", "bench", "ministral3-8b", "test-ministral3", layers=4),
        Row("smollm3", "bench", "smollm3-3b", "test-smollm3", layers=4),
    ]
    # Long sequences: 32K tokens of Llama-3.1-8B's blocks in 24 GiB, the tile chosen by --seq-tile auto; the
    # quick mode tiles 2 x 256 tokens in 64 (the CPU has no GPU budget for auto to choose by).
    long = [
        Row(
            "long context 32K, tiled",
            "bench",
            "llama3.1-8b",
            "test-llama",
            layers=4,
            batch=1,
            seq_len=32768,
            quick_seq_len=256,
            quick_args=("--seq-tile", "64"),
        ),
    ]
    # DPO: the reference pass, then training, on a pair file written for the row, on tiny-llama as the other
    # train rows: `slide train` has no --layers, and a whole Llama-3.1-8B's final checkpoint and export need
    # about 105 GiB of disk, more than the matrix's machines hold. Its speed at 8B is bench/preference.sh's.
    preference = [
        Row("train: dpo", "train", args=("--objective", "dpo"), pairs=True, **tiny),
        # held-out pairs: their own reference pass, then eval_loss and eval_rewards/* at steps 3 and 6
        Row(
            "train: dpo + evaluation",
            "train",
            args=("--objective", "dpo", "--eval-fraction", "0.25", "--eval-every", "3"),
            pairs=True,
            **tiny,
        ),
    ]
    return options + train + families + long + preference


@dataclass
class Outcome:
    row: Row
    argv: list[str]
    ok: bool = True
    skipped: str | None = None
    failures: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def fail(self, reason: str) -> None:
        self.ok = False
        self.failures.append(reason)


@dataclass(frozen=True)
class Settings:
    device: str
    quick: bool
    out: Path
    scratch: Path
    fla_site: Path | None
    matmul_tflops: float | None
    in_process: bool = False


# -- running a row ------------------------------------------------------------------------------------------
def row_argv(row: Row, s: Settings, workdir: Path) -> list[str]:
    """The `slide` command line of ``row``, as a user would type it (after `slide`)."""
    model = row.quick_model if s.quick else row.model
    argv = ["bench" if row.command == "bench" else "train", "--model", model, "--device", s.device]
    if not s.quick:
        argv += ["--gpu-memory", row.gpu_memory]
    if row.command == "bench":
        batch, seq, steps, warmup = (2, row.quick_seq_len, 2, 1) if s.quick else (row.batch, row.seq_len, 3, 1)
        argv += ["--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps), "--warmup", str(warmup)]
        if row.layers is not None and not s.quick:
            argv += ["--layers", str(row.layers)]
        argv += ["--json", str(workdir / "bench.json")]
    else:
        batch, seq, steps = (2, 64, 4) if s.quick else (8, 512, 6)
        if row.pairs:  # a pair's two sequences share a row: the quick mode's rows are longer
            seq = max(seq, 128)
            argv += ["--data", str(write_pairs(workdir, batch * steps, seq))]
        argv += ["--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps)]
        argv += ["--output", str(workdir / "run"), "--lr", "1e-3"]
    if row.clip is not None:
        argv += ["--max-grad-norm", str(row.clip)]
    if row.nvme:
        nvme = workdir / "nvme"
        nvme.mkdir(exist_ok=True)
        argv += ["--nvme-dir", str(nvme)]
    return argv + list(row.args) + list(row.quick_args if s.quick else ())


def write_pairs(workdir: Path, pairs: int, seq_len: int) -> Path:
    """``pairs`` synthetic preference pairs sized for rows of ``seq_len`` (bench/preference.py writes them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_preference", Path(__file__).with_name("preference.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_preference"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    path, _ = module.write_data(workdir, pairs, seq_len)
    return path


def run_row(row: Row, s: Settings) -> Outcome:
    workdir = Path(tempfile.mkdtemp(prefix="row-", dir=s.scratch))
    argv = row_argv(row, s, workdir)
    outcome = Outcome(row, argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if row.needs_gpu and s.device == "cpu":
        outcome.skipped = "the update runs on the GPU (the CPU device refuses --update-placement gpu)"
        return outcome
    if row.needs_fla:
        if s.fla_site is None:
            outcome.skipped = "no --fla-site given (flash-linear-attention not carried)"
            return outcome
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(s.fla_site), env.get("PYTHONPATH", "")) if p)
    began = time.perf_counter()
    launcher = [sys.executable, "-m", "slide_hf"]
    if row.command == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "slide_hf"]
    log_path = workdir / "output.log"
    if s.in_process and row.command != "torchrun":
        done = run_in_process(argv)
    elif row.command == "torchrun" or row.needs_fla:  # a launcher, or another sys.path: a fresh interpreter
        try:
            done = subprocess.run([*launcher, *argv], env=env, capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess(argv, -1, "", f"did not finish within {ROW_TIMEOUT_S} s")
    else:
        done = run_forked(argv, log_path)
    outcome.wall_s = time.perf_counter() - began
    log_path.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).strip().splitlines() if line.strip()]
        outcome.fail(f"exit {done.returncode}: {lines[-1][:300] if lines else '(no output)'}")
        with (s.out / "failed_rows.log").open("a") as failed:  # the end of each failed row's output
            failed.write(f"==== {row.name}: slide {' '.join(argv)}\n" + "\n".join(lines[-60:]) + "\n")
        return outcome
    if row.command == "bench":
        check_bench(outcome, json.loads((workdir / "bench.json").read_text()), s)
    else:
        check_train(outcome, workdir / "run", check_host=not s.in_process or row.command == "torchrun")
    return outcome


def run_forked(argv: list[str], log_path: Path) -> subprocess.CompletedProcess[str]:
    """``slide ARGV`` in a child forked from this process, which has imported torch, transformers and slide_hf
    but never touched CUDA: a fresh process's host peak and CUDA context without its seconds of imports."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its output to the log, its exit status the command's
        code = 1
        try:
            os.close(read_fd)
            out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            from slide_hf.cli.main import main as slide

            code = slide(argv)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    os.close(write_fd)
    os.close(read_fd)
    deadline = time.monotonic() + ROW_TIMEOUT_S
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return subprocess.CompletedProcess(argv, -1, "", f"did not finish within {ROW_TIMEOUT_S} s")
        time.sleep(0.2)
    code = os.waitstatus_to_exitcode(status)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return subprocess.CompletedProcess(argv, code, text, "")


def preimport() -> None:
    """What every row imports, loaded once before the rows are forked (CUDA stays untouched here)."""
    import transformers  # noqa: F401

    import slide_hf.bench
    import slide_hf.cli.main
    import slide_hf.recipe  # noqa: F401


def run_in_process(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``slide ARGV`` in this process (the quick mode: tiny rows would spend most of their time importing
    torch and transformers again). Host peaks are not checked then: one process's RSS is every row's."""
    import contextlib
    import io

    from slide_hf.cli.main import main as slide

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = slide(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())


# -- checks -------------------------------------------------------------------------------------------------
def check_losses(outcome: Outcome, losses: list[float]) -> None:
    outcome.facts["losses"] = losses
    if not losses:
        outcome.fail("no loss was reported")
    elif not all(isinstance(x, int | float) and math.isfinite(x) for x in losses):
        outcome.fail(f"a loss is not finite: {losses}")


def check_peak(outcome: Outcome, what: str, measured_gib: float, planned_gib: float, slack: float) -> None:
    outcome.facts[f"{what}_peak_gib"] = measured_gib
    outcome.facts[f"{what}_plan_gib"] = planned_gib
    if planned_gib > 0 and measured_gib > planned_gib * slack:
        outcome.fail(f"{what} peak {measured_gib:.2f} GiB > plan {planned_gib:.2f} GiB + {round((slack - 1) * 100)} %")


def check_bench(outcome: Outcome, result: dict[str, Any], s: Settings) -> None:
    slide = result["slide"]
    check_losses(outcome, slide["losses"])
    outcome.facts["tokens_per_s"] = slide["tokens_per_s"]
    outcome.facts["resident_units"] = slide["resident_units"]
    outcome.facts["attention"] = slide.get("attention")
    linear = slide.get("linear_attention")  # which delta-rule path the linear-attention layers ran, if any
    outcome.facts["linear_attention"] = linear
    if outcome.row.needs_fla and s.device != "cpu" and not (linear or "").startswith("flash-linear-attention"):
        # a "+fla" row that ran the torch path measured nothing of what it names (fla's kernels are CUDA only)
        outcome.fail(f"flash-linear-attention did not run: linear attention {linear!r}")
    if s.device != "cpu":
        check_peak(outcome, "gpu", slide["gpu_peak_gib"], slide["planned_gpu_peak_gib"], GPU_SLACK)
    if not s.in_process:
        check_peak(outcome, "host", slide["host_peak_rss_gib"], slide["planned_host_peak_gib"], HOST_SLACK)
    if outcome.row.clip is not None:
        norms = [n for n in slide["grad_norms"] if n is not None]
        outcome.facts["grad_norms"] = norms
        if not norms or max(norms) <= outcome.row.clip:
            outcome.fail(f"clipping at {outcome.row.clip} never fired (grad norms {norms})")
    tokens = result["batch_size"] * result["seq_len"]
    outcome.facts["blocks"] = block_speeds(slide["units"], tokens, s.matmul_tflops)
    if s.device != "cpu":
        for kind in outcome.facts["blocks"]:
            for problem in kind["problems"]:
                outcome.fail(problem)


def block_speeds(units: dict[str, dict[str, Any]], tokens: int, matmul_tflops: float | None) -> list[dict[str, Any]]:
    """Per kind of block: streamed and resident forward/backward ms per 1K tokens, the streamed/resident
    ratio, and the share of the matmul rate the streamed blocks reach; with the problems a row fails on."""
    kinds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, unit in units.items():
        if name.startswith("block") and "forward" in unit:
            kinds.setdefault(unit["kind"], {"streamed": [], "resident": []})[
                "resident" if unit["resident"] else "streamed"
            ].append(unit)
    report = []
    for kind, placed in kinds.items():
        entry: dict[str, Any] = {"kind": kind, "problems": []}
        for where, group in placed.items():
            if group:
                entry[where] = {
                    phase: round(_median([u[phase] for u in group]) * 1024 / tokens, 3)
                    for phase in ("forward", "backward")
                }
                entry[where]["count"] = len(group)
        streamed, resident = entry.get("streamed"), entry.get("resident")
        if streamed and resident:
            for phase in ("forward", "backward"):
                ratio = streamed[phase] / resident[phase] if resident[phase] > 0 else math.inf
                entry[f"{phase}_ratio"] = round(ratio, 2)
                if ratio > TWIN_RATIO:
                    entry["problems"].append(
                        f"{kind}: streamed {phase} {streamed[phase]:.2f} ms/1K tok is {ratio:.1f}x its resident "
                        f"twin's {resident[phase]:.2f} (limit {TWIN_RATIO}x)"
                    )
        sample = (placed["streamed"] or placed["resident"])[0]
        # The FLOPs a token costs: a mixture-of-experts block's routed experts count for the ones a token uses.
        active = sample.get("active_matmul_params", sample.get("dense_matmul_params", 0))
        if matmul_tflops and active and streamed:
            for phase, flops_per_param in (("forward", 2), ("backward", 6)):
                achieved = flops_per_param * active * 1024 / (streamed[phase] / 1e3) / 1e12
                share = achieved / matmul_tflops
                entry[f"{phase}_matmul_share"] = round(share, 3)
                if not resident and share < MIN_MATMUL_SHARE:
                    entry["problems"].append(
                        f"{kind}: streamed {phase} reaches {share:.0%} of the card's bf16 matmul rate "
                        f"({matmul_tflops:.0f} TFLOP/s; limit {MIN_MATMUL_SHARE:.0%}) and no twin is resident"
                    )
        report.append(entry)
    return report


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def check_train(outcome: Outcome, run_dir: Path, *, check_host: bool) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "step" in r]
    check_losses(outcome, [r["loss"] for r in steps])
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    if "--eval-fraction" in outcome.row.args:
        outcome.facts["eval_losses"] = evals
        if not evals or not all(math.isfinite(x) for x in evals):
            outcome.fail(f"evaluation reported no finite eval loss ({evals})")
    if not (run_dir / "model" / "config.json").exists():
        outcome.fail("no exported model in the run directory")
    planned = _planned_peaks(run_dir / "train.log")
    if planned is None:
        outcome.fail("train.log has no 'plan:' line")
        return
    gpu_gib = max((r.get("gpu_mem_peak_gb", 0.0) for r in steps), default=0.0) * 1e9 / 2**30
    host_gib = max((r.get("host_rss_gb", 0.0) for r in steps), default=0.0) * 1e9 / 2**30
    outcome.facts["tokens_per_s"] = round(_median([r["tokens_per_s"] for r in steps]), 1) if steps else None
    if gpu_gib > 0:
        check_peak(outcome, "gpu", round(gpu_gib, 2), planned[0], GPU_SLACK)
    if check_host:
        check_peak(outcome, "host", round(host_gib, 2), planned[1], HOST_SLACK)


def _planned_peaks(log: Path) -> tuple[float, float] | None:
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        if "plan: GPU peak" in line:
            words = line.split("plan: GPU peak", 1)[1].replace(",", " ").split()
            return float(words[0]), float(words[words.index("host") + 2])
        if "plan: host peak" in line:  # the CPU device: no GPU peak in its plan
            return 0.0, float(line.split("plan: host peak", 1)[1].split()[0])
    return None


# -- the machine --------------------------------------------------------------------------------------------
def measure_matmul_tflops() -> float:
    """The card's bf16 matmul rate on random 8192^3 products (the median of 10 after 3 warm-ups)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192**3 / _median(times) / 1e12


def matmul_in_child() -> tuple[float, str]:
    """:func:`measure_matmul_tflops` and the GPU's name, in a child process: this one never initialises CUDA,
    because it forks the rows."""
    code = "import gpu_matrix, torch; print(torch.cuda.get_device_name()); print(gpu_matrix.measure_matmul_tflops())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.strip().splitlines()
    return float(lines[-1]), lines[-2]


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"cores": os.cpu_count(), "python": platform.python_version()}
    try:
        import psutil

        facts["ram_gib"] = round(psutil.virtual_memory().total / 2**30)
    except ImportError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        pass
    return facts


def tree_name(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# -- reporting ----------------------------------------------------------------------------------------------
def markdown(outcomes: list[Outcome], header: dict[str, Any]) -> str:
    lines = [
        f"Command: `{header['command']}`; date {header['date']}; tree `{header['tree']}`; host: "
        + ", ".join(f"{k} {v}" for k, v in header["host"].items())
        + (f"; bf16 matmul {header['matmul_tflops']:.0f} TFLOP/s" if header.get("matmul_tflops") else ""),
        "",
        "| row | result | tok/s | GPU peak / plan GiB | host peak / plan GiB | blocks: streamed vs resident"
        " (fwd, bwd) or matmul share | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        f = o.facts
        result = "skipped: " + o.skipped if o.skipped else ("ok" if o.ok else "FAIL: " + "; ".join(o.failures))
        gpu = f"{f['gpu_peak_gib']:.2f} / {f['gpu_plan_gib']:.2f}" if "gpu_peak_gib" in f else ""
        host = f"{f['host_peak_gib']:.2f} / {f['host_plan_gib']:.2f}" if "host_peak_gib" in f else ""
        blocks = "; ".join(_block_cell(b) for b in f.get("blocks", []))
        tok = f"{f['tokens_per_s']:,.0f}" if f.get("tokens_per_s") else ""
        lines.append(f"| {o.row.name} | {result} | {tok} | {gpu} | {host} | {blocks} | {o.wall_s:.0f} |")
    return "\n".join(lines) + "\n"


def _block_cell(entry: dict[str, Any]) -> str:
    name = entry["kind"].split("#")[0]
    if "forward_ratio" in entry:
        return f"{name} {entry['forward_ratio']}x, {entry['backward_ratio']}x"
    if "forward_matmul_share" in entry:
        return f"{name} {entry['forward_matmul_share']:.0%}, {entry['backward_matmul_share']:.0%} of matmul"
    if "streamed" in entry:
        return f"{name} {entry['streamed']['forward']:.2f}, {entry['streamed']['backward']:.2f} ms/1K tok"
    return f"{name} (no streamed block)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where gpu_matrix.md, .json and logs/ go")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models and shapes (with --device cpu)")
    parser.add_argument("--rows", help="comma-separated substrings: run only rows whose name contains one")
    parser.add_argument("--fla-site", type=Path, help="a folder holding flash-linear-attention (rows '+fla')")
    parser.add_argument("--tree", help="the tree's name for the report (default: git rev-parse --short HEAD)")
    parser.add_argument("--budget-s", type=float, help="start no row after this many seconds (the rest: not run)")
    parser.add_argument("--scratch", type=Path, help="where row run directories and NVMe files go (default: a temp)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = rows()
    if args.rows:
        wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
        chosen = [r for r in chosen if any(w in r.name for w in wanted)]
    scratch = Path(tempfile.mkdtemp(prefix="gpu-matrix-", dir=args.scratch))
    matmul, gpu = (None, "none") if args.device == "cpu" else matmul_in_child()
    if not args.quick:
        preimport()
    settings = Settings(args.device, args.quick, args.out, scratch, args.fla_site, matmul, in_process=args.quick)
    header = {
        "command": "python bench/gpu_matrix.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "tree": tree_name(args.tree),
        "host": {**host_facts(), "gpu": gpu},
        "matmul_tflops": matmul,
    }
    outcomes: list[Outcome] = []
    began = time.perf_counter()
    for row in chosen:
        if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
            outcome = Outcome(row, [], ok=False, failures=[f"not run: the {args.budget_s:.0f} s budget was spent"])
        else:
            outcome = run_row(row, settings)
        outcomes.append(outcome)
        status = "skipped" if outcome.skipped else ("ok" if outcome.ok else "FAIL")
        print(f"{status:7} {outcome.wall_s:5.0f} s  {row.name}: " + "; ".join(outcome.failures), flush=True)
        write_reports(args.out, outcomes, header)  # after every row: a run cut short still reports
    print(markdown(outcomes, header))
    return 0 if all(o.ok for o in outcomes) else 1


def write_reports(out: Path, outcomes: list[Outcome], header: dict[str, Any]) -> None:
    (out / "gpu_matrix.md").write_text(markdown(outcomes, header))
    rows_json = [
        {
            "name": o.row.name,
            "argv": ["slide", *o.argv],
            "ok": o.ok,
            "skipped": o.skipped,
            "failures": o.failures,
            "wall_s": round(o.wall_s, 1),
            **o.facts,
        }
        for o in outcomes
    ]
    (out / "gpu_matrix.json").write_text(json.dumps({**header, "rows": rows_json}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
