"""On a GPU, bf16 training through the engine tracks plain PyTorch AMP (fp32 weights, bf16 autocast,
AdamW) within bf16 noise over 50 steps, for two families."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_hf import build_model, load_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    max_position_embeddings=512,
)
STEPS = 50


def _config(model_type: str):
    from transformers import AutoConfig

    extra = {"tie_word_embeddings": False}
    return AutoConfig.for_model(model_type, **SHAPE, **extra)


def _batches(vocab: int):
    generator = torch.Generator().manual_seed(0)
    # A learnable stream: repeated random phrases, so the loss falls well below log(vocab).
    phrases = torch.randint(0, vocab, (32, 16), generator=generator)
    out = []
    for _ in range(STEPS):
        pick = torch.randint(0, 32, (8, 16), generator=generator)
        ids = phrases[pick].reshape(8, -1)[:, :128]
        out.append([(ids, ids.clone())])
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_bf16_engine_tracks_plain_amp(model_type: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from slide_core.devices.cuda import CUDADevice

    config = _config(model_type)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    hf.save_pretrained(tmp_path)
    batches = _batches(config.vocab_size)
    lr = 1e-3

    hf = hf.cuda().train()
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in hf.parameters() if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in hf.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        fused=True,
    )
    plain = []
    for micro in batches:
        ids, labels = (t.cuda() for t in micro[0])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = hf(ids, labels=labels).loss
        loss.backward()
        plain.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()

    config = _config(model_type)
    config._attn_implementation = "sdpa"
    model = build_model(config)
    with CUDADevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_weights(model, host, tmp_path)
        adam = AdamWConfig(weight_decay=0.01)
        with Engine(model, device, host, TorchAdamW(adam), EngineConfig(compute_dtype=torch.bfloat16)) as engine:
            slide = [engine.step(micro, lr).loss for micro in batches]

    assert slide[0] == pytest.approx(plain[0], rel=1e-2)
    assert plain[-1] < 0.6 * plain[0] and slide[-1] < 0.6 * slide[0]
    tail = slice(STEPS - 10, STEPS)
    mean_plain = sum(plain[tail]) / 10
    mean_slide = sum(slide[tail]) / 10
    assert mean_slide == pytest.approx(mean_plain, rel=0.05), (plain, slide)


def _gemma2_block_pass(model, host, dtype, x, dout) -> dict[str, torch.Tensor]:
    """Forward and backward of every block of ``model`` in ``dtype`` on one input: the output, the input's
    gradient and the attention weights' gradients, as fp32."""
    ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
    inputs = model.prepare_inputs(ids, ids, dtype)
    out = {}
    for block in model.blocks:
        params = {n: v.to(x.device, dtype, copy=True).requires_grad_() for n, v in host.views(block.name).items()}
        leaf = x.to(dtype, copy=True).requires_grad_()
        y = block.forward(params, leaf, inputs)
        y.backward(dout.to(dtype))
        out[f"{block.name}/out"] = y.detach().float()
        out[f"{block.name}/input grad"] = leaf.grad.float()
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            out[f"{block.name}/{name} grad"] = params[name].grad.float()
    return out


def test_gemma2_blocks_in_bf16_run_flex_and_match_eager() -> None:
    """Gemma-2 2B's sliding and full blocks with the released caps, the attention logits sharpened so the
    cap of 50 acts, 1024 tokens over a 512-token window: the default choice on CUDA (flex_attention, or
    flash-attn where installed) in bf16 stays as close to eager fp32 as eager bf16 does."""
    from slide_hf import PRESETS, init_random
    from slide_hf.adapters.attention import EAGER, FLASH, FLEX

    def config(attention: str | None):
        c = PRESETS["gemma2-2b"](
            num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=512
        )
        c._attn_implementation = attention
        return c

    chosen, eager = build_model(config(None)), build_model(config(EAGER))
    assert set(chosen.attention_for("cuda", torch.bfloat16).values()) <= {FLEX, FLASH}
    host = HostParameters(chosen)
    init_random(chosen, host, config(None), seed=0)
    with torch.no_grad():
        for block in chosen.blocks:
            views = host.views(block)
            views["self_attn.q_proj.weight"].mul_(10.0)  # scores ~100 before the cap
            views["self_attn.k_proj.weight"].mul_(10.0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1024, 2304, generator=generator).cuda()
    dout = torch.randn(1, 1024, 2304, generator=generator).cuda()

    reference = _gemma2_block_pass(eager, host, torch.float32, x, dout)
    flex = _gemma2_block_pass(chosen, host, torch.bfloat16, x, dout)
    noise = _gemma2_block_pass(eager, host, torch.bfloat16, x, dout)
    for key, want in reference.items():
        err = ((flex[key] - want).norm() / want.norm()).item()
        bf16 = ((noise[key] - want).norm() / want.norm()).item()
        assert err <= 2 * bf16 + 1e-3, f"{key}: {err:.2e} vs eager bf16 {bf16:.2e}"
