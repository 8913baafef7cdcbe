"""`slide export`: a checkpoint of a run becomes an HF directory that transformers loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slide_hf.cli.main import main


@pytest.fixture(autouse=True)
def _torch_loss(monkeypatch):
    monkeypatch.setenv("SLIDE_KERNELS_BACKEND", "torch")  # the CPU user's path, not the interpreter


def test_export_a_mid_run_checkpoint(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    args = ["train", "--output", str(run), "--steps", "4", "--seq-len", "32", "--dtype", "float32"]
    assert main([*args, "--save-every", "2", "--keep-checkpoints", "3"]) == 0
    out = tmp_path / "step2"
    assert main(["export", str(run / "checkpoints" / "step-00000002"), str(out)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size
    # The newest checkpoint (step 4) equals the model the run exported at its end.
    latest = tmp_path / "latest"
    assert main(["export", str(run), str(latest), "--save-dtype", "float32"]) == 0
    final = {k: v for f in (run / "model").glob("*.safetensors") for k, v in load_file(f).items()}
    exported = {k: v for f in latest.glob("*.safetensors") for k, v in load_file(f).items()}
    assert final.keys() == exported.keys()
    assert all(torch.equal(final[k], exported[k]) for k in final)
    # Step 2 differs from step 4: the export really read the older checkpoint.
    older = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(not torch.equal(older[k], final[k]) for k in final)


def test_export_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint found" in err[0]
