"""``--model org/name``: a Hugging Face Hub model, found in the local cache first.

A name that is neither an existing directory nor a preset, and looks like a Hub repository id, resolves
through ``huggingface_hub`` (a dependency of transformers): the cached snapshot when there is one (no
network, so a cluster node without internet works from a pre-filled cache), else a download of the files
a fine-tune needs (config, safetensors weights, tokenizer and generation config). ``HF_HUB_OFFLINE=1``
forbids the download. Every failure is one line that says what to do.

The other way, ``--push-to-hub org/name`` uploads an exported model: `slide export`'s output, or the
model `slide train` writes at the end of a run. A run checks what it can before training starts (the
repository id, ``HF_HUB_OFFLINE``, and that the repository can be created with the credentials at hand),
so an hour of training does not end in a refusal it could have had at once. A push that fails at the end
leaves the run as it is and names the command that retries it, `slide export RUN --push-to-hub REPO`,
which pushes the run's finished model without exporting it again.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "MODEL_FILES",
    "check_repo_id",
    "finished_model",
    "is_hub_id",
    "prepare_push",
    "push_run_model",
    "push_to_hub",
    "resolve_hub_model",
    "retry_command",
]

MODEL_FILES = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.jinja",
    "*.txt",
    "*.tiktoken",
)
"""What a download fetches: configs, safetensors weights and tokenizer files; never ``.bin`` or ``.pth``
copies of the same weights, which would double the download."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(name: str) -> bool:
    """``org/name`` with Hub-legal characters, and not a path here: not even a broken symbolic link or a
    loop of them (``exists`` follows links and says False for those; a local name is never sent to the
    network)."""
    return bool(_HUB_ID.match(name)) and not os.path.lexists(Path(name).expanduser()) and ".." not in name


def check_repo_id(repo_id: str, *, flag: str = "--push-to-hub") -> None:
    """Refuse, in one line, a repository id the Hub cannot have (it must be ``org/name``)."""
    if not _HUB_ID.match(repo_id) or ".." in repo_id:
        raise UserError(f"{flag} {repo_id!r} is not a Hub repository id (org/name)")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(repo_id: str, *, revision: str | None = None) -> Path:
    """The local directory of ``repo_id``'s snapshot: cached, or downloaded unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached: download below, unless offline
    except (OSError, ValueError) as error:
        raise UserError(f"{option('model', repo_id)}: the local Hub cache entry is unreadable ({error})") from None
    if _offline():
        raise UserError(
            f"{option('model', repo_id)} is not in the local Hub cache and HF_HUB_OFFLINE is set; download it on a "
            f"machine with network (huggingface-cli download {repo_id}) or pass a model directory"
        )
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(MODEL_FILES)))
    except RepositoryNotFoundError:
        raise UserError(
            f"{option('model', repo_id)}: no such model on the Hub, or it is private (log in with hf auth login)"
        ) from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{option('model', repo_id)}: cannot download from the Hub ({first})") from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """The transport failures of the HTTP clients huggingface_hub may use (httpx now, requests before)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import httpx

        found.append(httpx.TransportError)
    except ImportError:
        pass
    try:
        import requests

        found += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    except ImportError:
        pass
    return tuple(found)


def _hub_host(api: object) -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = str(getattr(api, "endpoint", None) or constants.ENDPOINT)
    return urlparse(endpoint).netloc or endpoint


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


@contextlib.contextmanager
def _hub_errors(unreachable: str, refused: str, then: str, *, refused_then: str | None = None) -> Iterator[None]:
    """The Hub calls of a push, each failure one line: ``unreachable (error); check the network ...;
    then`` for a transport failure (the Hub was never reached), ``refused (error); then`` (or
    ``refused_then``) for an answer of the Hub or a local read error."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except _network_errors() as error:  # no route, DNS, proxy, timeout
        raise UserError(f"{unreachable} ({_first_line(error)}); check the network (or HF_ENDPOINT); {then}") from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise UserError(f"{refused} ({_first_line(error)}); {refused_then or then}") from None


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False, message: str, retry: str | None = None) -> str:
    """Upload an exported model directory to the Hub repository ``repo_id`` (created if needed); returns
    the repository's URL. The export stays on disk whatever happens: a failed push is one line and can be
    retried with the same command, or with ``retry`` where another one is needed."""
    check_repo_id(repo_id)
    return _upload(folder, repo_id, private=private, message=message, retry=retry)


def _upload(folder: Path, repo_id: str, *, private: bool, message: str, retry: str | None) -> str:
    """:func:`push_to_hub` of a ``repo_id`` already checked where it entered (`slide train`'s options,
    :func:`finished_model`)."""
    from huggingface_hub import HfApi

    kept = f"the model stays in {folder}" + (f"; push it with `{retry}`" if retry else "")
    if _offline():
        raise UserError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set; {kept}")
    api = HfApi()
    unreachable = f"cannot reach the Hub at {_hub_host(api)} to push {repo_id}"
    with _hub_errors(unreachable, f"cannot push to {repo_id}", ("" if retry else "push again; ") + kept):
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message)
    return str(url)


def prepare_push(repo_id: str, *, private: bool = False) -> None:
    """Before a run trains: refuse ``HF_HUB_OFFLINE`` and make sure the repository exists (created as the
    HF Trainer creates it at the start, ``exist_ok``), so a missing login, a token without write access or
    a name the user may not write is one line now rather than after the training. ``repo_id`` was checked
    with the run's options."""
    from huggingface_hub import HfApi

    flag = f"--push-to-hub {repo_id}"
    if _offline():
        raise UserError(
            f"{flag}: HF_HUB_OFFLINE is set, so the model could not be pushed at the end; unset it, or train "
            "without --push-to-hub and push later with `slide export RUN --push-to-hub REPO`"
        )
    api = HfApi()
    login = "log in with a token that can write it (hf auth login, or HF_TOKEN); nothing was trained"
    with _hub_errors(
        f"{flag}: cannot reach the Hub at {_hub_host(api)}",
        f"{flag}: cannot create the repository",
        "nothing was trained",
        refused_then=login,
    ):
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")


def retry_command(run: Path, repo_id: str, *, private: bool = False) -> str:
    """The command that pushes ``run``'s finished model again (:func:`finished_model`)."""
    return f"slide export {run} --push-to-hub {repo_id}" + (" --private" if private else "")


def push_run_model(run: Path, model: Path, repo_id: str, *, private: bool, step: int) -> str:
    """Push the model a run of ``run`` exported at its end (``step``); a failure is one line that says the
    run is complete and names the command that retries the push."""
    message = f"slide train: {run.name}, step {step}"
    return _upload(model, repo_id, private=private, message=message, retry=retry_command(run, repo_id, private=private))


def finished_model(source: Path, repo_id: str | None) -> tuple[Path, int | None]:
    """What `slide export RUN --push-to-hub REPO` (no OUTPUT) pushes: the run's own ``model/`` and the
    step it holds when it is the export of the run's newest checkpoint, or with ``--save-best`` of its best
    one (slide_hf/model_checkpoint.py; then it is pushed as it is: no export again, no ``--overwrite``), or
    ``(RUN/model, None)`` when the run has no model yet (a failed final export): that checkpoint is
    exported there first. The step a ``model/`` holds is the one
    its export wrote down (``slide-export.json``, slide_hf/run_files.py); a ``model/`` of another step or
    of none it names (a run resumed with more ``--steps`` whose export failed keeps the old one) is not
    what the run is now, and is refused with the command that exports the newest."""
    from slide_core.checkpoint import CheckpointCorrupt
    from slide_hf.model_checkpoint import model_checkpoint
    from slide_hf.resume import corrupt_message
    from slide_hf.run_files import EXPORT_STAMP, exported_step

    if repo_id is None:
        raise UserError(
            "slide export needs an OUTPUT directory to write, or --push-to-hub REPO to push the run's own model"
        )
    check_repo_id(repo_id)
    if (source / "state.json").exists():
        raise UserError(
            f"{source} is one checkpoint; name an OUTPUT directory to export it into, then it is pushed: "
            f"`slide export {source} OUT --push-to-hub {repo_id}`"
        )
    if not (source / "config" / "config.json").is_file():
        raise UserError(f"{source} is not the output directory of a slide train run (it has no config/config.json)")
    try:
        chosen = model_checkpoint(source)  # the newest, or with --save-best the best (slide_hf/model_checkpoint.py)
    except CheckpointCorrupt as error:
        raise UserError(corrupt_message(error, lambda intact: f"export it with `slide export {intact} OUT`")) from None
    step = chosen.step
    model = source / "model"
    if not model.exists():
        return model, None
    if not ((model / "config.json").is_file() and any(model.glob("*.safetensors"))):
        raise UserError(f"{model} holds no exported model (config.json and safetensors); move it aside and retry")
    exported = exported_step(model)
    if exported != step:
        held = f"the export of step {exported}" if exported is not None else f"no {EXPORT_STAMP} naming its step"
        raise UserError(
            f"{model} holds {held}, not {chosen.describe()}; export that one and push it: "
            f"`slide export {source} {model} --overwrite --push-to-hub {repo_id}`"
        )
    return model, step
