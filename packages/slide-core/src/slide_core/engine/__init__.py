"""The sliding-window engine."""

from slide_core.engine.config import EngineConfig
from slide_core.engine.engine import Engine, StepResult
from slide_core.engine.evaluation import EvalResult
from slide_core.engine.master_format import choose_master_format
from slide_core.engine.micro_batch import MicroBatchLike
from slide_core.engine.timeline import Timeline, UnitTimes
from slide_core.engine.workers import EngineError, EngineTimeout, WorkerFailure

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineTimeout",
    "EvalResult",
    "MicroBatchLike",
    "StepResult",
    "Timeline",
    "UnitTimes",
    "WorkerFailure",
    "choose_master_format",
]
