"""The fp32 master weights of every unit, in one host slab per plane.

Loaders write into it; the engine's optimizer updates it; exporters read it. One slab per plane means one
pinning call (no per-tensor ``pin_memory``) and one contiguous range per unit, which is what the
host-to-device copy and the flat optimizer want.

Two formats hold the same fp32 values (``master_format``; each is a store, slide_core/master_store.py):

- ``"fp32"``: one fp32 slab. The host-to-device copy reads 4 bytes per parameter and casts on the device.
- ``"split"`` (bf16 compute only): a bf16 plane, a plane of the low 16 bits and a tie bitmask
  (slide_core/split_master.py), 4 bytes + 1 bit per parameter. The bf16 plane is the compute copy
  itself, so the copy reads 2 bytes per parameter and casts nothing; the values decode bit for bit.

Who reads what: the h2d copy reads :meth:`HostParameters.h2d_source` (the fp32 range or the bf16 plane);
the optimizer steps :meth:`HostParameters.master` (an fp32 range or a
:class:`~slide_core.split_master.SplitMaster`); everything else (loaders, exporters, checkpoints, the
device-resident copies) goes through :meth:`read`, :meth:`write` and :meth:`editing`, which decode into
fp32 and encode back, and are free views of the slab in the fp32 format. Which of these a format does is
the store's business (:class:`~slide_core.master_store.MasterStore`), not this class's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from slide_core.master_store import Allocator, MasterFormat, MasterRange, MasterStore, master_store
from slide_core.split_master import SplitMaster, tie_bytes
from slide_core.unit import SlideModel, Unit

__all__ = ["HostParameters", "MasterFormat"]

_PIECE_NUMEL = 1 << 22
"""Elements read at a time when a unit is copied from another master (:meth:`HostParameters.copy_from`)."""


def _plain_alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


class HostParameters:
    """fp32 master copy of a :class:`SlideModel`'s parameters, stored as ``master_format`` says.

    ``alloc`` decides where each plane lives. The default, pageable memory, is what training uses: the
    engine pins the ranges it streams and gives back the pages of device-resident units (Note [Resident
    host copies]); ``device.alloc_pinned`` pins the whole of every plane up front instead. Every unit has
    its range, device-resident ones included: loaders fill it and exporters read it.
    """

    def __init__(
        self, model: SlideModel, alloc: Allocator = _plain_alloc, master_format: MasterFormat = "fp32"
    ) -> None:
        self.model = model
        self._offsets: dict[str, tuple[int, int]] = {}
        self._units: dict[str, Unit] = {}
        total = 0
        for unit in model.units:
            self._offsets[unit.name] = (total, unit.layout.numel)
            self._units[unit.name] = unit
            total += unit.layout.numel
        self.numel = total
        self.store: MasterStore = master_store(master_format, total, alloc)
        self.master_format: MasterFormat = self.store.format
        self.planes: dict[str, torch.Tensor] = self.store.planes
        self._shards: dict[str, tuple[int, int]] = {}  # keep_shards: each unit's range this process keeps
        # Alignment padding is never read by a unit; keep it finite (zero) so whole-unit operations stay clean.
        for unit in model.units:
            base = self.offset(unit)
            for start, end in _gaps(unit):
                for plane in self.store.value_planes:
                    plane[base + start : base + end].zero_()

    # -- what the engine streams and steps -----------------------------------------------------------------
    @staticmethod
    def bytes_for(numel: int, master_format: MasterFormat) -> int:
        """Host bytes of the planes of ``numel`` elements in ``master_format``: 4 per element in fp32; in
        split, 2 (bf16) + 2 (low bits) + one tie bit. Units start on 64 elements, so a range of whole units
        owns whole tie bytes and the bytes of several ranges add up. The planner prices the master from this."""
        if master_format == "fp32":
            return numel * torch.float32.itemsize
        return numel * (torch.bfloat16.itemsize + torch.int16.itemsize) + tie_bytes(numel)

    @staticmethod
    def h2d_bytes_for(numel: int, master_format: MasterFormat) -> int:
        """Host bytes of ``numel`` elements of the plane the host-to-device copy reads (:meth:`h2d_source`):
        4 per element in fp32, 2 (the bf16 plane) in split. The planner prices the page-locked spans from
        this (Note [One registration per allocation] in slide_core/engine/host_span.py)."""
        return numel * (torch.float32.itemsize if master_format == "fp32" else torch.bfloat16.itemsize)

    @property
    def split(self) -> bool:
        """Whether the master is split (for pipelines that still stage a split master's restore themselves)."""
        return self.master_format == "split"

    def offset(self, unit: Unit | str) -> int:
        """Where the unit's range starts in every plane (in elements)."""
        return self._offsets[_name(unit)][0]

    def extent(self, unit: Unit | str) -> tuple[int, int]:
        """The unit's range in every plane, ``(start, end)`` in elements."""
        start, numel = self._offsets[_name(unit)]
        return start, start + numel

    def master(self, unit: Unit | str) -> torch.Tensor | SplitMaster:
        """The unit's master as the optimizer steps it: its fp32 slab range, or its split planes."""
        return self.store.stepped(*self.extent(unit))

    def master_range(self, unit: Unit | str) -> MasterRange:
        """The unit's master as a :class:`~slide_core.master_store.MasterRange` (fp32 values in and out)."""
        return self.store.range(*self.extent(unit))

    def h2d_source(self, unit: Unit | str) -> torch.Tensor:
        """What the host-to-device copy reads for the unit: the fp32 range (cast on the device) or the bf16
        plane's range (copied as it is, half the bytes)."""
        start, end = self.extent(unit)
        return self.store.h2d_plane[start:end]

    def h2d_span(self, start: int, end: int) -> torch.Tensor:
        """The plane :meth:`h2d_source` reads, over elements ``[start, end)`` (units are laid out in model
        order): a range the engine page-locks (Note [One registration per allocation] in
        slide_core/engine/host_span.py)."""
        return self.store.h2d_plane[start:end]

    def unit_ranges(self, unit: Unit | str) -> list[torch.Tensor]:
        """The unit's range of every plane (what to give back to the OS while the unit lives elsewhere)."""
        return self.store.page_ranges(*self.extent(unit))

    @property
    def is_pinned(self) -> bool:
        """Whether the plane the host-to-device copy reads was allocated pinned."""
        return self.store.h2d_plane.is_pinned()

    def keep_shards(self, spans: Mapping[str, tuple[int, int]] | None) -> None:
        """Data parallel: from now on :meth:`write` and :meth:`editing` (loading, random init, a resume)
        land only in this rank's shard ``[lo, hi)`` of each unit (``spans``, slide_core.distributed's
        ``shard_span``). The rest of every plane is never written, so its pages never become resident and
        the master costs this rank 1/N of its bytes (Note [Sharded master] in engine/host_pipeline.py).
        Outside the shard the planes hold whatever their allocation held (zeros for fresh pages) until a
        drain gathers the whole master into them; the drain first calls ``keep_shards(None)``, after
        which writes land everywhere again. A unit ``spans`` does not name is kept whole."""
        self._shards = {} if spans is None else {name: spans[name] for name in self._offsets if name in spans}

    # -- fp32 values, in either format -----------------------------------------------------------------
    def read(self, unit: Unit | str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the unit's master in fp32: the slab's own range in the fp32 format
        (a view; do not write it), a decoded copy in the split format."""
        return self.master_range(unit)[start:end].values()

    def write(self, unit: Unit | str, values: torch.Tensor, start: int = 0) -> None:
        """Set elements ``[start, start + values.numel())`` of the unit's master to ``values`` (fp32, on
        any device: a split master is encoded on the host piece by piece)."""
        master = self.master_range(unit)
        shard = self._shards.get(_name(unit))
        if shard is not None:  # keep_shards: only the part inside the shard is kept
            values = values.reshape(-1)
            lo, hi = max(start, shard[0]), min(start + values.numel(), shard[1])
            if lo >= hi:
                return
            values, start = values[lo - start : hi - start], lo
        target = master[start : start + values.numel()]
        if target.numel() != values.numel():
            raise ValueError(f"{_name(unit)} has {master.numel()} elements; cannot write {values.numel()} at {start}")
        target.assign_(values)

    def read_views(self, unit: Unit | str) -> dict[str, torch.Tensor]:
        """The unit's parameters in fp32, by name (views of :meth:`read`: not to be written)."""
        return self._unit(unit).layout.views(self.read(unit))

    @contextlib.contextmanager
    def editing(self, unit: Unit | str) -> Iterator[dict[str, torch.Tensor]]:
        """Writable fp32 views of the unit's parameters: the slab's own in the fp32 format; in the split
        format views of a decoded copy, encoded back when the block ends (without an exception)."""
        layout = self._unit(unit).layout
        if _name(unit) not in self._shards:
            with self.master_range(unit).updating(_new_fp32) as values:
                yield layout.views(values)
            return
        values = self.master_range(unit).decode()  # sharded: edit a copy, then keep the shard of it
        yield layout.views(values)
        self.write(unit, values)

    @contextlib.contextmanager
    def overwriting(self, unit: Unit | str) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`editing` for a caller that writes every parameter of the unit: the views' values before
        the caller writes them are unspecified (zeros in the split format, whose copy is not decoded from
        the planes; the layout's padding is stored as zero there). With :meth:`keep_shards`, only this
        rank's shard of the unit is stored, as :meth:`write` stores it.

        Why not decode: planes nothing has written yet are untouched pages, which a decode maps read-only,
        and the encode after it then takes a copy-on-write fault per page: `python bench/master_setup.py`
        on the development machine (2 cores) filled a split master 3x faster without the decode (1.92 B
        parameters initialized in 11.2 s instead of 35.1 s; docs/benchmarks.md, "Filling the host
        master")."""
        layout = self._unit(unit).layout
        if self.store.fp32_slab is not None:
            with self.editing(unit) as views:
                yield views
            return
        master = self.master_range(unit)
        values = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
        yield layout.views(values)
        self.write(unit, values)  # the whole unit, or this rank's shard of it (keep_shards)

    def unit_views(self) -> Mapping[str, dict[str, torch.Tensor]]:
        """``unit name -> read_views(unit)`` for every unit, for walking the model once in unit order. In
        the split format each unit is decoded when first asked for and kept until another one is, so a
        walk holds one unit's fp32 copy at a time."""
        if self.store.fp32_slab is not None:
            return {unit.name: self.views(unit) for unit in self.model.units}
        return _DecodedViews(self)

    def copy_from(self, other: HostParameters) -> None:
        """Take ``other``'s values (another format, or another allocation, of the same model)."""
        if [u.name for u in other.model.units] != [u.name for u in self.model.units] or other.numel != self.numel:
            raise ValueError("copy_from needs the master of a model with the same units")
        for unit in self.model.units:
            for lo in range(0, unit.layout.numel, _PIECE_NUMEL):
                self.write(unit, other.read(unit, lo, lo + _PIECE_NUMEL), lo)

    # -- the fp32 slab itself (fp32 format only) ----------------------------------------------------------
    @property
    def slab(self) -> torch.Tensor:
        """The fp32 slab (fp32 format only: a split master has none; use read/write/editing)."""
        return self._fp32_only("slab")

    def flat(self, unit: Unit | str) -> torch.Tensor:
        """The unit's fp32 slab range (fp32 format only)."""
        start, end = self.extent(unit)
        return self._fp32_only("flat")[start:end]

    def span(self, first: Unit | str, last: Unit | str) -> torch.Tensor:
        """The slab from ``first``'s range to the end of ``last``'s (fp32 format only)."""
        return self._fp32_only("span")[self.offset(first) : self.extent(last)[1]]

    def views(self, unit: Unit | str) -> dict[str, torch.Tensor]:
        """Writable fp32 views of the unit's parameters in the slab (fp32 format only)."""
        return self._unit(unit).layout.views(self.flat(unit))

    def named_tensors(self) -> Iterator[tuple[Unit, str, torch.Tensor]]:
        """Every parameter's fp32 view in the slab (fp32 format only)."""
        for unit in self.model.units:
            for name, tensor in self.views(unit).items():
                yield unit, name, tensor

    @property
    def nbytes(self) -> int:
        return sum(plane.numel() * plane.element_size() for plane in self.planes.values())

    # -- helpers -------------------------------------------------------------------------------------------
    def _fp32_only(self, what: str) -> torch.Tensor:
        slab = self.store.fp32_slab
        if slab is None:
            raise ValueError(
                f"HostParameters.{what} is an fp32 slab view, and this master is {self.master_format}; use read, "
                "write or editing"
            )
        return slab

    def _unit(self, unit: Unit | str) -> Unit:
        if isinstance(unit, Unit):
            return unit
        found = self._units.get(unit)
        if found is None:
            raise KeyError(f"no unit named {unit!r}")
        return found


class _DecodedViews(Mapping[str, dict[str, torch.Tensor]]):
    """``unit name -> fp32 views`` of a split master, decoding one unit at a time."""

    def __init__(self, host: HostParameters) -> None:
        self._host = host
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        if self._last is None or self._last[0] != name:
            self._last = None  # let the previous unit's copy go first
            self._last = (name, self._host.read_views(name))
        return self._last[1]

    def __iter__(self) -> Iterator[str]:
        return (unit.name for unit in self._host.model.units)

    def __len__(self) -> int:
        return len(self._host.model.units)


def _new_fp32(numel: int, device: torch.device) -> torch.Tensor:
    """A fresh fp32 tensor for a split unit's decoded copy while it is edited (freed when the edit ends)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def _name(unit: Unit | str) -> str:
    return unit if isinstance(unit, str) else unit.name


def _gaps(unit: Unit) -> list[tuple[int, int]]:
    gaps = []
    cursor = 0
    for spec in unit.layout:
        if spec.offset > cursor:
            gaps.append((cursor, spec.offset))
        cursor = spec.offset + spec.numel
    if cursor < unit.layout.numel:
        gaps.append((cursor, unit.layout.numel))
    return gaps
