"""The Optimizer interface: step one flat range of one unit's fp32 master given its gradients.

The engine hands the optimizer *ranges* of a unit's flat buffer as gradient chunks land on the host, so
the update can start before the whole unit's gradients have arrived. Every range lies entirely inside the
unit's decay prefix or entirely after it, so an optimizer never splits a call by parameter.

Gradient clipping (``EngineConfig.max_grad_norm``) asks one more thing of an optimizer: to take back, or
redo with another coefficient, an update it applied earlier in the same step (:meth:`Optimizer.correct`).
The engine applies each unit's update before the step's global norm is known and corrects it once it is
(docs/design/engine.md, "Clipping"); an optimizer that cannot correct runs only with clipping off.

An optimizer is a ``slide.optimizers`` plugin with a frozen config dataclass of its own (``config_type``;
AdamW's is :class:`~slide_core.optim.adamw_config.AdamWConfig`). The engine reads nothing inside that
config: what it needs, an optimizer says through this base's properties and methods (``state_arrays``,
``state_format``, ``split_master``, ``corrects``, ``device_scratch_bytes``, ``device_replica``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from slide_core.allocation_ledger import held_host_bytes
from slide_core.split_master import TORCH_SPLIT_CODEC, SplitCodec

if TYPE_CHECKING:
    from slide_core.master_store import MasterRange
    from slide_core.optim.state_formats import StateArray

__all__ = ["Coefficient", "Correction", "Optimizer", "scale_into"]

Coefficient = float | torch.Tensor
"""A gradient scale: a host float, or a 0-dim fp32 tensor on the device (no host sync to read it)."""


def scale_into(out: torch.Tensor, grad: torch.Tensor, coeff: Coefficient) -> torch.Tensor:
    """``out = coeff * grad`` in fp32, one rounding: the product ``Optimizer.step``'s ``grad_scale`` stands
    for. A correction forms it again, bit for bit, to know exactly which gradient an update applied."""
    out.copy_(grad)
    out.mul_(coeff)
    return out


@dataclass(frozen=True)
class Correction:
    """What becomes of an update applied earlier in the step once the step's gradient norm is known: taken
    back (``undo``), redone with ``coeff * grad`` instead (``rescale``), or left as it is (``keep``)."""

    kind: Literal["undo", "rescale", "keep"]
    coeff: float = 1.0


class Optimizer(ABC):
    """Updates flat fp32 ranges in place. One instance serves one engine and is used from one thread.

    ``config`` is the plugin's own (``config_type``), for the plugin's use: the engine never reads it. A
    plugin narrows its type by declaring ``config: MyConfig`` in its class body."""

    config_type: ClassVar[type[Any]] = object
    """The config dataclass this optimizer is built with (``cls(config)``); ``build_optimizer`` checks a
    config against it and builds ``config_type()`` when given none. ``object``: any config."""

    state_names: tuple[str, ...] = ()
    """Names of the per-element fp32 state tensors (e.g. ``exp_avg``, ``exp_avg_sq``)."""

    split_master: bool = False
    """Whether :meth:`step` and :meth:`correct` also take a :class:`~slide_core.split_master.SplitMaster`
    where an fp32 master range would be, leaving its decoded values exactly as the fp32 range's. The
    engine stores the master split only for an optimizer that says so."""

    split_codec: SplitCodec = TORCH_SPLIT_CODEC
    """How the engine decodes a split master's range on the device before this optimizer steps it there,
    and encodes it back after (a GPU-streamed unit's staged master, streamed_pipeline.py): the host
    kernels decode and encode in registers, but a device step of an fp32 range needs the values first.
    slide_core's torch functions by default; the `slide` commands give it slide_kernels' one-launch
    codec, since the torch one issues thousands of launches per block from the engine's threads."""

    config: Any

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def state_format(self) -> str:
        """How this optimizer's state is stored between steps, by name (a checkpoint records it and a
        resume with another is refused: ``state_formats.refuse_other_state_format``). Default ``fp32``."""
        return "fp32"

    @property
    def state_arrays(self) -> tuple[StateArray, ...]:
        """How each state tensor is stored: by default one fp32 element per parameter for each of
        ``state_names``; an optimizer with compact state (``CompactAdamW``) says its dtypes and block scales."""
        from slide_core.optim.state_formats import StateArray

        return tuple(StateArray(name) for name in self.state_names)

    def reserve(self, max_range_numel: int) -> None:  # noqa: B027 - optional hook
        """Preallocate scratch for ranges up to ``max_range_numel`` so ``step`` never allocates."""

    def device_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False) -> int:
        """Peak device bytes this optimizer allocates beyond its arguments (scratch it keeps, and the
        temporaries of its ops) to update device ranges of up to ``max_range_numel`` elements; with
        ``corrects``, to correct them too (gradient clipping). Asked of the ``device_replica`` that updates
        device-resident units; the planner adds exactly this to a run's GPU peak, so an optimizer that
        allocates on the device must say how much. The default: nothing."""
        return 0

    def host_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False, split_master: bool = False) -> int:
        """Host bytes this optimizer keeps beyond its arguments to update host ranges of up to
        ``max_range_numel`` elements (what :meth:`reserve` was given), with ``corrects`` to correct them too,
        with ``split_master`` for :class:`~slide_core.split_master.SplitMaster` ranges. The planner prices
        the host optimizer's scratch from exactly this. The default: nothing."""
        return 0

    def held_host_bytes(self) -> int:
        """Host bytes this instance holds now beyond its arguments (the scratch :meth:`host_scratch_bytes`
        prices, as far as it has been allocated): every host tensor and numpy array reachable from its
        attributes, each storage once. An engine's allocation ledger counts this as the optimizer's scratch,
        read from the objects themselves rather than from a rule; an optimizer that keeps host memory
        elsewhere overrides it."""
        return held_host_bytes(self)

    @property
    def corrects(self) -> bool:
        """Whether this optimizer implements :meth:`correct`, which gradient clipping needs."""
        return type(self).correct is not Optimizer.correct

    def device_replica(self) -> Optimizer:
        """An instance with these hyperparameters for device-resident units: the engine's main thread
        updates them on the compute stream while this instance serves the optimizer thread, and an
        optimizer is used from one thread. The default builds ``type(self)(self.config)``."""
        return type(self)(self.config)

    @abstractmethod
    def step(
        self,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        """Apply one update to ``master`` (fp32, flat) in place: an fp32 tensor, or, for an optimizer whose
        ``split_master`` is True, possibly a split range (a ``SplitMaster``;
        ``slide_core.master_store.as_master_range`` treats both alike).

        ``grad`` has the same numel in any float dtype and is never written; ``state`` holds the matching
        ranges of this optimizer's state tensors; ``step`` is the 1-based update count used for bias
        correction; ``decay`` says whether weight decay applies to this range.

        The update applies ``grad_scale * grad``, the product formed in fp32 exactly as ``grad.float() *
        float32(grad_scale)`` (one rounding), i.e. bit for bit what :func:`scale_into` produces: clipping's
        correction recomputes that product and relies on the match. It exists so that a fused optimizer can
        scale in registers instead of in an extra pass over memory.
        """

    def correct(
        self,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        applied: Coefficient,
        correction: Correction,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """Correct an update :meth:`step` applied to these ranges in this step: it applied ``applied *
        grad`` (formed as :func:`scale_into` forms it) with the same ``lr``, ``step`` and ``decay``, and
        ``master`` and ``state`` are as it left them. ``undo`` restores both to what they were before it
        (for ``step == 1``, this optimizer's fresh state), ``rescale`` leaves them as if the update had
        applied ``correction.coeff * grad`` instead, ``keep`` changes nothing.

        What gradient clipping needs from an optimizer, and all it needs: the step's final coefficient
        reaches every update through here (or through ``grad_scale`` when the update waited for it). The
        result may differ from the uncorrected arithmetic by rounding (an AdamW update is taken back
        arithmetically, not restored from a copy). ``applied`` is a 0-dim device tensor for
        device-resident units. An optimizer without it runs only with ``max_grad_norm = 0``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot correct an applied update")
