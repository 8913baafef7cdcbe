"""Which delta-rule implementation linear-attention layers run (slide_hf/adapters/linear_attention.py).

flash-linear-attention (fla) is not installed where these tests run, so its import, versions and the GPU's
architecture are stubbed at the module's seams; its "kernel" is transformers' own torch function (a correct
kernel), or that function made wrong, and the check runs on the CPU in fp32.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import types

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

from slide_hf import build_model
from slide_hf.adapters import linear_attention as la
from slide_hf.errors import UserError
from slide_hf.presets import PRESETS

CUDA = torch.device("cuda", 0)  # a device object only: nothing here runs on a GPU
REFERENCE = la._torch_kernels(modeling_qwen3_5.Qwen3_5GatedDeltaNet)[la._CHUNK]


def _fla_missing(monkeypatch) -> None:
    def absent() -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'fla'", name="fla")

    monkeypatch.setattr(la, "_import_fla", absent)


def _fla_installed(monkeypatch, *, version="0.6.0", triton="3.6.0", capability=(9, 0), kernel=REFERENCE) -> list:
    """fla importable at ``version`` beside ``triton`` on a GPU of ``capability``; its chunked rule is
    ``kernel``, checked on the CPU in fp32. Returns the list of kernel loads."""
    monkeypatch.setattr(la, "_import_fla", lambda: types.SimpleNamespace(__version__=version))
    monkeypatch.setattr(la, "_version_of", lambda name: triton if name == "triton" else None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(la.torch.version, "hip", None)
    loads: list = []

    def load():
        loads.append(kernel)
        return kernel

    monkeypatch.setattr(la, "_load_fla_chunk", load)
    real_check = la.check_against_torch
    monkeypatch.setattr(
        la,
        "check_against_torch",
        lambda cand, ref, device, dtype: real_check(cand, ref, torch.device("cpu"), torch.float32),
    )
    return loads


def test_fla_missing_runs_the_torch_path_and_says_so_once(monkeypatch, caplog) -> None:
    _fla_missing(monkeypatch)
    owner = la.LinearAttention.for_class(modeling_qwen3_5.Qwen3_5GatedDeltaNet, la.AUTO)
    with caplog.at_level(logging.INFO, logger=la.__name__):
        path = owner.path_for(CUDA, torch.bfloat16)
        assert owner.path_for(CUDA, torch.bfloat16) is path  # decided once
    assert path.name == la.TORCH and path.chunk is REFERENCE
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["linear attention: torch path (flash-linear-attention is not installed)"]


def test_fla_on_hopper_with_old_triton_runs_the_torch_path_with_the_reason(monkeypatch) -> None:
    loads = _fla_installed(monkeypatch, version="0.6.0", triton="3.6.0", capability=(9, 0))
    path = la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)
    assert path.name == la.TORCH
    assert path.describe() == (
        "torch path (flash-linear-attention 0.6.0 refuses its backward on Hopper with Triton 3.6.0 < 3.7.1)"
    )
    assert loads == []  # refused before its kernel is touched


@pytest.mark.parametrize(("triton", "capability"), [("3.7.1", (9, 0)), ("3.6.0", (8, 0)), ("3.6.0", (10, 0))])
def test_fla_usable_is_chosen(monkeypatch, triton, capability) -> None:
    loads = _fla_installed(monkeypatch, triton=triton, capability=capability)
    path = la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)
    assert path.name == la.FLA and path.chunk is REFERENCE and len(loads) == 1
    assert path.describe().startswith(f"flash-linear-attention (0.6.0, Triton {triton}, matched transformers'")


def test_an_old_fla_is_refused(monkeypatch) -> None:
    _fla_installed(monkeypatch, version="0.5.2", capability=(8, 0))
    path = la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)
    assert (path.name, path.reason) == (la.TORCH, "flash-linear-attention 0.5.2 is older than 0.6.0")


def test_a_kernel_that_disagrees_with_the_torch_path_is_refused(monkeypatch) -> None:
    def off_by_five_percent(query, key, value, **options):
        out, state = REFERENCE(query, key, value, **options)
        return out * 1.05, state

    _fla_installed(monkeypatch, capability=(8, 0), kernel=off_by_five_percent)
    path = la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)
    assert path.name == la.TORCH
    assert "output differs from transformers' torch path by 0.05" in path.reason


def test_a_kernel_that_gets_only_the_backward_wrong_is_refused(monkeypatch) -> None:
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, key):
            return key.clone()

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    def wrong_key_gradient(query, key, value, **options):
        return REFERENCE(query, WrongGrad.apply(key), value, **options)

    _fla_installed(monkeypatch, capability=(8, 0), kernel=wrong_key_gradient)
    path = la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)
    assert path.name == la.TORCH and "gradient of key differs" in path.reason


def test_a_kernel_that_raises_is_refused_but_a_cuda_fault_is_not_swallowed(monkeypatch) -> None:
    def refuses(query, key, value, **options):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    _fla_installed(monkeypatch, capability=(8, 0), kernel=refuses)
    path = la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)
    assert path.name == la.TORCH and "failed a check" in path.reason and "incorrect results" in path.reason

    def faults(query, key, value, **options):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    _fla_installed(monkeypatch, capability=(8, 0), kernel=faults)
    with pytest.raises(torch.AcceleratorError):
        la.choose_linear_attention(la.AUTO, CUDA, torch.bfloat16, REFERENCE)


def test_requests(monkeypatch) -> None:
    _fla_installed(monkeypatch, capability=(8, 0))
    assert la.choose_linear_attention(la.TORCH, CUDA, torch.bfloat16, REFERENCE).reason == f"{la.ENV_VAR}=torch"
    assert la.choose_linear_attention(la.FLA, CUDA, torch.bfloat16, REFERENCE).name == la.FLA
    for device in ("cpu", "meta"):  # never fla, whatever is installed
        assert la.choose_linear_attention(la.AUTO, torch.device(device), torch.float32, REFERENCE).name == la.TORCH
    with pytest.raises(UserError, match="CUDA only") as info:
        la.choose_linear_attention(la.FLA, torch.device("cpu"), torch.float32, REFERENCE)
    assert "\n" not in str(info.value)
    _fla_installed(monkeypatch, triton="3.6.0", capability=(9, 0))
    with pytest.raises(UserError, match=r"SLIDE_LINEAR_ATTENTION=fla, but .* refuses its backward on Hopper"):
        la.choose_linear_attention(la.FLA, CUDA, torch.bfloat16, REFERENCE)
    assert la.requested_linear_attention({}) == la.AUTO
    assert la.requested_linear_attention({la.ENV_VAR: "Torch"}) == la.TORCH
    with pytest.raises(UserError, match="SLIDE_LINEAR_ATTENTION='triton' is not one of auto, torch, fla"):
        la.requested_linear_attention({la.ENV_VAR: "triton"})


def test_a_bad_request_is_refused_when_the_model_is_built(monkeypatch) -> None:
    monkeypatch.setenv(la.ENV_VAR, "yes")
    with pytest.raises(UserError, match=la.ENV_VAR):
        build_model(PRESETS["test-qwen3.5"]())


def _picked_at_import(torch_function):
    """What transformers' decorator makes of ``torch_function`` when fla imports: a wrapper around another
    kernel (here one that fails) that keeps the torch function as ``__wrapped__``."""

    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        raise AssertionError("transformers' module-level kernel ran")

    return wrapped


@pytest.mark.parametrize(
    ("preset", "module"),
    [("test-qwen3.5", modeling_qwen3_5), ("test-qwen3-next", modeling_qwen3_next)],
)
def test_layers_run_the_models_choice_not_transformers_import_time_pick(monkeypatch, preset, module) -> None:
    """transformers bound ``torch_chunk_gated_delta_rule`` to fla's kernel at import when fla was there;
    replaced by a function that fails, the model's layers never call it, on the CPU or on meta."""
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        monkeypatch.setattr(module, name, _picked_at_import(getattr(module, name)))
    model = build_model(PRESETS[preset]())
    assert model.linear_attention is not None
    block = next(b for b in model.blocks if b.attention_type == "linear_attention")
    ids = torch.zeros((1, 8), dtype=torch.long)
    inputs = model.prepare_inputs(ids, ids, torch.float32)
    params = {s.name: torch.randn(s.shape).mul_(0.02).requires_grad_() for s in block.layout}
    x = torch.randn((1, 8, model.config.hidden_size), requires_grad=True)
    block.forward(params, x, inputs).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()

    from slide_hf.planner.activations import BlockActivations

    measured = BlockActivations.of(model).saved_bytes(16, torch.bfloat16)
    assert measured[block.name] is not None and measured[block.name] > 0  # measured on meta, torch path


def test_layers_call_the_chosen_kernel(monkeypatch) -> None:
    """A path chosen for a device is what the layers call there (here an fla path on the CPU, by stub)."""
    calls = []

    def recording(query, key, value, **options):
        calls.append((query.device.type, query.dtype))
        return REFERENCE(query, key, value, **options)

    monkeypatch.setattr(
        la,
        "choose_linear_attention",
        lambda request, device, dtype, reference: la.LinearAttentionPath(la.FLA, "stub", recording),
    )
    model = build_model(PRESETS["test-qwen3.5"]())
    block = next(b for b in model.blocks if b.attention_type == "linear_attention")
    ids = torch.zeros((1, 8), dtype=torch.long)
    inputs = model.prepare_inputs(ids, ids, torch.float32)
    assert model.linear_attention.path_for(torch.device("cpu"), torch.float32).name == la.FLA
    params = {s.name: torch.zeros(s.shape) for s in block.layout}
    block.forward(params, torch.zeros((1, 8, model.config.hidden_size)), inputs)
    assert calls == [("cpu", torch.float32)]


def test_two_models_choose_independently(monkeypatch) -> None:
    monkeypatch.setenv(la.ENV_VAR, "torch")
    forced = build_model(PRESETS["test-qwen3.5"]())
    monkeypatch.delenv(la.ENV_VAR)
    _fla_missing(monkeypatch)
    free = build_model(PRESETS["test-qwen3.5"]())
    assert forced.linear_attention.path_for(CUDA, torch.bfloat16).reason == "SLIDE_LINEAR_ATTENTION=torch"
    assert free.linear_attention.path_for(CUDA, torch.bfloat16).reason == "flash-linear-attention is not installed"


def test_models_without_delta_nets_have_no_linear_attention() -> None:
    assert build_model(PRESETS["test-llama"]()).linear_attention is None


def test_slide_train_runs_the_torch_path_on_the_cpu(monkeypatch, slide, caplog, tmp_path) -> None:
    """`slide train --device cpu` of a tiny Qwen3.5 learns on transformers' torch path, though transformers
    picked another kernel at import, and says so in one line."""
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        monkeypatch.setattr(modeling_qwen3_5, name, _picked_at_import(getattr(modeling_qwen3_5, name)))
    argv = ["train", "--model", "test-qwen3.5", "--device", "cpu", "--dtype", "float32", "--steps", "4"]
    argv += ["--seq-len", "32", "--batch-size", "2", "--no-packing", "--lr", "3e-3", "--output", str(tmp_path / "run")]
    argv += ["--metrics", str(tmp_path / "metrics.jsonl")]
    with caplog.at_level(logging.INFO):
        status, _, err = slide(*argv)
    assert status == 0, err
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear attention:")]
    assert lines == [
        "linear attention: torch path (flash-linear-attention's kernels run on CUDA only, not on the cpu device)"
    ]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_a_broken_fla_and_tilelang_beside_fla() -> None:
    broken = la.FlaFacts(None, problem="ImportError: libcudart.so.12: cannot open shared object file")
    assert la.fla_refusal(broken) == (
        "flash-linear-attention does not import: ImportError: libcudart.so.12: cannot open shared object file"
    )
    hopper = la.FlaFacts("0.6.0", triton="3.6.0", capability=(9, 0))
    assert "refuses its backward on Hopper" in la.fla_refusal(hopper)
    # fla routes the affected kernel through tilelang when it is installed: the check on the GPU decides
    assert la.fla_refusal(la.FlaFacts("0.6.0", triton="3.6.0", capability=(9, 0), tilelang=True)) is None
    assert la.fla_refusal(la.FlaFacts("0.6.0", triton="3.3.1", capability=(9, 0))) is None  # before the bug
    assert la.fla_refusal(la.FlaFacts("0.6.0", triton="3.6.0", capability=None)) is None  # ROCm
