"""Read an HF model directory: its config, and its safetensors weights streamed into the fp32 masters.

The model is never built in RAM. Each tensor goes from the file straight into its host view
(``view.copy_``, converting bf16 -> fp32 on the way), a bounded chunk at a time. safetensors reads
through ``mmap``; pages a mapping has touched count in the process's resident set until it is unmapped,
so the reader re-opens the file whenever it has copied ``budget`` bytes: peak memory stays the fp32 slab
plus a few budgets (0.5% of the slab each, 1 to 64 MiB), however large the shards.

Every way a weights directory can be wrong -- a truncated or garbled shard, an index naming absent
files, PyTorch ``.bin`` files only, a tensor of the wrong shape or an integer dtype, NaN or Inf values --
raises :class:`CheckpointError` or :class:`ModelFilesError` (both ``ValueError`` s) with one line naming
the file and the tensor; the safetensors reader's own ``SafetensorError`` never escapes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel
from slide_hf.model import CheckpointEntry, checkpoint_entries

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["CheckpointError", "ModelFilesError", "load_config", "load_weights"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_BUDGET_DIVISOR = 200
_MIN_BUDGET = 1 << 20
_MAX_BUDGET = 64 << 20
"""Bytes copied between re-maps: 0.5% of the slab, within [1, 64] MiB. Mapped pages, the chunk being
converted and what the allocator keeps of freed chunks each stay around this size."""


class CheckpointError(ValueError):
    """The checkpoint does not match the model: a missing key, a wrong shape, an unusable dtype."""


class ModelFilesError(FileNotFoundError, ValueError):
    """A model directory, its ``config.json`` or its weights are missing.

    Both a ``FileNotFoundError`` (what it is) and a ``ValueError`` (what callers that turn bad user
    input into one-line messages catch, like every other error of this package).
    """


def load_config(model_dir: str | os.PathLike[str]) -> PreTrainedConfig:
    """The HF config of a local model directory (no network).

    Raises :class:`ModelFilesError` for a missing directory or ``config.json``,
    :class:`~slide_hf.config_fields.ConfigFieldError` for a size no model can have (slide_hf/config_fields.py)
    and ``ValueError`` for a config transformers cannot read, each with a one-line message.
    """
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ModelFilesError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelFilesError(f"{path} has no config.json; is it a Hugging Face model directory?")
    _check_sizes(path / "config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError, AttributeError, _StrictError) as exc:  # garbled, wrong type
        cause = exc.__cause__ if isinstance(exc, _StrictError) and exc.__cause__ is not None else exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ValueError(f"cannot read {path / 'config.json'}: {first}") from exc


try:  # transformers' configs are strict dataclasses: a field of the wrong type fails in huggingface_hub
    from huggingface_hub.errors import StrictDataclassError as _StrictError
except ImportError:  # an older huggingface_hub: its configs raise ValueError and TypeError only

    class _StrictError(Exception):  # type: ignore[no-redef]
        """Never raised."""


def _check_sizes(config_file: Path) -> None:
    """The sizes in ``config_file`` by :func:`~slide_hf.config_fields.check_config_fields` (one line naming
    the file and the field), before transformers builds a config from them; a file that is not a JSON
    object is left to transformers' own error."""
    from slide_hf.config_fields import check_config_fields

    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(values, dict):
        check_config_fields(values, config_file)


def load_weights(model: SlideModel, host_params: HostParameters, model_dir: str | os.PathLike[str]) -> None:
    """Stream the safetensors weights in ``model_dir`` into ``host_params``.

    Every tensor the model needs must be present with the right shape; that is checked from the file
    headers before any weight is written. Extra tensors are ignored, which covers tied checkpoints that
    also store ``lm_head.weight``; a tied model never asks for it.
    """
    path = Path(model_dir).expanduser()
    weight_map = _weight_map(path)
    entries = _prefer_fused(checkpoint_entries(model), weight_map)
    prefix = getattr(model, "base_prefix", "")
    by_file: dict[Path, list[tuple[CheckpointEntry, str]]] = defaultdict(list)
    missing = []
    for entry in entries:
        stored = _find_key(entry.key, weight_map, prefix)
        if stored is None:
            missing.append(entry.key)
        else:
            by_file[path / weight_map[stored]].append((entry, stored))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")

    shapes = {unit.name: unit.layout.views(torch.empty(unit.layout.numel, device="meta")) for unit in model.units}
    for file, items in by_file.items():
        _check_headers(
            file, [(stored, _stored_shape(entry, entry.target(shapes[entry.unit.name]))) for entry, stored in items]
        )
    budget = min(max(host_params.nbytes // _BUDGET_DIVISOR, _MIN_BUDGET), _MAX_BUDGET)
    _copy_unit_by_unit(model, host_params, by_file, budget)


def _copy_unit_by_unit(
    model: SlideModel,
    host_params: HostParameters,
    by_file: Mapping[Path, list[tuple[CheckpointEntry, str]]],
    budget: int,
) -> None:
    """Write every entry, one unit at a time through ``HostParameters.overwriting`` (a split master is
    encoded per unit, so loading never holds more than one unit's fp32 copy besides the master). Each file's
    reader stays open from the first unit that reads it to the last.

    Why ``overwriting``, which does not decode the unit first: the entries of a unit cover every one of its
    parameters (:func:`~slide_hf.model.checkpoint_entries` lists each, whole or in pieces), so nothing
    decoded would survive; and decoding planes nothing has written yet makes the writes after it take a
    copy-on-write fault per page. Loading a 0.98 B-parameter Llama into a split master took 14.0-14.3 s
    with the decode and 4.6-4.7 s without on the development machine (fp32: 2.3-3.0 s; `python
    bench/master_setup.py`, docs/benchmarks.md, "Filling the host master")."""
    source = {id(entry): (file, stored) for file, items in by_file.items() for entry, stored in items}
    order = {unit.name: index for index, unit in enumerate(model.units)}
    last_use = {file: max(order[entry.unit.name] for entry, _ in items) for file, items in by_file.items()}
    by_unit: dict[str, list[CheckpointEntry]] = defaultdict(list)
    for items in by_file.values():
        for entry, _ in items:
            by_unit[entry.unit.name].append(entry)
    readers: dict[Path, _ShardReader] = {}
    with torch.no_grad():
        for index, unit in enumerate(model.units):
            if by_unit.get(unit.name):
                with host_params.overwriting(unit) as views:
                    for entry in by_unit[unit.name]:
                        file, stored = source[id(entry)]
                        reader = readers.get(file) or readers.setdefault(file, _ShardReader(file, budget))
                        with _readable(file):
                            reader.copy_into(stored, entry.target(views), entry.source)
            for file in [file for file, last in last_use.items() if last == index and file in readers]:
                readers.pop(file).close()


def _stored_shape(entry: CheckpointEntry, target: torch.Tensor) -> tuple[int, ...]:
    """The shape the file must hold for ``entry``: the whole tensor's where the entry is a region of it."""
    return tuple(entry.stored_shape) if entry.source else tuple(target.shape)


@contextlib.contextmanager
def _readable(file: Path) -> Iterator[None]:
    """Turn the safetensors reader's errors (a truncated or garbled file) into one-line CheckpointErrors."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{file}: not a readable safetensors file ({detail})") from None
    except OSError as error:
        raise CheckpointError(f"cannot read {file}: {error.strerror or error}") from None


def _weight_map(path: Path) -> dict[str, str]:
    """Checkpoint key -> file name, from the index when sharded, else from the file headers."""
    if not path.is_dir():
        raise ModelFilesError(f"model directory {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        absent = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if absent:
            raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(absent[:3])}")
        return dict(weight_map)
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFilesError(
            f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported; "
            "re-save with save_pretrained(safe_serialization=True))"
        )
    from safetensors import safe_open

    weight_map = {}
    for file in files:
        with _readable(file), safe_open(file, framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), file.name))
    return weight_map


def _prefer_fused(entries: list[CheckpointEntry], weight_map: dict[str, str]) -> list[CheckpointEntry]:
    """Read a split parameter (MoE experts) from its fused in-memory key when a checkpoint stores that.

    Hub checkpoints and ``save_pretrained`` keep experts one by one; a state dict saved straight from a
    transformers 5 model (``save_file(model.state_dict())``) holds the fused tensor instead.
    """
    out: list[CheckpointEntry] = []
    done: set[tuple[str, str]] = set()
    for entry in entries:
        fused = getattr(entry.unit, "checkpoint_names", {}).get(entry.param)
        if entry.index and entry.key not in weight_map and fused in weight_map:
            if (entry.unit.name, entry.param) not in done:
                done.add((entry.unit.name, entry.param))
                out.append(CheckpointEntry(fused, entry.unit, entry.param))
        else:
            out.append(entry)
    return out


def _find_key(key: str, weight_map: dict[str, str], prefix: str) -> str | None:
    if key in weight_map:
        return key
    # Old checkpoints of some families (the original GPT-2) store the base model without its prefix.
    if prefix and key.startswith(prefix) and key[len(prefix) :] in weight_map:
        return key[len(prefix) :]
    return None


def _check_headers(file: Path, wanted: list[tuple[str, tuple[int, ...]]]) -> None:
    from safetensors import safe_open

    with _readable(file), safe_open(file, framework="pt") as f:
        present = set(f.keys())
        for key, shape in wanted:
            if key not in present:
                raise CheckpointError(f"{file}: the index lists {key} in this file, but it is not there")
            piece = f.get_slice(key)
            stored = tuple(piece.get_shape())
            if stored != shape:
                raise CheckpointError(f"{file.name}: {key} has shape {list(stored)}, the model expects {list(shape)}")
            if piece.get_dtype() not in _DTYPE_BYTES:
                raise CheckpointError(
                    f"{file.name}: {key} is {piece.get_dtype()}; only float checkpoints (F32/F16/BF16) load"
                )


class _ShardReader:
    """Copies tensors out of one safetensors file in chunks, re-mapping the file every ``budget`` bytes."""

    def __init__(self, file: Path, budget: int) -> None:
        self.file = file
        self.budget = budget
        self._handle: Any = None
        self._read = 0

    def _open(self) -> Any:
        from safetensors import safe_open

        if self._handle is None or self._read >= self.budget:
            self.close()
            self._handle = safe_open(self.file, framework="pt")
            self._read = 0
        return self._handle

    def close(self) -> None:
        self._handle = None  # dropping the last reference unmaps the file

    def copy_into(self, key: str, dst: torch.Tensor, source: tuple[slice, ...] = ()) -> None:
        """Copy tensor ``key`` (or its region ``source``: slices with unit steps) into ``dst``, rows at a time."""
        piece = self._open().get_slice(key)
        shape = tuple(piece.get_shape())
        itemsize = _DTYPE_BYTES[piece.get_dtype()]
        del piece
        if not shape:
            dst.copy_(self._open().get_tensor(key))
            self._read += itemsize
            self._check_finite(key, dst)
            return
        first = source[0].indices(shape[0])[0] if source else 0
        row_bytes = max(1, itemsize * dst[0].numel())
        step = max(1, self.budget // row_bytes)
        for start in range(0, dst.shape[0], step):
            stop = min(start + step, dst.shape[0])
            rows = slice(first + start, first + stop)
            dst[start:stop].copy_(self._open().get_slice(key)[(rows, *source[1:])])
            self._read += (stop - start) * row_bytes
            self._check_finite(key, dst[start:stop])

    def _check_finite(self, key: str, values: torch.Tensor) -> None:
        """NaN or Inf in a checkpoint would otherwise surface steps later as a NaN loss blamed on --lr."""
        if not bool(torch.isfinite(values).all()):
            raise CheckpointError(f"{self.file.name}: {key} holds NaN or Inf values; the checkpoint is damaged")
