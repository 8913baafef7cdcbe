"""bench/long_context.sh and bench/long_context.py: the table of long-sequence runs fails what it exists to catch
(a non-finite loss, a peak past the plan), its FLOP bound is the dense and attention FLOPs at the matmul
rate, and the script runs end to end in its CPU dry mode on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "long_context.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("long_context", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["long_context"] = module
    spec.loader.exec_module(module)
    return module


def _result(losses: list[float], gpu: tuple[float, float], host: tuple[float, float]) -> dict[str, Any]:
    return {
        "layers": {"run": 32, "of": 32},
        "slide": {
            "params": 8_030_261_248,
            "losses": losses,
            "tokens_per_s": 2000.0,
            "gpu_peak_gib": gpu[0],
            "planned_gpu_peak_gib": gpu[1],
            "host_peak_rss_gib": host[0],
            "planned_host_peak_gib": host[1],
            "seq_tile": 8192,
        },
    }


def test_a_run_within_its_plan_is_ok_and_its_bound_is_the_flops_at_the_matmul_rate(tmp_path: Path) -> None:
    bench = _bench()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_result([11.9, 11.8, 11.7], (23.5, 23.3), (120.0, 118.0))))
    run = bench.read_run(path, "llama3.1-8b", 32768, 4096)
    assert run.ok and run.seq_tile == 8192
    per_token = 6 * 8_030_261_248 + 12 * 32 * 4096 * 32768
    assert run.flops_per_token == per_token
    assert run.bound_tokens_per_s(800.0) == pytest.approx(800e12 / per_token)
    table = bench.markdown([run], [], 800.0)
    assert "| llama3.1-8b | 32,768 | 8192 | ok | 2,000 |" in table


@pytest.mark.parametrize(
    ("losses", "gpu", "host", "failure"),
    [
        ([11.9, float("nan")], (20.0, 23.3), (100.0, 118.0), "losses not finite"),
        ([], (20.0, 23.3), (100.0, 118.0), "losses not finite"),
        ([11.9], (24.1, 23.3), (100.0, 118.0), "GPU peak 24.10 GiB > plan 23.30 GiB + 3 %"),
        ([11.9], (20.0, 23.3), (124.0, 118.0), "host peak 124.00 GiB > plan 118.00 GiB + 5 %"),
    ],
)
def test_a_run_fails_on_a_bad_loss_or_a_peak_past_the_plan(tmp_path: Path, losses, gpu, host, failure) -> None:
    bench = _bench()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_result(losses, gpu, host)))
    run = bench.read_run(path, "llama3.1-8b", 32768, 4096)
    assert not run.ok and any(failure in f for f in run.failures), run.failures
    assert "FAIL: " in bench.markdown([run], [], 800.0)


def test_a_missing_run_reports_its_last_log_line(tmp_path: Path) -> None:
    bench = _bench()
    (tmp_path / "run.log").write_text("loading\nslide bench: error: needs 80.0 GiB GPU memory\n")
    run = bench.read_run(tmp_path / "run.json", "qwen3-8b", 131072, 4096)
    assert not run.ok and run.error == "slide bench: error: needs 80.0 GiB GPU memory"


def test_the_longest_length_and_its_plan(tmp_path: Path) -> None:
    bench = _bench()
    (tmp_path / "plan-m.json").write_text(json.dumps({"longest_seq_len": 300000, "longest_seq_len_limit": "gpu"}))
    at_longest = {"seq_tile": 1024, "fits": False, "problem": "needs 200 GiB host RAM"}
    (tmp_path / "plan-m-longest.json").write_text(json.dumps(at_longest))
    entry = bench.read_plan(tmp_path / "plan-m.json", "m")
    assert (entry.longest_seq_len, entry.limit, entry.seq_tile, entry.fits) == (300000, "gpu", 1024, False)
    assert "| m | 300,000 | gpu | 1024 | no: needs 200 GiB host RAM |" in bench.markdown([], [entry], None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_script_runs_in_its_cpu_dry_mode(tmp_path: Path) -> None:
    """One tiny model at one length, tiled (--seq-tile 64 of 256 tokens), through `slide bench` and `slide plan`
    as on the GPU machine, then the table."""
    done = subprocess.run(
        ["bash", "bench/long_context.sh", str(tmp_path), "--dry-run", "--models", "test-qwen3", "--seq-lens", "256"],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "long_context.json").read_text())
    (run,) = summary["runs"]
    assert run["ok"] and run["seq_tile"] == 64 and run["losses"] and run["flops_per_token"] > 0
    assert "| test-qwen3 | 256 | 64 | ok |" in (tmp_path / "long_context.md").read_text()
    assert (tmp_path / "plan-test-qwen3.json").exists()
    timed = json.loads((tmp_path / "attention-test-qwen3-256.json").read_text())  # one layer's attention, timed
    assert timed["forward_s"] > 0 and timed["backward_s"] >= 0
    assert run["attention_s"] == [timed["forward_s"], timed["backward_s"]] and run["dense_flops_per_token"] > 0


def test_the_steps_own_bound_is_its_matmuls_with_recompute_and_its_attention_as_timed(tmp_path: Path) -> None:
    """An 8B at 32K: 8 FLOPs per block parameter and token, 6 per head parameter, none for the embedding
    (untied), at the matmul rate; each layer's attention forward twice and backward once, as timed."""
    bench = _bench()
    path = tmp_path / "run-llama3.1-8b-32768.json"
    path.write_text(json.dumps(_result([11.9, 11.8, 11.7], (23.5, 23.3), (120.0, 118.0))))
    (tmp_path / "attention-llama3.1-8b-32768.json").write_text(json.dumps({"forward_s": 0.01, "backward_s": 0.025}))
    run = bench.read_run(path, "llama3.1-8b", 32768, 4096)
    head = 128256 * 4096
    dense = 8 * (8_030_261_248 - 2 * head) + 6 * head
    assert run.dense_flops_per_token == dense and run.attention_s == (0.01, 0.025) and run.layers == 32
    seconds = 32768 * dense / 800e12 + 32 * (2 * 0.01 + 0.025)
    assert run.step_bound_tokens_per_s(800.0) == pytest.approx(32768 / seconds)
    assert run.step_bound_tokens_per_s(None) is None
    table = bench.markdown([run], [], 800.0)
    assert f"| {32768 / seconds:,.0f} | {2000.0 / (32768 / seconds):.0%} |" in table
    # a tied head is counted once: the embedding's matrix is the head's
    assert bench.dense_flops_per_token(1000 + 10 * 4, 4, 10, tied=True) == 8 * 1000 + 6 * 40
    # without the timing (an older run directory), no step bound, the row still prints
    (tmp_path / "attention-llama3.1-8b-32768.json").unlink()
    assert bench.read_run(path, "llama3.1-8b", 32768, 4096).step_bound_tokens_per_s(800.0) is None
