"""bench/preference.sh and bench/preference.py: the pair file gives DPO and SFT the same sequences, the table
reads what the runs and the reference pass log, its bound is the forward's FLOPs at the matmul rate, it fails
what it exists to catch, and the script runs end to end in its CPU dry mode on a tiny model."""

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
SCRIPT = ROOT / "bench" / "preference.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("preference_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["preference_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_the_pair_file_is_deterministic_and_sft_gets_each_pairs_two_sequences(tmp_path: Path) -> None:
    bench = _bench()
    pairs_path, sft_path = bench.write_data(tmp_path, pairs=5, seq_len=1024)
    again = bench.write_data(tmp_path / "again", pairs=5, seq_len=1024)
    assert pairs_path.read_text() == again[0].read_text()
    pairs = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    sft = [json.loads(line) for line in sft_path.read_text().splitlines()]
    prompt_bytes, completion_bytes = bench.sized_for(1024)
    assert (prompt_bytes, completion_bytes) == (240, 240)
    for index, pair in enumerate(pairs):
        assert len(pair["prompt"]) == prompt_bytes
        assert len(pair["chosen"]) == len(pair["rejected"]) == completion_bytes
        assert pair["chosen"] != pair["rejected"]
        assert sft[2 * index] == {"prompt": pair["prompt"], "completion": pair["chosen"]}
        assert sft[2 * index + 1] == {"prompt": pair["prompt"], "completion": pair["rejected"]}
    with pytest.raises(ValueError, match="no room"):
        bench.sized_for(64)


def test_the_forward_bound_counts_two_flops_per_active_parameter_and_the_attention_products() -> None:
    bench = _bench()
    untied = bench.Shape(layers=32, hidden=4096, vocab=128256, tied=False)
    params = 8_030_261_248
    per_token = 2 * (params - 128256 * 4096) + 4 * 32 * 4096 * 1024
    assert bench.forward_flops_per_token(params, untied, 1024) == per_token
    tied = bench.Shape(layers=32, hidden=4096, vocab=128256, tied=True)
    assert bench.forward_flops_per_token(params, tied, 1024) == 2 * params + 4 * 32 * 4096 * 1024


def test_steady_tokens_per_s_leaves_out_the_first_step() -> None:
    bench = _bench()
    steps = [
        {"tokens": 1000, "step_time_s": 10.0},
        {"tokens": 1000, "step_time_s": 1.0},
        {"tokens": 3000, "step_time_s": 1.0},
    ]
    assert bench.steady_tokens_per_s(steps) == pytest.approx(2000.0)
    assert bench.steady_tokens_per_s(steps[:1]) == pytest.approx(100.0)
    assert bench.steady_tokens_per_s([]) is None


def test_the_log_lines_it_reads() -> None:
    bench = _bench()
    log = (
        "model llama3.1-8b (preset): 8030.3M params, 32 blocks | data: ...\n"
        "plan: GPU peak 21.40 GiB, host peak 94.90 GiB, step 2.1 s (pinned 40.1 GiB)\n"
        "reference pass: 262144 tokens in 16 micro-batches in 8.250 s (31775 tok/s)\n"
    )
    assert bench.reference_pass(log) == (262144, 8.25)
    assert bench.planned_peaks(log) == (21.4, 94.9)
    assert bench.planned_peaks("plan: host peak 1.29 GiB\n") == (0.0, 1.29)
    assert bench.reference_pass("nothing") is None
    assert bench.reference_pass_steady(log) is None  # a pass of one evaluation has no rate after it
    steady = log.replace(
        "(31775 tok/s)",
        "(31775 tok/s); planned 6.48 s; after the first evaluation: 196608 tokens in 4.000 s (49152 tok/s)",
    )
    assert bench.reference_pass(steady) == (262144, 8.25)
    assert bench.reference_pass_steady(steady) == (196608, 4.0)


def test_the_reference_share_is_the_rate_after_the_first_evaluation(tmp_path: Path) -> None:
    bench = _bench()
    _run_dir(tmp_path, "dpo", [0.69, 0.68, 0.67], 22.0, reference=True)
    _run_dir(tmp_path, "sft", [11.9, 11.8, 11.7], 22.0, reference=False)
    log = tmp_path / "dpo" / "train.log"
    log.write_text(
        log.read_text().replace(
            "(32768 tok/s)", "(32768 tok/s); after the first evaluation: 196608 tokens in 4.000 s (49152 tok/s)"
        )
    )
    report = bench.build_report(tmp_path, "llama3.1-8b", 1024, None)
    shaped = bench.Report(report.dpo, report.sft, 800.0, 40960.0)
    assert shaped.dpo.reference_tokens_per_s == pytest.approx(32768.0)  # the whole pass, warm-up included
    assert shaped.reference_share == pytest.approx(49152.0 / 40960.0)
    assert "196,608 tokens in 4.00 s: 49,152 tok/s" in bench.markdown(shaped, "llama3.1-8b")


def _run_dir(root: Path, name: str, losses: list[float], gpu_gb: float, reference: bool) -> None:
    run = root / name
    run.mkdir(parents=True)
    records = [
        {"step": i + 1, "loss": loss, "tokens": 16000, "step_time_s": 4.0 if i == 0 else 2.0,
         "gpu_mem_peak_gb": gpu_gb, "host_rss_gb": 90.0}
        for i, loss in enumerate(losses)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "model x: 8030.3M params, 32 blocks\nplan: GPU peak 21.40 GiB, host peak 94.90 GiB, step 2.1 s\n"
    if reference:
        text += "reference pass: 262144 tokens in 16 micro-batches in 8.000 s (32768 tok/s)\n"
    (run / "train.log").write_text(text)


def test_the_report_holds_dpo_to_sft_and_the_reference_pass_to_its_bound(tmp_path: Path) -> None:
    bench = _bench()
    _run_dir(tmp_path, "dpo", [0.69, 0.68, 0.67], 22.0, reference=True)
    _run_dir(tmp_path, "sft", [11.9, 11.8, 11.7], 22.0, reference=False)
    report = bench.build_report(tmp_path, "llama3.1-8b", 1024, None)
    assert report.failures == []
    assert report.dpo.tokens_per_s == pytest.approx(8000.0)
    assert report.policy_ratio == pytest.approx(1.0)
    assert report.dpo.reference_tokens_per_s == pytest.approx(32768.0)
    shaped = bench.Report(report.dpo, report.sft, 800.0, 40960.0)
    assert shaped.reference_share == pytest.approx(0.8)
    table = bench.markdown(shaped, "llama3.1-8b")
    assert "| dpo | ok |" in table and "| DPO policy tok/s / SFT tok/s | 100.0% | >= 90% |" in table
    assert "| 80.0% | >= 90% |" in table


@pytest.mark.parametrize(
    ("losses", "gpu_gb", "failure"),
    [
        ([0.69, float("nan")], 22.0, "losses not finite"),
        ([0.69, 0.68], 25.0, "GPU peak 23.28 GiB > plan 21.40 GiB + 3 %"),
    ],
)
def test_a_bad_dpo_run_fails_the_report(tmp_path: Path, losses: list[float], gpu_gb: float, failure: str) -> None:
    bench = _bench()
    _run_dir(tmp_path, "dpo", losses, gpu_gb, reference=True)
    _run_dir(tmp_path, "sft", [11.9, 11.8], 22.0, reference=False)
    report = bench.build_report(tmp_path, "llama3.1-8b", 1024, None)
    assert any(failure in problem for problem in report.failures), report.failures


def test_a_dpo_run_without_its_reference_line_or_result_fails(tmp_path: Path) -> None:
    bench = _bench()
    _run_dir(tmp_path, "dpo", [0.69, 0.68], 22.0, reference=False)
    (tmp_path / "sft.log").write_text("Traceback ...\nRuntimeError: out of memory\n")
    report = bench.build_report(tmp_path, "llama3.1-8b", 1024, None)
    assert "dpo: train.log has no reference pass line" in report.failures
    assert "sft: RuntimeError: out of memory" in report.failures


@pytest.mark.slow
def test_the_script_runs_dpo_and_sft_in_its_cpu_dry_mode(tmp_path: Path) -> None:
    """Two steps of tiny-llama each, on the CPU: the pair file, both runs, and the table read back."""
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "preference.sh"), str(tmp_path), "--dry-run", "--steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "preference.json").read_text())
    assert report["failures"] == []
    assert len(report["dpo"]["losses"]) == len(report["sft"]["losses"]) == 2
    assert report["dpo"]["reference_tokens"] == 3 * 2 * 256  # every row once: 3 steps' worth of 2 rows
    assert report["policy_ratio"] > 0
    assert "| dpo | ok |" in (tmp_path / "preference.md").read_text()
