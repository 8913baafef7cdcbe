"""A device's preferences reach the run: the attention each layer runs and the tier block inputs go to."""

from __future__ import annotations

import pytest
import torch

from slide_core.devices.cpu import CPUDevice
from slide_hf import build_model, resolve_model
from slide_hf.adapters.attention import (
    EAGER,
    FLASH,
    FLEX,
    SDPA,
    AttentionSupport,
    LayerAttention,
    choose_attention,
)
from slide_hf.device_defaults import apply_device_defaults
from slide_hf.errors import UserError
from slide_hf.offload import open_activation_tier

PLAIN, CAPPED = LayerAttention(), LayerAttention(softcap=50.0)
CUDA = {"device_type": "cuda", "dtype": torch.bfloat16, "flash_attn": True, "flash_attn_softcap": False}


class _PolicyDevice(CPUDevice):
    """The CPU device with a policy, as a plugin such as slide-rocm's would carry one."""

    def __init__(self, tier: str | None = None, attention: str | None = None) -> None:
        super().__init__()
        self._tier, self._attention = tier, attention

    def preferred_activation_tier(self) -> str | None:
        return self._tier

    def preferred_attention(self) -> str | None:
        return self._attention


@pytest.mark.parametrize(
    ("layer", "support", "expected"),
    [
        (PLAIN, AttentionSupport(**CUDA, preferred=SDPA), SDPA),  # the policy beats the rule's flash
        (PLAIN, AttentionSupport(**CUDA, preferred=None), FLASH),
        (CAPPED, AttentionSupport(**CUDA, preferred=SDPA), FLEX),  # sdpa would drop the cap: the rule
        (CAPPED, AttentionSupport(**CUDA, preferred=FLASH), FLEX),  # this flash-attn cannot cap
        (PLAIN, AttentionSupport("cuda", torch.float32, flash_attn=True, preferred=FLASH), SDPA),  # fp32
        (PLAIN, AttentionSupport("cuda", torch.bfloat16, preferred=FLASH), SDPA),  # not installed
        (CAPPED, AttentionSupport("cpu", torch.float32, preferred=FLEX), EAGER),  # no backward on the CPU
        (CAPPED, AttentionSupport("cpu", torch.float32, preferred=EAGER), EAGER),
    ],
)
def test_the_device_preference_wins_where_the_layer_can_run_it(layer, support, expected):
    assert choose_attention(layer, support) == expected


def test_a_run_takes_its_devices_attention():
    model = build_model(resolve_model("tiny-llama")[0])
    assert set(model.attention_for("cpu", torch.float32).values()) == {SDPA}
    apply_device_defaults(model, _PolicyDevice(attention=EAGER))
    assert set(model.attention_for("cpu", torch.float32).values()) == {EAGER}
    apply_device_defaults(model, CPUDevice())  # no preference: the rule again
    assert set(model.attention_for("cpu", torch.float32).values()) == {SDPA}


def test_block_inputs_go_to_the_devices_tier(tmp_path):
    pytest.importorskip("slide_io")
    from slide_core.tiers.host_ram import HostRamTier

    with _PolicyDevice(tier="nvme") as device:
        tier = open_activation_tier(HostRamTier, tmp_path, device)  # the device's choice wins
        try:
            assert tier.name == "nvme"
        finally:
            tier.close()
        with _PolicyDevice(tier="no-such-tier") as other, pytest.raises(UserError, match="policy asks for"):
            open_activation_tier(HostRamTier, tmp_path, other)
