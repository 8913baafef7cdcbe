"""What every shipped AdamW optimizer shares: its config type, its state, and clipping's correction.

``TorchAdamW``, ``FusedAdamW`` and ``CompactAdamW`` differ in how they run an update (torch's kernels,
numba's, compact moments), not in what correcting one means: that is :class:`AdamWCorrection`'s
arithmetic, reached through :meth:`AdamWOptimizer.correct`, written here once. ``CompactAdamW`` widens its
stored moments around it and rounds them back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from slide_core.master_store import MasterRange
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optim.adamw_correction import DEFAULT_PIECE_NUMEL, AdamWCorrection
from slide_core.optimizer import Coefficient, Correction, Optimizer

__all__ = ["AdamWOptimizer"]


class AdamWOptimizer(Optimizer):
    """AdamW with decoupled weight decay on ranges flagged ``decay``; steps fp32 and split masters.

    ``correction_piece_numel`` bounds the fp32 scratch of a correction through torch's ops (two pieces of
    it per device)."""

    config_type = AdamWConfig
    config: AdamWConfig
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    split_master = True

    def __init__(self, config: AdamWConfig, *, correction_piece_numel: int = DEFAULT_PIECE_NUMEL) -> None:
        super().__init__(config)
        self._correction = AdamWCorrection(config, correction_piece_numel)

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
        """Take back or redo the update on fp32 moments ``state`` (``AdamWCorrection``: one numba pass over
        a host range with a float coefficient when numba is here, torch's ops otherwise)."""
        self._correction.apply(correction, master, grad, applied, state, lr=lr, step=step, decay=decay)

    def _refuse_compact_state(self) -> None:
        """The fp32-state optimizers keep exp_avg and exp_avg_sq in fp32: a config that asks for another
        format is refused at construction (``build_optimizer`` picks ``CompactAdamW`` for it)."""
        if self.config.state_format != "fp32":
            raise ValueError(
                f"{type(self).__name__} keeps fp32 state, but its config asks for {self.config.state_format}; "
                "use CompactAdamW (build_optimizer picks it)"
            )
