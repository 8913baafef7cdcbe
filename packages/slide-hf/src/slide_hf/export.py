"""Write the fp32 masters back out as a Hugging Face model directory, atomically.

The result is what ``save_pretrained`` would write -- ``config.json``, safetensors shards under HF's key
names (a tied matrix once, as the embedding), ``model.safetensors.index.json`` when sharded, optionally
the tokenizer files -- so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it with no missing or
unexpected keys.

A training run exports at the end (or on a signal); a crash half-way must not leave a directory that
looks like a model. So everything is written into a hidden temp directory beside ``out_dir``, fsynced,
then renamed into place: the directory appears complete or not at all. Replacing an existing export
swaps the two directories with one ``renameat2(RENAME_EXCHANGE)`` where the kernel has it.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel
from slide_hf.load import INDEX_FILE, SINGLE_FILE, ModelFilesError
from slide_hf.model import CheckpointEntry, checkpoint_entries, unit_views

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "TOKENIZER_FILES", "export_hf", "resolve_dtype"]

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
) -> Path:
    """Write ``host_params`` as an HF model directory at ``out_dir`` and return its path.

    ``dtype`` defaults to the config's (what the model was published in), else float32. Refuses an
    existing ``out_dir`` unless ``overwrite``; then the old directory is replaced only once the new one is
    complete. Memory: one shard (at most ``max_shard_bytes``) is materialised at a time.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True to replace it")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    target_dtype = resolve_dtype(dtype, config)
    tokenizer_files = _tokenizer_files(Path(tokenizer_dir).expanduser()) if tokenizer_dir is not None else []

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        saved = copy.deepcopy(config)
        saved.dtype = target_dtype
        saved.save_pretrained(tmp)
        _write_weights(model, host_params, tmp, target_dtype, max_shard_bytes)
        for file in tokenizer_files:
            shutil.copyfile(file, tmp / file.name)
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_weights(
    model: SlideModel, host_params: HostParameters, directory: Path, dtype: torch.dtype, max_shard_bytes: int
) -> None:
    entries = checkpoint_entries(model)
    views = unit_views(host_params)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[CheckpointEntry]] = [[]]
    shard_bytes = 0
    total = 0
    for entry in entries:
        nbytes = entry.target(views[entry.unit.name]).numel() * itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
        total += nbytes

    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        # copy=True: safetensors refuses tensors that share storage, and views of one slab all do.
        tensors = {e.key: e.target(views[e.unit.name]).to(dtype=dtype, copy=True).contiguous() for e in shard}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys((e.key for e in shard), name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _tokenizer_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ModelFilesError(f"tokenizer directory {directory} does not exist")
    found = [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    found += sorted(directory.glob("*.tiktoken"))
    if not any(f.name != "generation_config.json" for f in found):
        raise ModelFilesError(f"{directory} has no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...)")
    return found


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
