"""Optimizers that ship with slide-core."""

from slide_core.optim.adamw import TorchAdamW

__all__ = ["TorchAdamW"]
