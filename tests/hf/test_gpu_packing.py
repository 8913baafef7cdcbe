"""On a GPU, in bf16: packed rows, evaluation and the reported gradient norm of the engine against
transformers over the same documents one at a time (fp32 reference, bf16 tolerances)."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_hf import build_model, load_config, load_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
DOC_LENGTHS = [(300, 200, 12), (512,), (100, 100, 100, 100, 112)]
"""Three rows of 512 tokens: packed, one document, and many short ones."""


def _rows(vocab: int):
    g = torch.Generator().manual_seed(0)
    docs = [[torch.randint(0, vocab, (n,), generator=g) for n in row] for row in DOC_LENGTHS]
    ids = torch.stack([torch.cat(row) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    labels = ids.clone()
    labels[positions == 0] = -100  # no token predicts the first token of the next document
    return docs, ids, labels, positions


def _reference(path, docs) -> tuple[float, float]:
    """transformers (fp32, on the GPU) over each document alone: mean token loss, and the gradient norm."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").cuda()
    total, count = torch.zeros((), device="cuda"), 0
    for row in docs:
        for doc in row:
            ids = doc.cuda()[None]
            logits = hf(input_ids=ids).logits.float()
            total = total + torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            count += doc.numel() - 1
    loss = total / count
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in hf.parameters() if p.grad is not None])
    return float(loss), float(norm)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_packed_bf16_step_and_eval_track_separate_documents(model_type: str, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from slide_core.devices.cuda import CUDADevice

    config = AutoConfig.for_model(model_type, **SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path)
    docs, ids, labels, positions = _rows(config.vocab_size)
    ref_loss, ref_norm = _reference(tmp_path, docs)

    loaded = load_config(tmp_path)
    model = build_model(loaded)
    host = HostParameters(model)
    load_weights(model, host, tmp_path)
    cfg = EngineConfig(block_slots=2, compute_dtype=torch.bfloat16)
    with CUDADevice() as device, Engine(model, device, host, TorchAdamW(AdamWConfig()), cfg) as engine:
        evaluated = engine.evaluate([(ids, labels, positions)])
        result = engine.step([(ids, labels, positions)], lr=0.0)  # lr 0: the weights stay where eval saw them
        again = engine.evaluate([(ids, labels, positions)])
    assert evaluated.loss == pytest.approx(ref_loss, rel=2e-2)
    assert result.loss == pytest.approx(evaluated.loss, rel=1e-3)
    assert again.loss == pytest.approx(evaluated.loss, rel=1e-6)
    assert result.grad_norm == pytest.approx(ref_norm, rel=5e-2)
