"""``--model org/name``: a Hugging Face Hub model, found in the local cache first.

A name that is neither an existing directory nor a preset, and looks like a Hub repository id, resolves
through ``huggingface_hub`` (a dependency of transformers): the cached snapshot when there is one (no
network, so a cluster node without internet works from a pre-filled cache), else a download of the files
a fine-tune needs (config, safetensors weights, tokenizer and generation config). ``HF_HUB_OFFLINE=1``
forbids the download. Every failure is one line that says what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = ["MODEL_FILES", "is_hub_id", "push_to_hub", "resolve_hub_model"]

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
    """``org/name`` with Hub-legal characters, and not a path that exists here."""
    return bool(_HUB_ID.match(name)) and not Path(name).expanduser().exists() and ".." not in name


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


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False, message: str) -> str:
    """Upload an exported model directory to the Hub repository ``repo_id`` (created if needed); returns
    the repository's URL. The export stays on disk whatever happens: a failed push is one line and can be
    retried with the same command."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if not _HUB_ID.match(repo_id):
        raise UserError(f"--push-to-hub {repo_id!r} is not a Hub repository id (org/name)")
    if _offline():
        raise UserError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set; the model stays in {folder}")
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message)
    except _network_errors() as error:  # no route, DNS, proxy, timeout: the Hub was never reached
        raise UserError(
            f"cannot reach the Hub at {_hub_host(api)} to push {repo_id} ({_first_line(error)}); check the network "
            f"(or HF_ENDPOINT) and push again; the model stays in {folder}"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot push to {repo_id} ({first}); the model stays in {folder}") from None
    return str(url)
