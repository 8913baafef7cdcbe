"""slide_hf.hub: `--model org/name` from the local Hub cache, offline-aware, one line when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from slide_hf.errors import UserError
from slide_hf.hub import is_hub_id, resolve_hub_model


def _cache_snapshot(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """Lay out a Hub cache entry the way huggingface_hub writes one (refs/main -> snapshots/<commit>)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Qwen/Qwen3-8B", True), ("meta-llama/Llama-3.1-8B", True), ("tiny-llama", False), ("a/b/c", False)],
)
def test_is_hub_id(name, expected):
    assert is_hub_id(name) is expected


def test_an_existing_local_directory_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/model")


def test_a_cached_model_resolves_without_network(hub_cache):
    snapshot = _cache_snapshot(hub_cache, "acme/tiny", {"config.json": "{}"})
    assert resolve_hub_model("acme/tiny") == snapshot


def test_offline_and_not_cached_is_one_line(hub_cache):
    with pytest.raises(UserError, match=r"^--model acme/absent is not in the local Hub cache and HF_HUB_OFFLINE"):
        resolve_hub_model("acme/absent")


def test_slide_train_uses_the_cached_snapshot(hub_cache, tmp_path, capsys):
    """A cached Hub model is the model directory: `slide train` reads its config (and refuses what it
    lacks, here the tokenizer, in one line naming the snapshot)."""
    from slide_hf import PRESETS
    from slide_hf.cli.main import main

    snapshot = _cache_snapshot(hub_cache, "acme/tiny", {})
    PRESETS["tiny-llama"]().save_pretrained(snapshot)
    status = main(["train", "--model", "acme/tiny", "--device", "cpu", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert f"model directory {snapshot} has no tokenizer files" in err[0]
