"""AdamW's hyperparameters: the config dataclass of the shipped AdamW plugins (``torch-adamw``,
``fused-adamw``, and ``CompactAdamW``, which ``build_optimizer`` picks for a compact state format)."""

from __future__ import annotations

from dataclasses import dataclass

from slide_core.optim.state_formats import STATE_FORMATS

__all__ = ["AdamWConfig"]


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters, with torch.optim.AdamW's defaults except weight decay (HF's 0.0).

    ``state_format``: how exp_avg and exp_avg_sq are stored between steps, ``fp32`` (exact), ``bf16`` or
    ``int8`` (stochastically rounded with seed ``state_seed``); the name of a moment codec
    (slide_core/optim/state_formats.py, ``moment_codec``), which the optimizer resolves once."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    state_format: str = "fp32"
    state_seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"adam beta1 must be in [0, 1), got {self.beta1}")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"adam beta2 must be in [0, 1), got {self.beta2}")
        if self.eps <= 0.0:
            raise ValueError(f"adam eps must be > 0, got {self.eps}")
        if self.weight_decay < 0.0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")
        if self.state_format not in STATE_FORMATS:
            raise ValueError(f"optimizer state format must be fp32, bf16 or int8, got {self.state_format!r}")
