"""What a run prints: each line once, and evaluation lines like every other line.

A live terminal used to show each evaluation twice, once through rich's ``console.log`` with a timestamp
and a ``progress.py:NNN`` source link; the run's summary came once from the recipe's log and once from
`slide train`'s own print; and `slide data` said that the template re-renders earlier turns once for the
preview and once more for the preparation.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_data_templates import CONVERSATIONS
from test_data_tokenizer import QWEN3, chat_tokenizer

from slide_hf.progress import Progress

REPO = Path(__file__).resolve().parents[2]


def test_an_evaluation_line_on_a_live_terminal_is_a_plain_log_line_said_once(caplog):
    from rich.console import Console

    screen = io.StringIO()
    console = Console(file=screen, width=120, force_terminal=True)
    with caplog.at_level(logging.INFO, logger="slide.train"), Progress(4, live=True, console=console) as progress:
        progress.evaluation({"step": 2, "eval_loss": 4.6953, "perplexity": 109.4})
    assert "progress.py" not in screen.getvalue() and "eval at step" not in screen.getvalue()
    lines = [r.getMessage() for r in caplog.records if "eval at step" in r.getMessage()]
    assert lines == ["eval at step 2: eval_loss 4.6953  perplexity 109.4"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_run_prints_its_summary_and_each_evaluation_once(tmp_path):
    command = [
        sys.executable, "-m", "slide_hf", "train", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32",
        "--seq-len", "32", "--steps", "2", "--batch-size", "1", "--eval-fraction", "0.25", "--eval-every", "2",
        "--output", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    both = done.stdout + done.stderr
    assert both.count("eval at step 2:") == 1, both
    assert both.count(" -> ") == 1, both  # "trained 2 steps: loss a -> b", on stdout
    assert done.stdout.count("trained 2 steps: loss ") == 1 and both.count("model written to") == 1, both
    assert "progress.py" not in both


def test_slide_data_says_that_qwen3_re_renders_earlier_turns_once(tmp_path, monkeypatch, caplog):
    from slide_hf.cli import data as data_command
    from slide_hf.cli.main import main

    tok = chat_tokenizer(QWEN3, name="Qwen/Qwen3-0.6B")
    config = types.SimpleNamespace(vocab_size=len(tok), max_position_embeddings=4096)
    monkeypatch.setattr(data_command, "_tokenizer_and_config", lambda cfg: (tok, config))
    path = tmp_path / "c.jsonl"
    messages = CONVERSATIONS["reasoning on every turn"]
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for _ in range(3)), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="slide.data"):
        assert main(["data", "--data", str(path), "--show", "2", "--seq-len", "256"]) == 0
    said = [r.getMessage() for r in caplog.records if "re-renders earlier turns" in r.getMessage()]
    assert len(said) == 1, said
