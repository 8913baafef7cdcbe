"""Export: HF loads what we write (no missing/unexpected keys), with our weights, atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import slide_hf.export as export_mod
from slide_core.host_params import HostParameters
from slide_hf import PRESETS, build_model, export_hf, init_random, load_config, load_weights


def _add_noise(host: HostParameters, seed: int = 3) -> None:
    """Perturb every parameter (not the slab's alignment padding, which no unit reads)."""
    g = torch.Generator().manual_seed(seed)
    for _, _, view in host.named_tensors():
        view.add_(torch.randn(view.shape, generator=g) * 0.01)


def _logits_through_units(model, host, ids, helpers):
    leaves = helpers.leaves_of(model, host)
    inputs = model.prepare_inputs(ids, torch.full_like(ids, -100), torch.float32)
    with torch.no_grad():
        x = helpers.hidden_through_blocks(model, leaves, ids, inputs)
        params = helpers.head_params(model, leaves)
        hidden = model.head.call(model.head.norm_name, params, x)
        logits = hidden @ params[model.head.lm_head_name].T
        if model.head.softcap is not None:
            logits = torch.tanh(logits / model.head.softcap) * model.head.softcap
    return logits


def _files(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


@pytest.mark.parametrize("preset", ["test-llama", "test-llama-untied", "test-gemma2", "test-gpt2", "test-qwen3-moe"])
def test_round_trip_through_transformers(reference, helpers, tmp_path, preset):
    ref = reference(preset)
    _add_noise(ref.host)
    out = export_hf(ref.model, ref.host, load_config(ref.path), tmp_path / "out", max_shard_bytes=40_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all((out / f).is_file() for f in index["weight_map"].values())

    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.dtype == torch.float32
    ids, _ = helpers.batch(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
    got = _logits_through_units(ref.model, ref.host, ids, helpers)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    tied = ref.model.config.tie_word_embeddings
    assert ("lm_head.weight" in index["weight_map"]) is not tied


def test_export_then_load_is_identity(reference, tmp_path):
    ref = reference("test-qwen3-moe")
    _add_noise(ref.host)
    out = export_hf(ref.model, ref.host, ref.model.config, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    again = HostParameters(ref.model)
    load_weights(ref.model, again, out)
    assert torch.equal(again.slab, ref.host.slab)


def _tiny(preset: str = "test-llama", **overrides):
    config = PRESETS[preset](**overrides)
    model = build_model(config)
    host = HostParameters(model)
    init_random(model, host, config, seed=0)
    return config, model, host


def _dtypes(path: Path) -> set[torch.dtype]:
    return {t.dtype for t in _files(path).values()}


def test_dtype_default_and_override(tmp_path):
    config, model, host = _tiny()
    assert _dtypes(export_hf(model, host, config, tmp_path / "fp32")) == {torch.float32}
    out = export_hf(model, host, config, tmp_path / "bf16", dtype="bfloat16")
    assert _dtypes(out) == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    emb = _files(out)["model.embed_tokens.weight"]
    assert torch.equal(emb, host.views(model.embedding)["embed_tokens.weight"].to(torch.bfloat16))

    config, model, host = _tiny(dtype="bfloat16")  # a published bf16 model stays bf16 by default
    assert _dtypes(export_hf(model, host, config, tmp_path / "default")) == {torch.bfloat16}
    assert _dtypes(export_hf(model, host, config, tmp_path / "up", dtype=torch.float32)) == {torch.float32}


def test_refuses_existing_dir_unless_overwrite(tmp_path):
    config, model, host = _tiny()
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="already exists"):
        export_hf(model, host, config, out)
    assert (out / "old.txt").exists()
    export_hf(model, host, config, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _failing_save(monkeypatch, fail_on_call: int):
    calls = {"n": 0}
    real = export_mod.save_file

    def save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(export_mod, "save_file", save)


def test_overwrite_replaces_a_file(tmp_path):
    config, model, host = _tiny()
    (tmp_path / "out").write_text("a file, not an export")
    out = export_hf(model, host, config, tmp_path / "out", overwrite=True)
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    config, model, host = _tiny()
    _failing_save(monkeypatch, fail_on_call=2)
    with pytest.raises(OSError, match="simulated"):
        export_hf(model, host, config, tmp_path / "out", max_shard_bytes=20_000)
    assert list(tmp_path.iterdir()) == []  # no out dir, no temp dir


def test_failure_during_overwrite_keeps_old_export(tmp_path, monkeypatch):
    config, model, host = _tiny()
    out = export_hf(model, host, config, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _add_noise(host)
    _failing_save(monkeypatch, fail_on_call=1)
    with pytest.raises(OSError, match="simulated"):
        export_hf(model, host, config, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_tokenizer_files_are_copied(tmp_path):
    config, model, host = _tiny()
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "model.safetensors").write_text("not copied")
    out = export_hf(model, host, config, tmp_path / "out", tokenizer_dir=tok)
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "tokenizer_config.json").exists()
    assert (out / "model.safetensors").read_bytes() != b"not copied"

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        export_hf(model, host, config, tmp_path / "out2", tokenizer_dir=tmp_path / "empty")
    assert not (tmp_path / "out2").exists()


def test_bad_dtype_rejected(tmp_path):
    config, model, host = _tiny()
    with pytest.raises(ValueError, match="cannot export as"):
        export_hf(model, host, config, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()
