"""RunLayout's roles that decide whether a buffer exists: the host optimizer's scratch exists only where the
host optimizer may step a range (tests/hf/test_plan_is_the_run.py holds the plan to the run for it)."""

from __future__ import annotations

import pytest

from slide_core.engine.config import EngineConfig
from slide_core.engine.layout import RunLayout

UNITS = (("embedding", 64), ("block.0", 128), ("block.1", 128), ("head", 64))
ALL_BUT_EMBEDDING = ("block.0", "block.1", "head")


@pytest.mark.parametrize(
    ("config", "host_steps"),
    [
        (EngineConfig(), True),  # every sliding unit host-optimized
        (EngineConfig(resident_units=("embedding",), streamed_units=ALL_BUT_EMBEDDING), False),
        (EngineConfig(resident_units=("embedding", "block.0", "block.1", "head")), False),  # nothing slides
        (EngineConfig(streamed_units=ALL_BUT_EMBEDDING), True),  # the embedding is host-optimized
        # a streamed unit's clipped step is corrected, and the next step updated, on the host
        (EngineConfig(resident_units=("embedding",), streamed_units=ALL_BUT_EMBEDDING, max_grad_norm=1.0), True),
        # a run that re-places units between steps may move a streamed one to the host
        (
            EngineConfig(
                resident_units=("embedding",), streamed_units=ALL_BUT_EMBEDDING, streamable_units=ALL_BUT_EMBEDDING
            ),
            True,
        ),
    ],
    ids=["host", "all streamed", "all resident", "one host unit", "streamed, clipping", "movable"],
)
def test_the_host_optimizer_steps_only_where_a_unit_may_be_updated_on_the_host(config, host_steps):
    assert RunLayout(config, UNITS).host_steps is host_steps
