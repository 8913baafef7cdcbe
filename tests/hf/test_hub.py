"""slide_hf.hub: `--model org/name` from the local Hub cache, offline-aware, one line when it cannot."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

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


class _FakeApi:
    """Records what `slide export --push-to-hub` asks of the Hub; no network."""

    calls: ClassVar[list[tuple]] = []

    def create_repo(self, repo_id, private, exist_ok, repo_type):
        self.calls.append(("create", repo_id, private, exist_ok, repo_type))
        return f"https://hub.example/{repo_id}"

    def upload_folder(self, folder_path, repo_id, repo_type, commit_message):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload", repo_id, files, commit_message))


@pytest.fixture
def trained_run(tmp_path, torch_kernels):
    from slide_hf.cli.main import main

    run = tmp_path / "run"
    argv = ["train", "--device", "cpu", "--dtype", "float32", "--steps", "1", "--seq-len", "32", "--output", str(run)]
    assert main(argv) == 0
    return run


def test_export_pushes_the_exported_folder(trained_run, tmp_path, monkeypatch, capsys):
    from slide_hf.cli.main import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    _FakeApi.calls = []
    monkeypatch.setattr("huggingface_hub.HfApi", _FakeApi)
    out = tmp_path / "export"
    assert main(["export", str(trained_run), str(out), "--push-to-hub", "me/tiny", "--private"]) == 0
    create, upload = _FakeApi.calls
    assert create == ("create", "me/tiny", True, True, "model")
    assert upload[1] == "me/tiny" and "config.json" in upload[2] and "model.safetensors" in upload[2]
    assert upload[3] == "slide export of step 1"
    assert "pushed" in capsys.readouterr().out


def test_push_offline_is_one_line_and_keeps_the_export(trained_run, tmp_path, monkeypatch, capsys):
    from slide_hf.cli.main import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "export"
    assert main(["export", str(trained_run), str(out), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_HUB_OFFLINE is set; the model stays in" in err[0]
    assert (out / "config.json").is_file()


def test_export_overwrite_replaces_only_a_model_directory(trained_run, tmp_path, capsys):
    from slide_hf.cli.main import main

    out = tmp_path / "export"
    assert main(["export", str(trained_run), str(out)]) == 0
    assert main(["export", str(trained_run), str(out)]) == 2  # exists
    assert main(["export", str(trained_run), str(out), "--overwrite"]) == 0
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep")
    capsys.readouterr()
    assert main(["export", str(trained_run), str(notes), "--overwrite"]) == 2
    assert "replaces only a model directory" in capsys.readouterr().err
    assert (notes / "mine.txt").read_text() == "keep"


class _UnreachableApi(_FakeApi):
    """A Hub client on a machine without network: the connection itself fails, as httpx reports it."""

    endpoint = "https://hub.example.org"

    def create_repo(self, repo_id, private, exist_ok, repo_type):
        import httpx

        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")


def test_push_without_a_network_is_one_line_naming_the_host_and_repo(trained_run, tmp_path, monkeypatch, capsys):
    from slide_hf.cli.main import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.HfApi", _UnreachableApi)
    out = tmp_path / "export"
    assert main(["export", str(trained_run), str(out), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        "slide export: error: cannot reach the Hub at hub.example.org to push me/tiny (ConnectError"
    )
    assert f"the model stays in {out}" in err[0] and "internal error" not in err[0]
    assert (out / "config.json").is_file()
