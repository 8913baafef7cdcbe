"""Which units become device-resident (slide_core/engine/placement.py), priced as ResidentUnits allocates."""

from __future__ import annotations

import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine.placement import choose_resident_units
from slide_core.engine.resident import ResidentUnits, resident_bytes
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optim.state_formats import state_arrays
from slide_core.testing import ToyConfig, ToyModel


def test_resident_bytes_are_what_resident_units_allocate() -> None:
    """For every state format, ``resident_bytes`` is the device buffers of the unit, to the byte."""
    model = ToyModel(ToyConfig(num_layers=2, hidden_size=64, vocab_size=256))
    block = model.blocks[0]
    for state_format in ("fp32", "bf16", "int8"):
        arrays = state_arrays(state_format)
        with CPUDevice() as device:
            units = ResidentUnits(
                model, (block.name,), device, HostParameters(model), {block.name: None}, arrays, torch.bfloat16
            )
            allocated = units.device_bytes
        assert allocated == resident_bytes(block, torch.bfloat16, accumulates=False, state_arrays=arrays)


def test_compact_moments_leave_room_for_more_resident_units() -> None:
    """bf16 moments cost 4 bytes/param less on the device, so a budget that holds two blocks with fp32
    moments holds a third with bf16 ones."""
    model = ToyModel(ToyConfig(num_layers=4, hidden_size=64, vocab_size=64))
    arrays = CompactAdamW(AdamWConfig(state_format="bf16"), fused=False).state_arrays
    fp32_block = resident_bytes(model.blocks[0], torch.bfloat16, accumulates=False)
    budget = 2 * fp32_block + fp32_block // 2
    edges = sum(resident_bytes(u, torch.bfloat16, accumulates=False) for u in (model.embedding, model.head))
    budget += edges  # the embedding and head come first and fit either way
    plain = choose_resident_units(model, budget, torch.bfloat16, accumulates=False)
    compact = choose_resident_units(model, budget, torch.bfloat16, accumulates=False, state_arrays=arrays)
    assert len(plain) == 4 and len(compact) == 5, (plain, compact)
