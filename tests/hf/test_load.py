"""Loading: configs, sharded safetensors streamed into the host masters, clear errors, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slide_core.host_params import HostParameters
from slide_hf import PRESETS, CheckpointError, ModelFilesError, build_model, load_config, load_weights
from slide_hf.model import checkpoint_entries, unit_views


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def _assert_host_equals_files(model, host, path):
    files = _state_dict(path)
    views = unit_views(host)
    for entry in checkpoint_entries(model):
        assert torch.equal(entry.target(views[entry.unit.name]), files[entry.key].float()), entry.key


@pytest.mark.parametrize("preset", ["test-llama-untied", "test-qwen3-moe", "test-gpt2"])
def test_sharded_checkpoint_with_index(reference, preset):
    ref = reference(preset, max_shard_size="20KB")
    index = json.loads((ref.path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    _assert_host_equals_files(ref.model, ref.host, ref.path)


def test_fused_moe_state_dict_loads(reference, tmp_path):
    """A transformers-5 state dict saved as-is keeps MoE experts fused; that loads too."""
    ref = reference("test-qwen3-moe")
    state = {k: v.detach().contiguous() for k, v in ref.hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    host = HostParameters(ref.model)
    load_weights(ref.model, host, tmp_path)
    assert torch.equal(host.slab, ref.host.slab)


def test_bf16_checkpoint_upcasts(tmp_path):
    config = PRESETS["test-llama"]()
    model = build_model(config)
    tensors = {
        e.key: torch.randn(e.target(unit_views(HostParameters(model))[e.unit.name]).shape).to(torch.bfloat16)
        for e in checkpoint_entries(model)
    }
    config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    host = HostParameters(model)
    load_weights(model, host, tmp_path)
    assert host.slab.dtype == torch.float32
    _assert_host_equals_files(model, host, tmp_path)


def _write_checkpoint(model, path: Path, *, drop: str | None = None, reshape: str | None = None, prefix=""):
    views = unit_views(HostParameters(model))
    tensors = {}
    for e in checkpoint_entries(model):
        shape = tuple(e.target(views[e.unit.name]).shape)
        if e.key == reshape:
            shape = (shape[0] + 1, *shape[1:])
        if e.key != drop:
            tensors[e.key.removeprefix(prefix)] = torch.randn(shape)
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_missing_key_is_named(tmp_path):
    model = build_model(PRESETS["test-llama"]())
    key = "model.layers.1.mlp.down_proj.weight"
    _write_checkpoint(model, tmp_path, drop=key)
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*{key}"):
        load_weights(model, HostParameters(model), tmp_path)


def test_untied_model_needs_lm_head(tmp_path):
    model = build_model(PRESETS["test-llama-untied"]())
    _write_checkpoint(model, tmp_path, drop="lm_head.weight")
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_weights(model, HostParameters(model), tmp_path)


def test_tied_checkpoint_with_extra_lm_head_loads(tmp_path):
    model = build_model(PRESETS["test-llama"]())
    tensors = _write_checkpoint(model, tmp_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    host = HostParameters(model)
    load_weights(model, host, tmp_path)
    assert torch.equal(host.views(model.embedding)["embed_tokens.weight"], tensors["model.embed_tokens.weight"])


def test_shape_mismatch_names_key_and_file(tmp_path):
    model = build_model(PRESETS["test-qwen2"]())
    key = "model.layers.0.self_attn.k_proj.bias"
    _write_checkpoint(model, tmp_path, reshape=key)
    host = HostParameters(model)
    host.slab.fill_(7.0)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: {key} has shape \[33\], the model expects \[32\]"):
        load_weights(model, host, tmp_path)
    assert bool((host.slab == 7.0).any())  # headers are checked before anything is written


def test_unprefixed_gpt2_checkpoint(tmp_path):
    """The original GPT-2 checkpoints store ``h.0...`` / ``wte.weight`` without ``transformer.``."""
    model = build_model(PRESETS["test-gpt2"]())
    tensors = _write_checkpoint(model, tmp_path, prefix="transformer.")
    host = HostParameters(model)
    load_weights(model, host, tmp_path)
    assert torch.equal(host.views(model.embedding)["wte.weight"], tensors["wte.weight"])


def test_index_listing_missing_shard(reference):
    ref = reference("test-llama", max_shard_size="20KB")
    shard = sorted(ref.path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        load_weights(ref.model, ref.host, ref.path)


def test_directory_errors(tmp_path):
    with pytest.raises(ModelFilesError, match="does not exist") as info:
        load_config(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_config(tmp_path)
    model = build_model(PRESETS["test-llama"]())
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_weights(model, HostParameters(model), tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "definitely-not-a-model"}')
    with pytest.raises(ValueError, match=r"cannot read .*config\.json") as info:
        load_config(tmp_path)
    assert "\n" not in str(info.value)


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time
    import psutil
    from slide_core.host_params import HostParameters
    from slide_hf import build_model, load_config, load_weights

    proc = psutil.Process()

    def kernel_peak():
        # VmHWM, the kernel's exact peak RSS of this address space. Not ru_maxrss: that one survives
        # execve, so a child of a big pytest process would report its parent's size.
        try:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return 0

    config = load_config(sys.argv[1])
    model = build_model(config)
    base = proc.memory_info().rss
    host = HostParameters(model)
    host.slab.zero_()  # resident, as a pinned slab would be
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    peak = proc.memory_info().rss
    done = False

    def sample():
        global peak
        while not done:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    load_weights(model, host, sys.argv[1])
    done = True
    thread.join()
    final = proc.memory_info().rss
    print(json.dumps({"base": base, "peak": peak, "hwm": kernel_peak(), "final": final, "slab": host.nbytes}))
    """
)


@pytest.mark.slow  # a fresh Python process: seconds of imports
def test_peak_rss_while_loading_stays_near_final(tmp_path):
    """A >= 200 MB checkpoint in 24 MB shards: loading adds at most 5% on top of what the weights take."""
    config = PRESETS["test-llama-untied"](
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    model = build_model(config)
    views = unit_views(HostParameters(model))
    config.save_pretrained(tmp_path)
    shards, current, size, weight_map = [], {}, 0, {}
    for e in checkpoint_entries(model):
        t = torch.randn(e.target(views[e.unit.name]).shape)
        if current and size + t.numel() * 4 > 24 << 20:
            shards.append(current)
            current, size = {}, 0
        current[e.key] = t
        size += t.numel() * 4
    shards.append(current)
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp_path / name))
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * 4 for t in shard.values())
    del shards, current, views
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert total >= 200e6

    result = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    weights = m["final"] - m["base"]
    assert weights >= 0.95 * m["slab"]
    for peak in (m["peak"], m["hwm"]):
        assert peak - m["base"] <= 1.05 * weights, m


@pytest.mark.parametrize("preset", sorted(name for name in PRESETS if name.startswith("test-")))
def test_checkpoint_entries_cover_every_parameter_element_once(preset):
    """A load writes each unit through ``HostParameters.overwriting``, which does not decode the unit first:
    that is right only if the unit's checkpoint entries, whole tensors or pieces, cover every element of
    every parameter in its layout, each once."""
    model = build_model(PRESETS[preset]())
    entries = checkpoint_entries(model)
    for unit in model.units:
        counts = {spec.name: torch.zeros(spec.shape, dtype=torch.int16) for spec in unit.layout}
        for entry in entries:
            if entry.unit is unit:
                entry.target(counts).add_(1)
        for name, count in counts.items():
            assert bool((count == 1).all()), f"{preset} {unit.name}.{name}: covered {count.min()}-{count.max()} times"
