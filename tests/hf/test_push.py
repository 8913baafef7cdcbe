"""`slide train --push-to-hub`: checked before training, pushed at the end, and a failed push retried by
`slide export RUN --push-to-hub REPO` without exporting again. No test reaches the network: ``HfApi`` is
replaced by a recorder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from slide_hf.cli.main import main
from slide_hf.errors import UserError
from slide_hf.options import TrainConfig

TRAIN = ["train", "--device", "cpu", "--dtype", "float32", "--steps", "2", "--seq-len", "32"]
DATA_CACHE = ".data-cache"


class _Hub:
    """Records each call ``HfApi`` gets, and what the run directory held at that moment."""

    calls: ClassVar[list[tuple[Any, ...]]] = []
    run: ClassVar[Path | None] = None
    fail_upload: ClassVar[BaseException | None] = None

    def create_repo(self, repo_id: str, *, private: bool, exist_ok: bool, repo_type: str) -> str:
        tokenized = self.run is not None and (self.run / DATA_CACHE).exists()
        self.calls.append(("create", repo_id, private, exist_ok, repo_type, tokenized))
        return f"https://hub.example/{repo_id}"

    def upload_folder(self, *, folder_path: str, repo_id: str, repo_type: str, commit_message: str) -> None:
        if self.fail_upload is not None:
            raise self.fail_upload
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload", repo_id, Path(folder_path), files, commit_message))


@pytest.fixture
def hub(tmp_path, monkeypatch, torch_kernels):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.HfApi", _Hub)
    monkeypatch.setattr(_Hub, "calls", [])
    monkeypatch.setattr(_Hub, "run", tmp_path / "run")
    monkeypatch.setattr(_Hub, "fail_upload", None)
    return _Hub


def _http_error(status: int, text: str) -> BaseException:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    request = httpx.Request("POST", "https://hub.example/api/repos/create")
    return HfHubHTTPError(text, response=httpx.Response(status, request=request))


def test_a_run_pushes_its_model_at_the_end(hub, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TRAIN, "--output", str(run), "--push-to-hub", "me/tiny", "--hub-private"]
    assert main(argv) == 0
    first, *_, upload = hub.calls
    # The repository was created before the data was read, then the export went up at the end.
    assert first == ("create", "me/tiny", True, True, "model", False)
    assert upload[:3] == ("upload", "me/tiny", run / "model")
    assert "config.json" in upload[3] and "model.safetensors" in upload[3]
    assert upload[4] == "slide train: run, step 2"


def test_offline_is_refused_before_anything_is_read(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_HUB_OFFLINE is set" in err[0] and "--push-to-hub me/tiny" in err[0]
    assert hub.calls == [] and not (run / DATA_CACHE).exists()


def test_a_repository_the_token_cannot_create_is_refused_before_training(hub, tmp_path, monkeypatch, capsys):
    def refuse(self, repo_id, **kwargs):
        raise _http_error(401, "401 Client Error: Unauthorized (invalid token)")

    monkeypatch.setattr(_Hub, "create_repo", refuse)
    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot create the repository" in err[0] and "nothing was trained" in err[0]
    assert not (run / DATA_CACHE).exists() and not (run / "checkpoints").exists()


def test_a_failed_push_keeps_the_run_and_the_export_retries_it(hub, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setattr(_Hub, "fail_upload", _http_error(500, "500 Server Error: Internal Server Error"))
    assert main([*TRAIN, "--output", str(run), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"the model stays in {run / 'model'}" in err[0]
    assert f"push it with `slide export {run} --push-to-hub me/tiny`" in err[0]
    assert (run / "model" / "config.json").is_file() and any((run / "checkpoints").glob("step-*"))
    written = {p.name: p.stat().st_mtime_ns for p in (run / "model").iterdir()}

    monkeypatch.setattr(_Hub, "fail_upload", None)
    monkeypatch.setattr(_Hub, "calls", [])
    assert main(["export", str(run), "--push-to-hub", "me/tiny"]) == 0  # no --overwrite, no OUTPUT
    (create, upload) = hub.calls
    assert create[:3] == ("create", "me/tiny", False)
    assert upload[:3] == ("upload", "me/tiny", run / "model") and upload[4] == "slide train: run, step 2"
    assert {p.name: p.stat().st_mtime_ns for p in (run / "model").iterdir()} == written  # pushed as it was
    assert "pushed" in capsys.readouterr().out


def test_the_retry_exports_a_run_whose_final_export_is_missing(hub, tmp_path, monkeypatch, capsys):
    import shutil

    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run)]) == 0
    shutil.rmtree(run / "model")  # as a final export that failed (a full disk) leaves the run
    assert main(["export", str(run), "--push-to-hub", "me/tiny", "--private"]) == 0
    create, upload = hub.calls
    assert create[:3] == ("create", "me/tiny", True)
    assert upload[2] == run / "model" and "model.safetensors" in upload[3]
    assert (run / "model" / "config.json").is_file()


def test_the_retry_of_a_run_without_a_finished_model_says_what_to_export(hub, tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run), "--save-every", "1"]) == 0
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[0]
    capsys.readouterr()
    assert main(["export", str(checkpoint), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is one checkpoint; name an OUTPUT directory" in err[0]
    assert main(["export", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs an OUTPUT directory" in err[0]
    assert hub.calls == []


def test_a_finished_run_resumed_with_push_to_hub_pushes_its_model(hub, tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run)]) == 0
    assert main(["train", "--resume", str(run), "--push-to-hub", "me/tiny"]) == 0
    assert [call[0] for call in hub.calls] == ["create", "create", "upload"]
    assert hub.calls[-1][2] == run / "model"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"push_to_hub": "not a repo"}, "--push-to-hub 'not a repo' is not a Hub repository id (org/name)"),
        ({"push_to_hub": "a/b/c"}, "--push-to-hub 'a/b/c' is not a Hub repository id"),
        ({"push_to_hub": ""}, "--push-to-hub must be non-empty text"),
        ({"hub_private": True}, "--hub-private applies to the repository of --push-to-hub REPO"),
    ],
)
def test_bad_push_options_are_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match="^" + re.escape(message)):
        TrainConfig(**values)


def test_the_retry_never_pushes_a_model_older_than_the_run(hub, tmp_path, monkeypatch, capsys):
    """A run resumed with more --steps whose export failed keeps the old model/; the retry refuses it
    (its slide-export.json names the older step) instead of pushing it as the newest step."""
    import json

    import slide_hf.recipe

    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run)]) == 0
    assert json.loads((run / "model" / "slide-export.json").read_text()) == {"step": 2}

    def full_disk(*args, **kwargs):
        raise UserError(f"cannot write the model to {run / 'model'}: No space left on device")

    monkeypatch.setattr(slide_hf.recipe, "export_run_model", full_disk)
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 2
    monkeypatch.undo()
    monkeypatch.setattr("huggingface_hub.HfApi", _Hub)
    capsys.readouterr()
    assert main(["export", str(run), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the export of step 2, not the run's newest checkpoint (step 3)" in err[0], err
    assert f"`slide export {run} {run / 'model'} --overwrite --push-to-hub me/tiny`" in err[0]
    assert not [call for call in hub.calls if call[0] == "upload"]


def test_the_hub_code_checks_the_repository_id_only_where_no_option_did(hub, tmp_path, monkeypatch):
    """`slide train` checks it with its options (slide_hf/options/config.py), so neither the check
    before training nor the push at the end checks it again; `slide export RUN --push-to-hub` checks it once."""
    import sys

    import slide_hf.hub

    checked: list[str] = []
    check = slide_hf.hub.check_repo_id

    def counted(repo_id: str, **kwargs: Any) -> None:
        if sys._getframe(1).f_globals.get("__name__") == "slide_hf.hub":
            checked.append(repo_id)
        check(repo_id, **kwargs)

    monkeypatch.setattr(slide_hf.hub, "check_repo_id", counted)
    run = tmp_path / "run"
    assert main([*TRAIN, "--output", str(run), "--push-to-hub", "me/tiny"]) == 0
    assert checked == []
    assert main(["export", str(run), "--push-to-hub", "me/tiny"]) == 0
    assert checked == ["me/tiny"]
    assert [call[0] for call in hub.calls] == ["create", "create", "upload", "create", "upload"]
