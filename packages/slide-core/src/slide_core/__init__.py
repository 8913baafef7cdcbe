"""slide-core: devices, tiers, optimizers, units and the sliding-window training engine."""

from slide_core.device import Device, DeviceFacts, Event
from slide_core.host_params import HostParameters
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optimizer import Optimizer
from slide_core.schedule import LRSchedule
from slide_core.tier import Tier, TierError
from slide_core.unit import ParamLayout, ParamSpec, SlideModel, Unit, UnitRole

__all__ = [
    "AdamWConfig",
    "Device",
    "DeviceFacts",
    "Event",
    "HostParameters",
    "LRSchedule",
    "Optimizer",
    "ParamLayout",
    "ParamSpec",
    "SlideModel",
    "Tier",
    "TierError",
    "Unit",
    "UnitRole",
]
