"""Packed micro-batches ``(input_ids, labels, position_ids)`` through the engine, on the CPU device in fp32.

See Note [Packed micro-batches] in slide_core/engine/micro_batch.py. The transformers families are
checked against HF's own forward over separate documents in tests/hf/test_packing.py.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, packed_row, reference_loss, toy_batches, toy_init

RTOL = 1e-5
LR = 3e-3


class MicroBatch(NamedTuple):
    """The shape the data loader hands out."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def _packed_batches(cfg: ToyConfig, steps: int, seed: int) -> list[list[MicroBatch]]:
    """Per step two micro-batches of two packed rows each (16 tokens, 2-4 documents per row)."""
    g = torch.Generator().manual_seed(seed)
    splits = [(5, 7, 4), (9, 7), (3, 3, 6, 4), (16,)]
    out = []
    for step in range(steps):
        micro = []
        for mb in range(2):
            rows = []
            for row in range(2):
                lengths = splits[(step + 2 * mb + row) % len(splits)]
                rows.append(packed_row([torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]))
            micro.append(MicroBatch(*(torch.cat(parts) for parts in zip(*rows, strict=True))))
        out.append(micro)
    return out


def _engine_run(model, init, batches, config: EngineConfig):
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config) as engine:
            results = [engine.step(micro, lr=LR) for micro in batches]
        return results, {unit.name: {n: v.clone() for n, v in host.views(unit).items()} for unit in model.units}


@pytest.mark.parametrize("resident", [(), ("embed", "layers.1")])
@pytest.mark.parametrize("tied", [False, True])
def test_packed_micro_batches_match_the_reference(tied: bool, resident: tuple[str, ...]) -> None:
    """Engine steps over packed rows equal plain autograd + torch.optim.AdamW over the same rows, whose
    loss in turn is the toy model's loss over each document on its own."""
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=2)
    batches = _packed_batches(cfg, steps=3, seed=1)
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024, resident_units=resident)
    results, weights = _engine_run(model, init, batches, config)

    params = {unit: {name: torch.nn.Parameter(t.clone()) for name, t in views.items()} for unit, views in init.items()}
    flat = [p for views in params.values() for p in views.values()]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in flat if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in flat if p.dim() < 2]},
        ],
        lr=LR,
        weight_decay=0.0,
    )
    for step, micro in enumerate(batches):
        tokens = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in micro)
        total = 0.0
        for mb in micro:
            loss = reference_loss(model, params, *mb)
            (loss / tokens).backward()
            total += loss.item()
        assert results[step].loss == pytest.approx(total / tokens, rel=RTOL), f"loss differs at step {step + 1}"
        assert results[step].loss_tokens == tokens
        optimizer.step()
        optimizer.zero_grad()
    for unit, views in params.items():
        for name, want in views.items():
            err = (weights[unit][name] - want.detach()).norm() / want.detach().norm()
            assert err <= RTOL, f"{unit}.{name} differs: relative error {err:.2e}"


def test_packed_rows_are_separate_documents() -> None:
    """The reference the engine is held to: a packed row's summed loss is the sum of each document's
    loss on its own, and does not depend on the documents' order."""
    cfg = ToyConfig(num_layers=2)
    model = ToyModel(cfg)
    params = toy_init(model, seed=4)
    g = torch.Generator().manual_seed(3)
    documents = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (6, 4, 9)]
    with torch.no_grad():
        packed = float(reference_loss(model, params, *packed_row(documents)))
        swapped = float(reference_loss(model, params, *packed_row(documents[::-1])))
        alone = sum(float(reference_loss(model, params, doc[None], doc[None])) for doc in documents)
    assert packed == pytest.approx(alone, rel=1e-6)
    assert swapped == pytest.approx(alone, rel=1e-6)


class _Recording(ToyModel):
    """Records the position ids each ``prepare_inputs`` call receives."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__(cfg)
        self.seen: list[torch.Tensor | None] = []

    def prepare_inputs(self, input_ids, labels, dtype, *, position_ids=None):
        self.seen.append(position_ids)
        return super().prepare_inputs(input_ids, labels, dtype, position_ids=position_ids)


def test_plain_position_ids_are_sent_as_none() -> None:
    """Note [Packed micro-batches]: rows of plain ``0 .. S-1`` reach the model as None (its unpacked path)
    and train bit for bit as ``(input_ids, labels)`` pairs; restarting ones reach it as they are."""
    cfg = ToyConfig(num_layers=2)
    init = toy_init(ToyModel(cfg), seed=6)
    pairs = toy_batches(cfg, steps=2, accum=2, seed=7)
    triples = [[(ids, labels, torch.arange(ids.shape[1]).expand_as(ids)) for ids, labels in micro] for micro in pairs]
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024)
    as_pairs = _engine_run(_Recording(cfg), init, pairs, config)
    recording = _Recording(cfg)
    as_triples = _engine_run(recording, init, triples, config)
    assert recording.seen and all(seen is None for seen in recording.seen)
    assert [r.loss for r in as_triples[0]] == [r.loss for r in as_pairs[0]]
    for unit, views in as_pairs[1].items():
        for name, tensor in views.items():
            assert torch.equal(as_triples[1][unit][name], tensor), (unit, name)

    packed = _packed_batches(cfg, steps=1, seed=2)
    recording = _Recording(cfg)
    _engine_run(recording, init, packed, config)
    assert recording.seen and all(
        torch.equal(seen, mb.position_ids) for seen, mb in zip(recording.seen, packed[0], strict=True)
    )


def test_malformed_micro_batches_are_named() -> None:
    cfg = ToyConfig(num_layers=1)
    model = ToyModel(cfg)
    (ids, labels), *_ = toy_batches(cfg, steps=1, accum=1)[0]
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, toy_init(model))
        config = EngineConfig(compute_dtype=torch.float32)
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), config) as engine:
            with pytest.raises(ValueError, match="micro-batch 1 has 4 parts"):
                engine.step([(ids, labels), (ids, labels, ids, ids)], lr=LR)
            with pytest.raises(ValueError, match="micro-batch 0: position_ids must be integers shaped like"):
                engine.step([(ids, labels, ids[:, :-1])], lr=LR)
            with pytest.raises(ValueError, match="micro-batch 0: input_ids and labels must both be"):
                engine.step([(ids, labels[:, :-1])], lr=LR)
            assert engine.step_count == 0
