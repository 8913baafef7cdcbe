"""`slide_hf.preference.head`: the pair loss's value and its gradients through the weighted cross-entropy
(Note [Preference loss through a weighted cross-entropy]), by slide-kernels' fused kernel and by the
PyTorch fallback, against plain autograd through full logits, log-softmax and the losses written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slide_hf.preference import head as head_module
from slide_hf.preference.head import PreferenceHead
from slide_hf.preference.losses import PairLoss
from slide_hf.preference.tags import PAIR_TAG_SHIFT

PAIRS, TOKENS, HIDDEN, VOCAB = 3, 40, 16, 37

LOSSES = {
    "dpo": PairLoss("dpo", 0.3, label_smoothing=0.1),
    "ipo": PairLoss("dpo", 0.5, dpo_loss="ipo"),
    "simpo": PairLoss("simpo", 2.0, gamma=0.4),
}


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, a head matrix, tagged shift-labels and the completion of each token (-1: none)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, TOKENS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / 2
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    completion = torch.full((TOKENS,), -1)
    for number in range(2 * PAIRS):
        start = 2 + number * 6
        completion[start : start + 3 + number % 3] = number
    labels = torch.where(completion >= 0, tokens | ((completion + 1) << PAIR_TAG_SHIFT), -100)
    return hidden, weight, labels.unsqueeze(0), completion


def _tokens(labels: torch.Tensor) -> torch.Tensor:
    """The token of each tagged label (0 where untrained), decoded here by hand."""
    return torch.where(labels[0] >= 0, labels[0] % (1 << PAIR_TAG_SHIFT), 0)


def _expected(loss: PairLoss, hidden, weight, completion, labels, reference, softcap):
    logits = hidden[0] @ weight.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logps = logits.log_softmax(-1).gather(1, _tokens(labels)[:, None])[:, 0]
    sums = torch.stack([logps[completion == n].sum() for n in range(2 * PAIRS)])
    counts = torch.stack([(completion == n).sum() for n in range(2 * PAIRS)]).to(sums.dtype)
    policy = sums / counts if loss.averages else sums
    ref = reference / counts if loss.averages else reference
    c, r, rc, rr = policy[0::2], policy[1::2], ref[0::2], ref[1::2]
    e = loss.label_smoothing
    if loss.objective == "simpo":
        z = loss.beta * (c - r) - loss.gamma
        return (-(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)).sum()
    h = (c - r) - (rc - rr)
    if loss.dpo_loss == "ipo":
        return ((h - 1 / (2 * loss.beta)) ** 2).sum()
    return (-(1 - e) * F.logsigmoid(loss.beta * h) - e * F.logsigmoid(-loss.beta * h)).sum()


@pytest.mark.parametrize("path", ["fused", "torch"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("name", list(LOSSES))
def test_value_and_gradients_match_autograd(name, softcap, path, monkeypatch, torch_kernels):
    if path == "torch":
        monkeypatch.setattr(head_module, "_fused_kernels", lambda: None)
    elif head_module._fused_kernels() is None:
        pytest.skip("slide-kernels is not installed")
    loss = LOSSES[name]
    hidden, weight, labels, completion = _batch()
    reference = torch.randn(2 * PAIRS, generator=torch.Generator().manual_seed(5)) - 20
    head = PreferenceHead(loss, PAIRS)
    head.use_reference(reference, torch.device("cpu"))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = head.loss_sum(h, w, labels, softcap=softcap)
    (ours * 0.7).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected = _expected(loss, h64, w64, completion, labels, reference.double(), softcap)
    (expected * 0.7).backward()
    torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h64.grad.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w64.grad.float(), rtol=1e-4, atol=1e-6)
    metrics = head_module.metric_means(head.take_metric_sums())
    assert set(metrics) == set(head_module.METRIC_NAMES) and head_module.metric_means(head.take_metric_sums()) == {}


def test_the_reference_pass_records_each_completions_log_probability(torch_kernels):
    hidden, weight, labels, completion = _batch(1)
    head = PreferenceHead(LOSSES["dpo"], PAIRS)
    head.start_reference(torch.device("cpu"))
    with torch.no_grad():
        assert float(head.loss_sum(hidden, weight, labels, softcap=None)) == 0.0
    logps = (hidden[0] @ weight.T).log_softmax(-1).gather(1, _tokens(labels)[:, None])[:, 0]
    expected = torch.stack([logps[completion == n].sum() for n in range(2 * PAIRS)])
    assert head.reference is not None
    torch.testing.assert_close(head.reference, expected)
