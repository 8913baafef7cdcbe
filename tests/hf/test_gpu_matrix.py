"""bench/gpu_matrix.py, the GPU acceptance run: its CPU quick mode runs every row on tiny models (so the script
cannot rot between GPU runs), and its checks fail what they exist to catch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_matrix.py"


def _matrix():
    spec = importlib.util.spec_from_file_location("gpu_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["gpu_matrix"] = module
    spec.loader.exec_module(module)
    return module


def _unit(kind: str, resident: bool, forward: float, backward: float, dense: int = 10**9) -> dict:
    return {
        "kind": kind,
        "resident": resident,
        "forward": forward,
        "backward": backward,
        "dense_matmul_params": dense,
        "has_experts": False,
    }


def test_a_streamed_block_15x_slower_than_its_resident_twin_fails() -> None:
    matrix = _matrix()
    units = {
        "block.0": _unit("Gemma3DecoderLayer:sliding#1", True, 12.0, 40.0),
        "block.1": _unit("Gemma3DecoderLayer:sliding#1", False, 180.0, 250.0),
        "block.2": _unit("Gemma3DecoderLayer:sliding#1", False, 170.0, 240.0),
    }
    (entry,) = matrix.block_speeds(units, tokens=16384, matmul_tflops=790.0)
    assert entry["forward_ratio"] == pytest.approx(175 / 12, rel=1e-2)
    assert len(entry["problems"]) == 2  # forward and backward
    units["block.1"].update(forward=13.0, backward=44.0)
    units["block.2"].update(forward=14.0, backward=46.0)
    (entry,) = matrix.block_speeds(units, tokens=16384, matmul_tflops=790.0)
    assert entry["problems"] == []


def test_a_streamed_block_without_twin_is_held_to_the_matmul_rate() -> None:
    matrix = _matrix()
    # 218M dense parameters, 16K tokens: 2 * 218e6 * 16384 FLOP forward in 10 ms is ~714 TFLOP/s (90 %)
    fast = {"block.0": _unit("Llama#1", False, 10.0, 30.0, dense=218_000_000)}
    (entry,) = matrix.block_speeds(fast, tokens=16384, matmul_tflops=790.0)
    assert entry["forward_matmul_share"] == pytest.approx(0.904, abs=0.01) and entry["problems"] == []
    slow = {"block.0": _unit("Llama#1", False, 150.0, 450.0, dense=218_000_000)}
    (entry,) = matrix.block_speeds(slow, tokens=16384, matmul_tflops=790.0)
    assert len(entry["problems"]) == 2


def test_peaks_beyond_the_plan_fail_their_row() -> None:
    matrix = _matrix()
    outcome = matrix.Outcome(matrix.rows()[0], [])
    matrix.check_peak(outcome, "gpu", 10.9, 10.59, matrix.GPU_SLACK)
    assert outcome.ok
    matrix.check_peak(outcome, "host", 19.43, 17.81, matrix.HOST_SLACK)
    assert not outcome.ok and "host peak 19.43 GiB > plan 17.81 GiB + 5 %" in outcome.failures[0]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The whole CPU quick mode, run once for the module: the tests of every row, the long context row and
    the DPO row read the same run (each row's argv depends only on the row and the settings, so the run of
    one row alone, `--rows NAME`, is the same run as that row's in the whole matrix)."""
    out = tmp_path_factory.mktemp("gpu_matrix_quick")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), "--scratch", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done, out


def _quick_row(quick_run: tuple[subprocess.CompletedProcess[str], Path], name: str) -> dict:
    """The report's row ``name`` from the shared quick run (its own failure, not another row's)."""
    done, out = quick_run
    report = out / "gpu_matrix.json"
    assert report.is_file(), done.stdout[-4000:] + done.stderr[-2000:]
    (row,) = [row for row in json.loads(report.read_text())["rows"] if row["name"] == name]
    return row


@pytest.mark.slow
def test_every_row_runs_in_the_cpu_quick_mode(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, tmp_path = quick_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_matrix.json").read_text())
    names = [row["name"] for row in report["rows"]]
    assert names == [row.name for row in _matrix().rows()]
    for row in report["rows"]:
        if row["skipped"]:  # flash-linear-attention is not installed here; the CPU device has no GPU to update on
            assert "+fla" in row["name"] or "update gpu" in row["name"], row
            continue
        assert row["ok"], row
        assert row["losses"] and all(isinstance(x, float) for x in row["losses"])
    table = (tmp_path / "gpu_matrix.md").read_text()
    assert table.startswith("Command: `python bench/gpu_matrix.py --device cpu --quick")
    assert "| state bf16 | ok |" in table


def test_a_mixture_of_experts_block_is_held_to_the_matmul_rate_on_its_active_flops() -> None:
    """A routed-experts block counts the experts a token uses: at the same time per token it reaches the share
    of a dense block of its active parameters, and a slow one fails like a dense one."""
    matrix = _matrix()
    moe = _unit("DeepseekV3DecoderLayer:full_attention#1", False, 10.0, 30.0, dense=50_000_000)
    moe.update(has_experts=True, active_matmul_params=218_000_000)
    (entry,) = matrix.block_speeds({"block.0": moe}, tokens=16384, matmul_tflops=790.0)
    assert entry["forward_matmul_share"] == pytest.approx(0.904, abs=0.01) and entry["problems"] == []
    moe.update(forward=150.0, backward=450.0)
    (entry,) = matrix.block_speeds({"block.0": moe}, tokens=16384, matmul_tflops=790.0)
    assert len(entry["problems"]) == 2


@pytest.mark.parametrize("preset", ["test-deepseek-v3", "test-llama4", "test-qwen3-next", "test-llama"])
def test_the_active_matmul_parameters_of_a_block_count_the_routed_experts_a_token_uses(preset) -> None:
    """Counted from the HF layer itself: every matrix but the routed experts' stacks, which count
    ``num_experts_per_tok`` of their per-expert slices; shared experts are dense (every token passes them)."""
    pytest.importorskip("transformers")
    from slide_hf import PRESETS, build_model
    from slide_hf.bench import describe_unit

    config = PRESETS[preset]()
    model = build_model(config)
    top_k = getattr(config, "num_experts_per_tok", None)
    block = model.blocks[-1]
    facts = describe_unit(block, top_k)
    expected = 0
    for name, param in block.root.named_parameters():
        routed = ".experts." in f".{name}" and param.dim() == 3
        if routed:
            expected += param[0].numel() * top_k
        elif param.dim() >= 2:
            expected += param.numel()
    assert facts["active_matmul_params"] == expected
    assert facts["has_experts"] == (top_k is not None)
    if top_k is not None:
        assert facts["active_matmul_params"] < facts["params"]
        shared = sum(p.numel() for n, p in block.root.named_parameters() if "shared_expert" in n and p.dim() >= 2)
        assert (preset == "test-deepseek-v3" and shared > 0) or preset != "test-deepseek-v3"
        assert facts["dense_matmul_params"] >= shared


def test_the_long_context_row_runs_32k_tokens_on_the_gpu_and_tiles_in_the_quick_mode(tmp_path: Path) -> None:
    matrix = _matrix()
    (row,) = [row for row in matrix.rows() if row.name.startswith("long context")]
    on_gpu = matrix.row_argv(row, matrix.Settings("cuda", False, tmp_path, tmp_path, None, None), tmp_path)
    given = dict(zip(on_gpu[1::2], on_gpu[2::2], strict=False))
    assert given["--model"] == "llama3.1-8b" and given["--gpu-memory"] == "24"
    assert "--seq-len 32768" in " ".join(on_gpu) and "--batch-size 1" in " ".join(on_gpu)
    assert "--seq-tile" not in on_gpu  # auto: the planner chooses it from the GPU budget
    quick = matrix.row_argv(row, matrix.Settings("cpu", True, tmp_path, tmp_path, None, None), tmp_path)
    line = " ".join(quick)
    assert "--seq-len 256" in line and "--seq-tile 64" in line  # 2 x 256 tokens in tiles of 64


def test_the_long_context_row_runs_in_the_cpu_quick_mode(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    (name,) = [row.name for row in _matrix().rows() if row.name.startswith("long context")]
    row = _quick_row(quick_run, name)
    assert row["ok"] and not row["skipped"] and row["losses"], row


def test_the_dpo_row_trains_tiny_llama_on_a_pair_file(tmp_path: Path) -> None:
    """As the other train rows, tiny-llama on the GPU too: a whole 8B's final checkpoint and export need more
    disk than the matrix's machines have (bench/preference.sh measures the 8B)."""
    matrix = _matrix()
    (row,) = [row for row in matrix.rows() if row.name == "train: dpo"]
    on_gpu = matrix.row_argv(row, matrix.Settings("cuda", False, tmp_path, tmp_path, None, None), tmp_path / "gpu")
    given = dict(zip(on_gpu[1::2], on_gpu[2::2], strict=False))
    assert on_gpu[0] == "train" and given["--model"] == "tiny-llama" and given["--gpu-memory"] == "24"
    assert "--objective dpo" in " ".join(on_gpu)
    pairs = [json.loads(line) for line in Path(given["--data"]).read_text().splitlines()]
    assert len(pairs) == 8 * 6 and {"prompt", "chosen", "rejected"} <= set(pairs[0])  # 6 steps of 8 rows
    quick = matrix.row_argv(row, matrix.Settings("cpu", True, tmp_path, tmp_path, None, None), tmp_path / "cpu")
    given = dict(zip(quick[1::2], quick[2::2], strict=False))
    assert given["--model"] == "tiny-llama" and given["--seq-len"] == "128"
    assert Path(given["--data"]).is_file()


def test_the_dpo_row_runs_in_the_cpu_quick_mode(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    row = _quick_row(quick_run, "train: dpo")
    assert row["ok"] and not row["skipped"] and len(row["losses"]) == 4, row


def test_the_dpo_row_with_held_out_pairs_runs_in_the_cpu_quick_mode(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    row = _quick_row(quick_run, "train: dpo + evaluation")
    assert row["ok"] and not row["skipped"] and len(row["losses"]) == 4 and row["eval_losses"], row
