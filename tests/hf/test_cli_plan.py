"""`slide plan`, run in-process through `slide_hf.cli.main.main`."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from slide_hf import setup
from slide_hf.cli import plan as plan_cli

pytest.importorskip("transformers")

Slide = Callable[..., tuple[int, str, str]]


@pytest.fixture(autouse=True)
def _fused_loss_installed(monkeypatch) -> None:
    """slide-kernels is a dependency of slide-hf, but a dev checkout may lack it; plan as installed."""
    monkeypatch.setattr(setup, "fused_loss_available", lambda: True)


def test_plan_tiny_llama_table(slide):
    # --gpu-memory: a plan for a GPU on any machine (a CPU-device plan has no GPU breakdown)
    argv = ("plan", "--model", "tiny-llama", "--batch-size", "2", "--seq-len", "256", "--gpu-memory", "700MiB")
    status, out, err = slide(*argv)
    assert status == 0, err
    for label in ("GPU peak", "block slots", "host peak", "master (split)", "disk", "params", "max batch"):
        assert label in out
    for label in ("step time", "in engine order", "overlap", "binding limit", "critical batch", "fits"):
        assert label in out
    assert "on the busiest resource" in out  # the schedule's step beside the resources'
    assert "2,968,576" in out  # tiny-llama's parameter count with the bundled byte tokenizer, as `slide train` has it
    assert "larger batches raise overlap" in out  # a tiny batch cannot hide the optimizer


def test_plan_seq_len_defaults_to_2048_or_the_models_context_length(slide):
    status, out, err = slide("plan", "--model", "tiny-llama", "--json")
    assert status == 0, err
    assert json.loads(out)["inputs"]["seq_len"] == 2048
    status, out, err = slide("plan", "--model", "test-gpt2", "--json")  # 64 positions
    assert status == 0, err
    plan = json.loads(out)
    assert plan["inputs"]["seq_len"] == 64 and plan["problem"] is None


@pytest.mark.parametrize("dtype", [None, "bf16", "bfloat16"])
def test_plan_split_master_in_bf16_either_spelling(slide, dtype):
    """`--master split` plans in bf16, the default, whichever way the dtype is written; fp32 is one line, the
    same `slide train` prints (one rule, slide_hf/options/validate.py)."""
    spelled = () if dtype is None else ("--dtype", dtype)
    status, out, err = slide(
        "plan", "--model", "tiny-llama", "--seq-len", "128", "--master", "split", *spelled, "--json"
    )
    assert status == 0, err
    assert json.loads(out)["master"] == "split"
    status, _, err = slide("plan", "--model", "tiny-llama", "--master", "split", "--dtype", "fp32")
    assert status == 2 and err.strip().endswith("so it needs --dtype bfloat16, got float32; use --master fp32 or auto")


def test_plan_tiny_llama_json(slide):
    status, out, _ = slide("plan", "--model", "tiny-llama", "--seq-len", "128", "--gpu-memory", "4GiB", "--json")
    assert status == 0
    plan = json.loads(out)
    assert plan["model"] == "tiny-llama" and plan["params"] == 2_968_576  # the byte vocabulary `slide train` uses
    assert plan["gpu_peak_bytes"] == sum(plan["gpu_breakdown"].values())
    assert plan["host_peak_bytes"] == sum(plan["host_breakdown"].values())
    assert plan["inputs"]["gpu_memory_bytes"] == 4 << 30
    assert plan["max_batch_size"] >= 1 and plan["max_batch_limit"] in ("gpu", "host")
    assert plan["binding"] == max(plan["resource_s"], key=plan["resource_s"].get)
    assert plan["fits"] is True and plan["problem"] is None


def test_plan_llama31_8b_table(slide):
    status, out, err = slide(
        "plan", "--model", "llama3.1-8b", "--batch-size", "8", "--gpu-memory", "24GiB", "--host-memory", "1TB"
    )
    assert status == 0, err
    assert "8,030,261,248" in out
    assert "limited by GPU memory, allowed by --gpu-memory" in out
    assert out.rstrip().splitlines()[-1].split() == ["fits", "yes"]


def test_plan_llama31_8b_json_that_does_not_fit(slide):
    argv = ["plan", "--model", "llama3.1-8b", "--batch-size", "64", "--gpu-memory", "24GiB", "--host-memory", "1TiB"]
    argv += ["--seq-tile", "0"]  # untiled: --seq-tile auto would tile the 64 x 2048 tokens until they fit
    status, out, _ = slide(*argv, "--offload-optimizer", "nvme", "--nvme-fraction", "0.5", "--json")
    assert status == 0  # a plan is a report; --check makes a misfit an error
    plan = json.loads(out)
    assert plan["fits"] is False
    assert f"largest that fits: {plan['max_batch_size']})" in plan["problem"]
    assert plan["disk_bytes"] > 0 and plan["inputs"]["nvme_fraction"] == 0.5
    status, out, err = slide(*argv, "--check")
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("slide plan: error: needs ") and "Traceback" not in err
    assert "GPU memory, 24.0 GiB allowed by --gpu-memory" in err


@pytest.mark.parametrize("value", ["24XB", "lots", "-3GiB"])
def test_bad_gpu_memory_is_one_line(slide, value):
    status, out, err = slide("plan", "--model", "tiny-llama", f"--gpu-memory={value}")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--gpu-memory" in err and repr(value) in err


def test_unknown_preset_is_one_line(slide):
    status, out, err = slide("plan", "--model", "llama-9000")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "unknown model 'llama-9000'" in err and "tiny-llama" in err


def test_missing_directory_is_one_line(slide, tmp_path):
    status, _, err = slide("plan", "--model", str(tmp_path / "nothing" / "here"))
    assert status == 2 and err.count("\n") == 1 and "does not exist" in err


def test_bad_nvme_fraction_is_one_line(slide):
    status, _, err = slide("plan", "--model", "tiny-llama", "--nvme-fraction", "2")
    assert status == 2 and err.count("\n") == 1 and "--nvme-fraction" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--nproc-per-node", "0"), "--nproc-per-node must be >= 1, got 0"),
        (("--nnodes", "-2"), "--nnodes must be >= 1, got -2"),
        (("--intra-gbps", "inf"), "--intra-gbps must be a finite number >= 0.001 (GB/s), got inf"),
        (("--inter-gbps", "nan"), "--inter-gbps must be a finite number >= 0.001 (GB/s), got nan"),
        (("--inter-gbps", "0"), "--inter-gbps must be a finite number >= 0.001 (GB/s), got 0.0"),
    ],
)
def test_bad_data_parallel_options_are_one_line(slide, argv, message):
    status, _, err = slide("plan", "--model", "tiny-llama", *argv)
    assert status == 2 and err.count("\n") == 1 and message in err


def test_without_slide_kernels_the_logits_count_in_full(slide, monkeypatch):
    argv = ("plan", "--model", "llama3.1-8b", "--batch-size", "8", "--gpu-memory", "80GiB", "--json")
    fused = json.loads(slide(*argv)[1])
    monkeypatch.setattr(setup, "fused_loss_available", lambda: False)
    eager = json.loads(slide(*argv)[1])
    assert fused["inputs"]["fused_loss"] and not eager["inputs"]["fused_loss"]
    assert eager["gpu_phases"]["head"] - fused["gpu_phases"]["head"] > 8 * 2048 * 128256 * 12
    assert "slide-kernels is not installed" in slide(*argv[:-1])[1]


def test_help_has_examples(slide, capsys):
    status, out, _ = slide("plan", "--help")
    assert status == 0
    assert "examples:\n  slide plan --model llama3.1-8b" in out
    text = " ".join(out.split())
    assert "--offload-optimizer NAME" in text and "one of ram, gds, hipfile, nvme, pinned (default ram)" in text
    assert "--device NAME" in text and "one of auto, cpu, cuda, rocm" in text
    assert "--optimizer NAME" in text and "one of auto, fused-adamw, torch-adamw" in text


def test_plugin_names_choose_the_budget_the_tier_and_the_optimizer(slide):
    from slide_hf.device_defaults import default_compute_dtype

    argv = ("plan", "--model", "tiny-llama", "--seq-len", "128", "--json")
    on_cpu = json.loads(slide(*argv, "--device", "cpu")[1])
    assert on_cpu["gpu_memory_source"] == "the CPU device: no GPU memory"
    chosen = default_compute_dtype(False, "fp32").dtype.value  # this CPU's, as `slide train` takes it here
    assert on_cpu["engine_config"]["compute_dtype"] == on_cpu["dtype"] == chosen
    on_disk = json.loads(slide(*argv, "--offload-optimizer", "nvme")[1])
    in_memory = json.loads(slide(*argv, "--offload-optimizer", "pinned")[1])
    assert on_disk["disk_bytes"] > 0 and on_disk["state_tier"] == "nvme"
    assert in_memory["disk_bytes"] == 0 and in_memory["state_tier"] == "pinned"  # a tier in memory is host RAM
    assert json.loads(slide(*argv, "--optimizer", "torch-adamw")[1])["optimizer"] == "TorchAdamW"
    status, out, _ = slide("plan", "--model", "tiny-llama", "--optimizer", "fused-adamw")
    assert status == 0 and "FusedAdamW, Adam state on ram" in out


@pytest.mark.parametrize(
    ("flag", "value"), [("--device", "tpu"), ("--optimizer", "sgd"), ("--offload-optimizer", "tape")]
)
def test_an_unknown_plugin_name_is_one_line(slide, flag, value):
    status, out, err = slide("plan", "--model", "tiny-llama", flag, value)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert f"{flag} must be one of" in err and f"got {value!r}" in err


def test_plan_prices_the_checkpoints_and_the_export(slide):
    """One checkpoint is the master and moments the engine writes (12 B/param in fp32, 8 with bf16 moments),
    times those that exist at once (kept, best, the one being written), plus the exported model."""
    from slide_core.optim.state_formats import checkpoint_arrays, checkpoint_bytes, state_arrays
    from slide_hf import build_model, resolve_model
    from slide_hf.presets import run_overrides

    model = build_model(resolve_model("tiny-llama", **run_overrides("tiny-llama"))[0])  # the model `slide train` builds
    numels = [unit.layout.numel for unit in model.units]
    params = sum(unit.layout.param_numel for unit in model.units)
    base = ("plan", "--model", "tiny-llama", "--seq-len", "256", "--json")
    plain = json.loads(slide(*base)[1])["output_disk"]
    assert plain["checkpoint_bytes"] == checkpoint_bytes(checkpoint_arrays(state_arrays("fp32")), numels)
    assert plain["checkpoint_bytes"] == 12 * sum(numels)
    assert plain["checkpoints_at_once"] == 3 and plain["export_bytes"] == params * 4  # the preset's fp32
    best = json.loads(slide(*base, "--keep-checkpoints", "5", "--save-best", "--optimizer-state", "bf16")[1])
    disk = best["output_disk"]
    assert disk["checkpoint_bytes"] == 8 * sum(numels) and disk["checkpoints_at_once"] == 7
    assert disk["total_bytes"] == 7 * disk["checkpoint_bytes"] + disk["export_bytes"]
    status, out, _ = slide("plan", "--model", "tiny-llama", "--save-dtype", "bfloat16")
    assert status == 0 and "output disk" in out and "3 at once" in out
    assert json.loads(slide(*base, "--save-dtype", "bfloat16")[1])["output_disk"]["export_bytes"] == params * 2


def test_plan_prints_the_update_placement_and_each_resources_time(slide, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no measurement cached: the documented defaults
    status, out, err = slide("plan", "--model", "tiny-llama", "--seq-len", "128", "--gpu-memory", "4GiB")
    assert status == 0, err
    assert "update placement" in out and " resident, " in out and " streamed, " in out and " host " in out
    for resource in ("gpu compute", "pcie h2d", "pcie d2h", "host memory", "cpu", "nvme"):
        assert f"\n  {resource}" in out
    assert "documented defaults" in out
    status, out, err = slide(
        "plan", "--model", "tiny-llama", "--seq-len", "128", "--gpu-memory", "4GiB", "--update-placement", "gpu"
    )
    assert status == 0, err
    assert "0 host (units by where their update runs)" in out and "streamed staging" in out


def test_render_lists_the_streamed_units():
    from slide_core.testing import ToyConfig, ToyModel
    from slide_hf.planner import ModelShape, PlanInputs, plan_with_placement

    model = ToyModel(ToyConfig(vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=768, num_layers=3))
    plan = plan_with_placement(PlanInputs(ModelShape.of(model), seq_len=64, gpu_memory_bytes=8 << 30), "gpu")
    text = plan_cli.render(
        plan, model_name="toy", dtype="bfloat16", gpu_source="", problem=None, update_placement="gpu", rates_source="x"
    )
    assert "0 resident, 5 streamed, 0 host" in text
    assert "GPU-streamed" in text and "embed, layers.0-2, head" in text  # the model's own unit names


def test_plan_json_has_the_placement_and_the_resources(slide, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("plan", "--model", "tiny-llama", "--seq-len", "128", "--gpu-memory", "4GiB", "--json")
    status, out, err = slide(*argv, "--update-placement", "gpu")
    assert status == 0, err
    plan = json.loads(out)
    assert plan["update_placement"] == "gpu" and plan["rates_source"].startswith("documented defaults")
    placed = plan["placement"]
    assert placed["host"] == [] and placed["streamed"] == plan["inputs"]["streamed_units"]
    assert sorted(placed["resident"] + placed["streamed"]) == sorted(
        ["embedding", "head", *(f"block.{i}" for i in range(len(placed["resident"]) + len(placed["streamed"]) - 2))]
    )
    # the step: the engine's order (the host optimizer's time in it), bounded by every other resource
    assert plan["step_time_s"] >= max(t for r, t in plan["resource_s"].items() if r != "cpu")
    assert plan["resource_bound_s"] == pytest.approx(max(plan["resource_s"].values()))
    status, out, err = slide(*argv, "--update-placement", "host")
    assert status == 0, err
    assert json.loads(out)["placement"]["streamed"] == []


def test_a_data_parallel_plan_places_units_as_each_rank_does(slide, tmp_path, monkeypatch):
    """Each `slide train` rank places its units as one process does (residents in the spare GPU memory, then
    the GPU-streamed updates, and the units it may move between them: rank 0 decides each move for all,
    Note [Ranks place alike]): `slide plan --nproc-per-node 2` prints that placement, not an unplaced plan."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "24GiB", "--update-placement", "auto", "--json")
    status, out, err = slide(*argv)
    assert status == 0, err
    alone = json.loads(out)
    status, out, err = slide(*argv, "--nproc-per-node", "2")
    assert status == 0, err
    ranks = json.loads(out)
    assert ranks["placement"]["resident"], "the 24 GiB budget keeps some units resident"
    assert ranks["placement"] == alone["placement"]
    assert alone["engine_config"]["streamable_units"]
    assert ranks["engine_config"] == alone["engine_config"]
    assert ranks["data_parallel"]["gpu_peak_bytes"] <= 24 << 30


def test_a_host_hint_keeps_the_units_it_moves_to_nvme_out_of_the_gpu_streamed_update(slide, tmp_path, monkeypatch):
    """An auto plan names units the run may move to the GPU-streamed update; the host hint's NVMe trials may
    put some of those units' state on NVMe, where no streamed unit keeps it: the trial drops them from the
    movable ones, and the verdict is a hint, not an internal error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("plan", "--model", "llama3.1-8b", "--gpu-memory", "24GiB", "--update-placement", "auto")
    for host in ("40GiB", "60GiB", "80GiB", "16GiB"):
        status, out, err = slide(*argv, "--host-memory", host, "--json")
        assert status == 0, err
        planned = json.loads(out)
        assert planned["engine_config"]["streamable_units"], host
        problem = planned["problem"]
        assert planned["fits"] is False and "host RAM" in problem, host
        assert "try " in problem or "use a machine with more RAM" in problem, host


def test_unit_names_shows_runs_of_blocks_as_ranges():
    names = ("embedding", "block.0", "block.1", "block.2", "block.5", "block.7", "block.8", "head")
    assert plan_cli.unit_names(names) == "embedding, block.0-2, block.5, block.7-8, head"
