"""Write the fp32 masters back out as a Hugging Face model directory, atomically.

The result is what ``save_pretrained`` would write -- ``config.json``, safetensors shards under HF's key
names (a tied matrix once, as the embedding), ``model.safetensors.index.json`` when sharded, optionally
the tokenizer files -- so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it with no missing or
unexpected keys.

A training run exports at the end, after its final checkpoint; a crash half-way must not leave a
directory that looks like a model. So everything is written into a hidden temp directory beside
``out_dir``, fsynced, then renamed into place: the directory appears complete or not at all. Every file
gets the same permissions, those of a new file under the process's umask (0644 under the usual 022), the
weights included. Replacing
an existing export swaps the two directories with one ``renameat2(RENAME_EXCHANGE)`` where the kernel
has it. Every failure (a full disk, ``cancel``, an interrupt) removes the temp directory and raises.

Weights that hold NaN or Inf are refused before anything is written (:class:`NonFiniteWeights`, naming
the first such tensor): such a model loads without complaint and generates garbage.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel
from slide_hf.load import INDEX_FILE, SINGLE_FILE, ModelFilesError
from slide_hf.model import CheckpointEntry, checkpoint_entries, unit_views

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "TOKENIZER_FILES",
    "ExportCancelled",
    "NonFiniteWeights",
    "export_hf",
    "first_nonfinite",
    "resolve_dtype",
    "use_tokenizer_special_tokens",
]

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Copied from ``tokenizer_dir`` when present (plus ``*.tiktoken``). ``generation_config.json`` rides
along: it carries the eos ids and sampling defaults inference wants, and it is not part of the weights."""

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class ExportCancelled(Exception):
    """``cancel`` asked the export to stop; nothing was published and the temp directory is gone."""


class NonFiniteWeights(ValueError):
    """A weight holds NaN or Inf; the message names the first such tensor by its checkpoint key."""


def resolve_dtype(dtype: torch.dtype | str | None, config: PreTrainedConfig | None = None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``None`` means the config's ``dtype`` (``torch_dtype``), else fp32."""
    if dtype is None and config is not None:
        dtype = getattr(config, "dtype", None)  # transformers 5.x; `torch_dtype` is its deprecated alias
    if dtype is None:
        return torch.float32
    found = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype).removeprefix("torch."))
    if found not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"cannot export as {dtype!r}; use float32, bfloat16 or float16")
    return found


def export_hf(
    model: SlideModel,
    host_params: HostParameters,
    config: PreTrainedConfig,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    cancel: Callable[[], bool] | None = None,
) -> Path:
    """Write ``host_params`` as an HF model directory at ``out_dir`` and return its path.

    ``dtype`` defaults to the config's (what the model was published in), else float32. Refuses an
    existing ``out_dir`` (``FileExistsError``) unless ``overwrite``; then the old directory is replaced
    only once the new one is complete. ``cancel`` is polled between shards and before publishing: when it
    returns True the export stops with :class:`ExportCancelled` (a run that got SIGTERM). Write errors,
    including the safetensors writer's, are ``OSError`` s with the system's errno. Memory: one shard (at
    most ``max_shard_bytes``) is materialised at a time.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    target_dtype = resolve_dtype(dtype, config)
    tokenizer_files = _tokenizer_files(Path(tokenizer_dir).expanduser()) if tokenizer_dir is not None else []
    bad = first_nonfinite(model, host_params)
    if bad is not None:
        raise NonFiniteWeights(f"{bad} holds NaN or Inf values; a model with them is not exported")
    stop = cancel or (lambda: False)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        saved = copy.deepcopy(config)
        saved.dtype = target_dtype
        saved.save_pretrained(tmp)
        _write_weights(model, host_params, tmp, target_dtype, max_shard_bytes, stop)
        for file in tokenizer_files:
            shutil.copyfile(file, tmp / file.name)
        mode = _new_file_mode(tmp)
        for file in tmp.iterdir():
            os.chmod(file, mode)  # safetensors creates its files 0600; the rest follow the umask
            _fsync(file)
        _fsync(tmp)
        if stop():
            raise ExportCancelled(f"the export to {out} was cancelled")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def first_nonfinite(model: SlideModel, host_params: HostParameters) -> str | None:
    """The checkpoint key of the first weight holding NaN or Inf, or ``None`` when all are finite.
    One pass over the masters: the export refuses such a model before writing anything."""
    views = unit_views(host_params)
    for entry in checkpoint_entries(model):
        if not bool(torch.isfinite(entry.target(views[entry.unit.name])).all()):
            return entry.key
    return None


def use_tokenizer_special_tokens(config: PreTrainedConfig, tokenizer: Any) -> Any:
    """Make ``config`` carry ``tokenizer``'s bos/eos/pad ids and return a ``GenerationConfig`` with them.

    A preset's config keeps the ids of the model it copies the shape of (Llama's 128000/128001), but a
    preset run trains with the bundled byte tokenizer (256/257/258); exported with the preset's ids,
    ``generate()`` would stop on whatever byte those ids alias. Ids the tokenizer lacks become ``None``."""
    from transformers import GenerationConfig

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for key, value in ids.items():
        setattr(config, key, value)
    return GenerationConfig(**ids)


def _write_weights(
    model: SlideModel,
    host_params: HostParameters,
    directory: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    stop: Callable[[], bool],
) -> None:
    views = unit_views(host_params)
    shapes = {unit.name: unit.layout.views(torch.empty(unit.layout.numel, device="meta")) for unit in model.units}
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[list[CheckpointEntry]]] = [[]]
    shard_bytes = 0
    total = 0
    for parts in _by_key(checkpoint_entries(model)):
        first = parts[0]
        numel = math.prod(first.stored_shape) if first.source else first.target(shapes[first.unit.name]).numel()
        nbytes = numel * itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(parts)
        shard_bytes += nbytes
        total += nbytes

    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        if stop():
            raise ExportCancelled(f"the export to {directory} was cancelled")
        tensors = {parts[0].key: _stored_tensor(parts, views, dtype) for parts in shard}
        _save_shard(tensors, directory / name)
        del tensors
        weight_map.update(dict.fromkeys((parts[0].key for parts in shard), name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _by_key(entries: list[CheckpointEntry]) -> list[list[CheckpointEntry]]:
    """Entries grouped by checkpoint key, in first-seen order: a tensor split across units (entries with
    a ``source`` region) is written once, whole, into one shard."""
    groups: dict[str, list[CheckpointEntry]] = {}
    for entry in entries:
        groups.setdefault(entry.key, []).append(entry)
    return list(groups.values())


def _stored_tensor(
    parts: list[CheckpointEntry], views: Mapping[str, dict[str, torch.Tensor]], dtype: torch.dtype
) -> torch.Tensor:
    """The tensor written under ``parts[0].key``: one entry's view, or the whole tensor assembled from its
    regions (which must cover it exactly once, so no uninitialised memory is ever written)."""
    first = parts[0]
    if not first.source:
        # copy=True: safetensors refuses tensors that share storage, and views of one slab all do.
        return first.target(views[first.unit.name]).to(dtype=dtype, copy=True).contiguous()
    if not _tiles(first.stored_shape, [part.source for part in parts]):
        raise ValueError(f"{first.key}: the units' regions do not cover the stored tensor exactly once")
    whole = torch.empty(first.stored_shape, dtype=dtype)
    for part in parts:
        whole[part.source] = part.target(views[part.unit.name])
    return whole


def _tiles(shape: tuple[int, ...], regions: list[tuple[slice, ...]]) -> bool:
    """Whether the boxes ``regions`` (unit-step slices) are pairwise disjoint and fill ``shape``."""
    boxes = []
    for region in regions:
        box = [s.indices(n)[:2] for s, n in zip(region, shape, strict=False)]
        box += [(0, n) for n in shape[len(region) :]]
        boxes.append(box)
    volume = sum(math.prod(max(0, stop - start) for start, stop in box) for box in boxes)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True)):
                return False
    return volume == math.prod(shape)


def _save_shard(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """``save_file``, with the writer's I/O failures (a Rust ``SafetensorError`` that wraps the OS error,
    "I/O error: No space left on device (os error 28)") raised as the ``OSError`` they are."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except SafetensorError as error:
        code = re.search(r"(?:code: |os error )(\d+)", str(error))
        if code is None:
            raise OSError(errno.EIO, f"cannot write {file.name}: {error}") from error
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(file)) from error


def _tokenizer_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ModelFilesError(f"tokenizer directory {directory} does not exist")
    found = [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    found += sorted(directory.glob("*.tiktoken"))
    if not any(f.name != "generation_config.json" for f in found):
        raise ModelFilesError(f"{directory} has no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...)")
    return found


def _new_file_mode(directory: Path) -> int:
    """The permission bits a new file gets here (0666 less the umask), read from a probe file: asking
    ``os.umask`` means setting it, which would race with every other thread of the process."""
    probe = directory / f".mode-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` is swapped out, then deleted."""
    if out.exists():
        if not _exchange(tmp, out):
            # No atomic exchange (old kernel, non-Linux): a short window where `out` is absent.
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(out, old)
            os.rename(tmp, out)
            tmp = old
        _remove(tmp)  # `tmp` now holds the previous export
    else:
        os.rename(tmp, out)
    _fsync(out.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")
