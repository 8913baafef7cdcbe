"""A resumed DPO run finds its reference pass however its source was named: ``--init-from`` (not restored
on resume), a model directory whose files were touched since, and a damaged pass file is one line (Note [A
resume reads the reference's fingerprint] in slide_hf/preference/reference.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import slide_hf
from slide_hf.errors import UserError

COMMON: dict[str, Any] = {"device": "cpu", "seq_len": 128, "batch_size": 2, "lr": 1e-3, "dtype": "float32"}


def _pairs(path: Path) -> Path:
    records = [{"prompt": f"What is {i}+{i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}."} for i in range(8)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _sft_run(tmp_path: Path) -> Path:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}."}) + "\n" for i in range(8)))
    slide_hf.train("tiny-llama", data=chats, output=tmp_path / "sft", steps=1, packing=False, **COMMON)
    return tmp_path / "sft"


def _dpo(data: Path, output: Path, model: str | Path = "tiny-llama", **options: Any) -> None:
    """One DPO step on ``data`` into ``output``."""
    slide_hf.train(model, data=data, output=output, steps=1, objective="dpo", **{**COMMON, **options})


def _saved_pass(run: Path) -> Path:
    (saved,) = (run / ".data-cache/reference").glob("logps-*.pt")
    return saved


def _resume(run: Path, caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    caplog.clear()
    with caplog.at_level("INFO", logger="slide.train"):
        slide_hf.train(resume=run, steps=2, on_step=records.append)
    assert not any("reference pass:" in line for line in caplog.messages)  # read, not run again
    return records


@pytest.mark.slow
def test_a_dpo_run_from_init_from_resumes_with_its_reference_pass(tmp_path, caplog):
    """The two-stage recipe (SFT, then DPO ``--init-from`` its run): the resume is not given --init-from
    again, and its reference pass was named by it. It was refused as "not in" its folder, where it was."""
    sft = _sft_run(tmp_path)
    data = _pairs(tmp_path / "pairs.jsonl")
    run = tmp_path / "dpo"
    _dpo(data, run, init_from=sft, init_weights_only=True)
    stamp = _saved_pass(run).stat().st_mtime_ns
    records = _resume(run, caplog)
    assert [r["step"] for r in records] == [2]
    assert _saved_pass(run).stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_a_touched_model_directory_does_not_lose_the_reference_pass(tmp_path, caplog):
    """The pass's name fingerprints the model directory's files by size and time: an edited README, or a
    config.json whose time changed, named a pass never made, and the resume was refused."""
    model = _sft_run(tmp_path) / "model"
    data = _pairs(tmp_path / "pairs.jsonl")
    run = tmp_path / "dpo"
    _dpo(data, run, model)
    (model / "README.md").write_text("notes the user added after the run started\n")
    os.utime(model / "config.json", ns=(1, 1))
    assert [r["step"] for r in _resume(run, caplog)] == [2]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "empty", "another run's"])
def test_a_damaged_reference_pass_is_one_line_naming_it(tmp_path, damage):
    data = _pairs(tmp_path / "pairs.jsonl")
    run = tmp_path / "dpo"
    _dpo(data, run)
    saved = _saved_pass(run)
    if damage == "truncated":
        saved.write_bytes(saved.read_bytes()[:100])
    elif damage == "empty":
        saved.write_bytes(b"")
    else:
        import torch

        torch.save(torch.zeros(3), saved)
    with pytest.raises(UserError) as caught:
        slide_hf.train(resume=run, steps=2)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{saved} is not a reference pass of this run's pairs (")
    assert message.endswith("start the run anew (with overwrite=)")


@pytest.mark.slow
def test_overwrite_never_removes_the_ref_model(tmp_path):
    """``--ref-model`` inside the ``--output`` that ``--overwrite`` clears: refused before anything is
    removed, as ``--model`` there is. It was removed, then the run failed for want of it."""
    sft = _sft_run(tmp_path)
    data = _pairs(tmp_path / "pairs.jsonl")
    with pytest.raises(UserError, match=r"ref.model"):
        _dpo(data, sft, overwrite=True, ref_model=sft / "model")
    assert (sft / "model" / "config.json").is_file()


@pytest.mark.slow
def test_a_relative_ref_model_resumes_from_another_directory(tmp_path, monkeypatch, caplog):
    """``--ref-model`` is kept as an absolute path, as ``--model`` and ``--data`` are: a resume started in
    another directory finds it, and takes the same directory named by its absolute path (it was kept as
    given, so the resume was refused: "--ref-model was 'sft/model' ... and is '/.../sft/model' now")."""
    _sft_run(tmp_path)
    data = _pairs(tmp_path / "pairs.jsonl")
    monkeypatch.chdir(tmp_path)
    _dpo(data, tmp_path / "dpo", ref_model=Path("sft/model"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert [r["step"] for r in _resume(tmp_path / "dpo", caplog)] == [2]
    records: list[dict[str, Any]] = []
    slide_hf.train(resume=tmp_path / "dpo", steps=3, ref_model=tmp_path / "sft/model", on_step=records.append)
    assert [r["step"] for r in records] == [3]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_attention_heads", 8),
        ("rope_parameters", {"rope_theta": 1e6, "rope_type": "default"}),
        ("vocab_size", 320),
    ],
)
def test_a_ref_model_of_another_architecture_is_one_line(tmp_path, key, value):
    """The reference's weights run through the model's own layers: a config.json that differs in heads,
    RoPE base or vocabulary was ignored (or failed in the load naming neither option nor directory)."""
    sft = _sft_run(tmp_path)
    config = json.loads((sft / "model/config.json").read_text())
    config[key] = value
    (sft / "model/config.json").write_text(json.dumps(config))
    data = _pairs(tmp_path / "pairs.jsonl")
    with pytest.raises(UserError) as caught:
        _dpo(data, tmp_path / "dpo", ref_model=sft / "model")
    assert str(caught.value).startswith(f"ref_model= {sft / 'model'} is not the model's architecture: its {key} is ")
    assert not (tmp_path / "dpo" / ".data-cache").exists()
