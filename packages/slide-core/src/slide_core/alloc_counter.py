"""Count the tensor bytes torch allocates inside a block, on any device, the CPU included.

Why: what the planner prices for a device-resident unit's optimizer scratch must be what the optimizer
allocates, and CI has no GPU, whose allocator keeps a peak (``torch.cuda.max_memory_allocated``). This
counter sees every aten op through a ``TorchDispatchMode``: an output whose storage is neither an input's
nor already counted is a new allocation (its bytes are added), and a finalizer on that storage takes them
off when torch frees it. torch keeps one Python object per storage for the storage's whole life, so the
finalizer runs exactly when the memory is released, whichever view held it last.

Storages that existed before the block (the caller's tensors) are never counted; the peak is of what the
block allocated beyond them, which is what a caching GPU allocator's peak would add for the same ops
(less its rounding of each block to 512 bytes).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationCounter"]


class AllocationCounter(TorchDispatchMode):
    """A context manager: ``live_bytes`` (allocated inside it and still alive) and ``peak_bytes`` (their
    largest sum at any point) of the tensors the ops inside it create.

    Only for tests and measurements: every op pays a Python round trip.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves this __init__ unannotated
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counted: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs, _ = tree_flatten((args, kwargs or {}))
        existing = {id(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        for tensor in outputs:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in existing or key in self._counted:
                continue
            nbytes = storage.nbytes()
            self._counted.add(key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._freed, key, nbytes)
        return out
