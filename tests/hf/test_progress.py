"""slide_hf.progress: a labeled time remaining, the overlap ratio, GPU fields only with a GPU."""

from __future__ import annotations

import logging
import re

import pytest

from slide_hf.progress import Progress, format_duration


@pytest.mark.parametrize(("seconds", "text"), [(0, "0:00"), (75, "1:15"), (6130, "1:42:10"), (-3, "0:00")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.25,
        "lr": 1e-3,
        "tokens_per_s": 1000.0,
        "tflops": 0.5,
        "overlap": 1.4,
        "grad_norm": 0.75,
        "gpu_mem_peak_gb": 0.0,
        "host_rss_gb": 2.0,
    }


def test_time_remaining_is_the_mean_step_time_times_the_steps_left(monkeypatch):
    clock = iter([0.0, 10.0, 11.0, 12.0])  # enter, then steps of 10 s (warm-up), 1 s, 1 s
    monkeypatch.setattr("slide_hf.progress.time.perf_counter", lambda: next(clock))
    with Progress(10, live=False) as progress:
        progress.update(_record(1))
        assert progress.seconds_remaining(1) == pytest.approx(90.0)  # only the first step is known
        progress.update(_record(2))
        assert progress.seconds_remaining(2) == pytest.approx(8.0)  # the warm-up step is left out
        record = _record(3)
        progress.update(record)
    assert record["eta_s"] == pytest.approx(7.0)


def test_plain_lines_are_labeled_and_cpu_runs_show_no_gpu_fields(caplog):
    with caplog.at_level(logging.INFO, logger="slide.train"), Progress(4, live=False, has_gpu=False) as progress:
        progress.update(_record(1))
        progress.update(_record(2))
    line = caplog.records[-1].getMessage()
    assert line.startswith("step 2/4")
    assert "ETA " in line and "overlap 1.40" in line and "grad norm 0.75" in line
    assert "GPU" not in line and "TFLOPS" not in line and " eta " not in line


def test_log_every_thins_plain_lines_but_keeps_the_last(caplog):
    with caplog.at_level(logging.INFO, logger="slide.train"), Progress(5, live=False, log_every=2) as progress:
        for step in range(1, 6):
            progress.update(_record(step))
    steps = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("step ")]
    assert steps == ["2/5", "4/5", "5/5"]


def _live_line(width: int, total: int = 1000) -> str:
    """The last live line a terminal of ``width`` columns shows after three steps of a long run."""
    import io

    from rich.console import Console

    screen = io.StringIO()
    console = Console(file=screen, width=width, force_terminal=True, color_system=None)
    with Progress(total, live=True, has_gpu=True, console=console) as progress:
        for step in (1, 2, 3):
            record = _record(step) | {"tokens_per_s": 12345.0, "tflops": 123.4, "gpu_mem_peak_gb": 20.4}
            progress.update(record)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # cursor and erase codes
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()][-1]


@pytest.mark.parametrize("width", [60, 80, 200])
def test_the_live_line_keeps_the_step_counter_and_eta_at_any_width(width):
    line = _live_line(width)
    assert len(line) <= width and "…" not in line, line
    assert "3/1000" in line and "ETA " in line and "loss 1.2500" in line, line
    if width == 200:  # room for everything
        for field in ("grad norm 0.75", "12,345 tok/s", "123.4 TFLOPS", "overlap 1.40", "GPU 20.4 GB", "host 2.0 GB"):
            assert field in line, line
    if width == 60:  # the least important fields went first
        assert "host" not in line and "GPU" not in line and "TFLOPS" not in line


def test_fit_fields_drops_the_least_important_first():
    from slide_hf.progress import fit_fields

    fields = [("step", "3/10"), ("loss", "loss 1.0"), ("host", "host 2.0 GB"), ("eta", "ETA 0:07")]
    assert fit_fields(fields, 100) == "3/10  loss 1.0  host 2.0 GB  ETA 0:07"
    assert fit_fields(fields, 30) == "3/10  loss 1.0  ETA 0:07"
    assert fit_fields(fields, 15) == "3/10  ETA 0:07"
    assert fit_fields(fields, 1) == "3/10"


def test_a_pass_logs_labeled_lines_with_the_time_remaining(caplog):
    from slide_hf.progress import PassProgress

    with caplog.at_level(logging.INFO, logger="slide.train"), PassProgress("reference pass", 25, live=False) as p:
        for done in range(1, 26):
            p.update(done)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("reference pass: 1/25 micro-batches  ETA ")
    assert lines[-1].startswith("reference pass: 25/25 micro-batches  ETA 0:00")
    assert len(lines) <= 12  # about one a tenth, and the last
