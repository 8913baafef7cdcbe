"""bench/state_fidelity.py's CPU smoke path: tiny model, a few steps of every state format, its outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "state_fidelity.py"


@pytest.fixture
def fidelity(torch_kernels: None) -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("slide_bench_state_fidelity", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_tiny_smoke_run_writes_curves_table_and_png(fidelity: ModuleType, tmp_path: Path) -> None:
    argv = ["--size", "tiny", "--steps", "5", "--eval-every", "2", "--batch-size", "2", "--seq-len", "32"]
    assert fidelity.main([*argv, "--eval-batches", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert list(curves["runs"]) == ["fp32", "bf16", "int8"]
    for fmt, run in curves["runs"].items():
        assert [step for step, _ in run["train"]] == [1, 2, 3, 4, 5]
        assert [step for step, _ in run["eval"]] == [2, 4, 5]
        assert run["optimizer"] in (("FusedAdamW", "TorchAdamW") if fmt == "fp32" else ("CompactAdamW",))
        assert (tmp_path / f"{fmt}.json").exists()
    state = {fmt: run["host_state_bytes"] for fmt, run in curves["runs"].items()}
    assert state["bf16"] * 2 == state["fp32"] and state["int8"] < state["bf16"]
    fp32, bf16 = curves["runs"]["fp32"]["eval"], curves["runs"]["bf16"]["eval"]
    assert fp32[-1][1] < fp32[0][1] and bf16[-1][1] == pytest.approx(fp32[-1][1], rel=1e-2)
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert table[2].startswith("| state | final eval loss | vs fp32") and len(table) == 7
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_split_over_invocations_are_reported_together(
    fidelity: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A format trained by an earlier invocation with the same settings is kept, not trained again, and the
    reports cover every format found; changed settings or ``--fresh`` train it again."""
    trained: list[str] = []
    run_format = fidelity.run_format

    def counting(fmt, args, data):
        trained.append(fmt)
        return run_format(fmt, args, data)

    monkeypatch.setattr(fidelity, "run_format", counting)
    argv = ["--size", "tiny", "--steps", "3", "--eval-every", "3", "--batch-size", "2", "--seq-len", "16"]
    argv += ["--eval-batches", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert fidelity.main([*argv, "--formats", "bf16"]) == 0
    assert fidelity.main([*argv, "--formats", "fp32,bf16"]) == 0
    assert trained == ["bf16", "fp32"]
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert list(curves["runs"]) == ["fp32", "bf16"]  # in the formats' order, whichever ran first
    assert "| bf16 |" in (tmp_path / "summary.md").read_text()
    assert fidelity.main([*argv, "--formats", "bf16", "--fresh"]) == 0
    assert fidelity.main([*argv, "--formats", "fp32", "--lr", "1e-3"]) == 0
    assert trained == ["bf16", "fp32", "bf16", "fp32"]
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert list(curves["runs"]) == ["fp32"]  # bf16 ran with the other learning rate


def test_the_data_is_the_standard_library(fidelity: ModuleType) -> None:
    train, held_out, files = fidelity.stdlib_tokens()
    assert files > 100 and train.numel() > 40 * held_out.numel() > 0
    assert int((train == fidelity.EOS).sum() + (held_out == fidelity.EOS).sum()) == files
    assert int(train.max()) == fidelity.EOS and int(train.min()) >= 0
