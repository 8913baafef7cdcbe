"""`slide plan` on hostile input: a model directory whose config.json no model can have, options `slide train`
refuses, and option values whose cost once grew without bound. Each bad case ends in one line on stderr, exit
status 2 and no traceback, within a time limit; `slide train` refuses the same configs in the same words,
before any weight is read (the directories hold no weights). Then the printed plan's step lines, which must
not contradict each other, on several configurations."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from slide_hf.planner.unit_costs import RESOURCES

BASE_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
"""A small Llama, valid as it is: each case changes one field."""

CONFIG_CASES = {
    # name: (changes to BASE_CONFIG, the field the one line must name)
    "a hidden size of a billion": ({"hidden_size": 10**9}, "hidden_size"),
    "a negative hidden size": ({"hidden_size": -64}, "hidden_size"),
    "zero attention heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "a hidden size as a string": ({"hidden_size": "64"}, "hidden_size"),
    "a fractional hidden size": ({"hidden_size": 64.5}, "hidden_size"),
    "a NaN hidden size": ({"hidden_size": float("nan")}, "hidden_size"),
    "a boolean layer count": ({"num_hidden_layers": True}, "num_hidden_layers"),
    "heads that do not divide the hidden size": ({"num_attention_heads": 3}, "num_attention_heads"),
    "kv heads that do not divide the heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "a million layers": ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
    "a vocabulary of zero": ({"vocab_size": 0}, "vocab_size"),
    "a nested text config's hidden size": ({"text_config": {"hidden_size": -1}}, "text_config.hidden_size"),
}


def _model_dir(root: Path, changes: dict) -> Path:
    """A model directory holding only config.json: BASE_CONFIG with ``changes``."""
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**BASE_CONFIG, **changes}))
    return model


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_config_no_model_can_have_is_one_line_naming_the_file_and_the_field(slide, tmp_path, case):
    changes, field = CONFIG_CASES[case]
    model = _model_dir(tmp_path, changes)
    status, out, err = slide("plan", "--model", str(model))
    assert status == 2 and out == ""
    line = _one_line(err)
    assert line.startswith(f"slide plan: error: {model / 'config.json'}: {field} "), line


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["a hidden size of a billion", "a hidden size as a string", "a million layers"])
def test_train_refuses_the_same_configs_in_the_same_words(slide, tmp_path, case):
    """The check is the one `slide_hf.load.load_config` makes for every command, before the model is built
    (here there are no weights to read)."""
    changes, _ = CONFIG_CASES[case]
    model = _model_dir(tmp_path, changes)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(8)))
    _, _, plan_err = slide("plan", "--model", str(model))
    argv = ("train", "--model", str(model), "--data", str(data), "--output", str(tmp_path / "run"), "--device", "cpu")
    status, _, err = slide(*argv)
    assert status == 2
    refusal = err.strip().splitlines()[-1]  # after the run's log lines
    assert refusal.removeprefix("slide train: ") == _one_line(plan_err).removeprefix("slide plan: ")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [(), ("--nproc-per-node", "2")])
def test_gpu_updates_on_the_cpu_device_are_refused_as_train_refuses_them(slide, extra):
    """`slide train` refuses them where it places the units (``check_update_placement``); the plan refuses
    them too, also for a data-parallel plan, which places no units."""
    from slide_hf.adapters import build_model
    from slide_hf.errors import UserError
    from slide_hf.planner import PlanInputs
    from slide_hf.planner.plan import check_update_placement
    from slide_hf.presets import PRESETS

    argv = ("plan", "--model", "tiny-llama", "--device", "cpu", "--update-placement", "gpu", *extra)
    status, out, err = slide(*argv)
    assert status == 2 and out == ""
    inputs = PlanInputs(build_model(PRESETS["tiny-llama"]()), accelerator=False)
    with pytest.raises(UserError) as refused:
        check_update_placement(inputs, "gpu")
    assert _one_line(err) == f"slide plan: error: {refused.value}"


@pytest.mark.timeout(120)
def test_train_refuses_gpu_updates_on_the_cpu_device_in_the_words_of_the_plan(slide, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of the data"}) + "\n" for i in range(64)))
    common = ("--model", "tiny-llama", "--device", "cpu", "--update-placement", "gpu", "--seq-len", "16")
    _, _, plan_err = slide("plan", *common)
    output = tmp_path / "run"
    status, _, err = slide("train", *common, "--data", str(data), "--output", str(output), "--steps", "1")
    assert status == 2
    assert err.strip().splitlines()[-1].removeprefix("slide train: ") == _one_line(plan_err).removeprefix(
        "slide plan: "
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra, words",
    [
        (("--keep-checkpoints", "0"), "--save-async writes checkpoints in the background, and --keep-checkpoints 0"),
        (("--nproc-per-node", "2"), "--save-async does not run with data parallel (2 processes)"),
    ],
    ids=["keeping no checkpoint", "data parallel"],
)
def test_a_background_save_the_run_refuses_is_refused_by_the_plan(slide, extra, words):
    """`slide plan --save-async` prices a background save (slide_hf/planner/save_cost.py) only where
    `slide train` would run one: the same option rules refuse the rest in one line."""
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--save-async", *extra)
    assert status == 2 and out == ""
    assert _one_line(err).startswith(f"slide plan: error: {words}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("output", ["", "/no/such/place/at/all"])
def test_an_output_not_made_yet_still_plans_its_saves(slide, output):
    """`slide plan --output` names the disk whose free space and measured write rate price the saves: the
    current directory, or a path that does not exist yet, is priced from its nearest existing ancestor."""
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--output", output, "--save-async")
    assert status == 0, err
    assert "each save" in out and "Traceback" not in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("output", ["/dev/null", "a-file"])
def test_an_output_that_is_a_file_is_refused_as_train_refuses_it(slide, output, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("the user's notes\n")
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--output", output)
    assert status == 2 and out == ""
    assert _one_line(err) == f"slide plan: error: --output {output} is a file, not a directory"
    assert (tmp_path / "a-file").read_text() == "the user's notes\n"


@pytest.mark.timeout(120)
def test_an_output_disk_too_small_for_one_checkpoint_does_not_fit(slide, monkeypatch, tmp_path):
    """`slide train` refuses an output disk that cannot hold one checkpoint and the export before its first
    step; the plan of the same flags says so instead of "fits yes" (and `--check` exits 2)."""
    import shutil

    from slide_hf.planner import output_disk

    full = shutil.disk_usage(tmp_path)._replace(free=1 << 20)
    monkeypatch.setattr(output_disk.shutil, "disk_usage", lambda path: full)
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--output", str(tmp_path / "run"))
    assert status == 0, err
    assert re.search(r"^fits\s+no\s+the disk of .*run has 1\.0 MiB free, but one checkpoint takes", out, re.M), out
    status, out, err = slide(
        "plan", "--model", "tiny-llama", "--device", "cpu", "--output", str(tmp_path / "run"), "--check"
    )
    assert status == 2 and _one_line(err).startswith("slide plan: error: the disk of")


@pytest.mark.timeout(120)
def test_a_billion_micro_batches_plan_at_once(slide):
    """The step schedule's cost once grew with ``--grad-accum`` (1e4 took 36 s); a billion plans as fast as one."""
    status, out, err = slide("plan", "--model", "tiny-llama", "--grad-accum", "1000000000", "--gpu-memory", "4GiB")
    assert status == 0, err
    assert "x accum 1000000000 = " in out
    assert _step_lines(out)["step time"] > 0


# ---- the plan's step lines ---------------------------------------------------------------------------------

_SECONDS = re.compile(r"^(?P<label>\S.*?|  \S.*?)\s{2,}(?P<value>[0-9.e+-]+) s(?:\s|$)")


def _step_lines(out: str) -> dict[str, float]:
    """Every line of the table whose value is seconds, by its label (stripped)."""
    found = {}
    for line in out.splitlines():
        match = _SECONDS.match(line)
        if match:
            found[match["label"].strip()] = float(match["value"])
    return found


def _binding(out: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith("binding limit"))
    return line.removeprefix("binding limit").strip().split("   ")[0].strip()


PLANS = {
    "default": ("--model", "tiny-llama", "--gpu-memory", "4GiB"),
    "no spare GPU memory": ("--model", "tiny-llama", "--gpu-memory", "700MiB"),
    "accumulation": ("--model", "tiny-llama", "--gpu-memory", "700MiB", "--grad-accum", "8"),
    "NVMe Adam state": ("--model", "tiny-llama", "--gpu-memory", "700MiB", "--offload-optimizer", "nvme"),
    "GPU-streamed": ("--model", "tiny-llama", "--gpu-memory", "4GiB", "--update-placement", "gpu"),
    "8B host": ("--model", "llama3.1-8b", "--gpu-memory", "24GiB", "--batch-size", "8", "--host-memory", "1TB"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_step_lines_agree(slide, tmp_path, monkeypatch, name):
    """The step in the engine's order is never below a resource it runs on (nor is the step time, which is
    it), and the binding limit is the largest resource line."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the documented rates, not this machine's
    status, out, err = slide("plan", *PLANS[name])
    assert status == 0, err
    lines = _step_lines(out)
    resources = {r: lines[r] for r in RESOURCES}
    engine = lines["in engine order"]
    assert lines["step time"] == engine
    for resource, seconds in resources.items():
        assert engine >= seconds, f"{resource} {seconds} s above the step in engine order {engine} s\n{out}"
    summary = next(line for line in out.splitlines() if line.startswith("step time"))
    for part, seconds in re.findall(r"(compute|pcie|update|nvme) ([0-9.e+-]+) s", summary):
        assert float(seconds) <= engine, f"{part} {seconds} s above the step {engine} s"
    binding = _binding(out)
    assert binding in resources and resources[binding] == max(resources.values()), out


@pytest.mark.timeout(120)
def test_a_cpu_device_plan_prints_no_gpu_peak(slide):
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu")
    assert status == 0, err
    (peak,) = [line for line in out.splitlines() if line.startswith("GPU peak")]
    assert peak.split()[2] == "none" and "largest phase" not in peak
    assert "on the GPU" not in out and "cuda context" not in out


@pytest.mark.timeout(120)
def test_a_field_of_the_wrong_type_that_transformers_refuses_is_one_line(slide, tmp_path):
    """Fields past the sizes are typed by transformers' strict configs; their refusal (a chained exception
    whose own message names a validator) is the line of its cause."""
    model = _model_dir(tmp_path, {"rms_norm_eps": "tiny"})
    status, _, err = slide("plan", "--model", str(model))
    assert status == 2
    line = _one_line(err)
    assert line.startswith(f"slide plan: error: cannot read {model / 'config.json'}: ") and "rms_norm_eps" in line


# ---- what the plan prints must be true and parseable --------------------------------------------------------


def _strict_json(text: str):
    """``json.loads`` that refuses ``Infinity`` and ``NaN``, as jq and other strict parsers do."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.timeout(120)
def test_a_plan_with_nothing_to_hide_is_valid_json(slide):
    """Every unit of a small model fits the GPU budget: no gradient leaves it, and the overlap is infinite.
    `--json` wrote it as ``Infinity``, which is not JSON; it is null now, and the table says n/a."""
    status, out, err = slide("plan", "--model", "tiny-llama", "--gpu-memory", "24GiB", "--json")
    assert status == 0, err
    assert _strict_json(out)["overlap"] is None
    status, out, err = slide("plan", "--model", "tiny-llama", "--gpu-memory", "24GiB")
    assert status == 0, err
    assert re.search(r"^overlap\s+n/a\s", out, re.M), out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["1e-320", "0.0001"])
def test_a_link_too_slow_to_time_a_step_is_one_line(slide, value):
    status, out, err = slide("plan", "--model", "tiny-llama", "--gpu-memory", "24GiB", "--nproc-per-node", "2",
                             "--intra-gbps", value)  # fmt: skip
    assert status == 2 and out == ""
    assert (
        _one_line(err) == f"slide plan: error: --intra-gbps must be a finite number >= 0.001 (GB/s), got {float(value)}"
    )


@pytest.mark.timeout(120)
def test_the_cpu_device_plans_no_step_time(slide):
    """The planner has no CPU compute rate: a step time on the CPU device would be a GPU's at the default
    rates, some 30x faster than the CPU trains. The table says it is not planned; the JSON's timing is null
    and its memory is still there."""
    status, out, err = slide(
        "plan", "--model", "tiny-llama", "--device", "cpu", "--seq-len", "128", "--batch-size", "4"
    )
    assert status == 0, err
    assert re.search(r"^step time\s+not planned\s", out, re.M), out
    assert not re.search(r"tokens/s\b", out) and "critical batch" not in out and "overlap" not in out
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--seq-len", "128", "--json")
    plan = _strict_json(out)
    assert plan["step_time_s"] is None and plan["tokens_per_s"] is None and plan["resource_s"] is None
    assert plan["host_peak_bytes"] > 0 and plan["fits"] is True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", ["plan", "train"])
def test_packed_rows_for_a_recurrent_model_are_refused_before_the_plan(slide, command, tmp_path):
    """A model with linear-attention layers cannot keep packed documents apart. `slide train` refused that
    at its first forward, after its plan (and `slide plan` said "fits yes"); both refuse it in one line now,
    before any data is read."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"short document {i}"}) + "\n" for i in range(8)))
    argv = [command, "--model", "test-qwen3.5", "--device", "cpu", "--seq-len", "64", "--batch-size", "2"]
    if command == "train":
        argv += ["--steps", "1", "--data", str(data), "--output", str(tmp_path / "run")]
    status, _, err = slide(*argv)
    assert status == 2, err
    assert _one_line(err) == (
        f"slide {command}: error: qwen3_5_text has linear_attention layers, whose recurrent state would flow from "
        "one packed document into the next; train with --no-packing (one example per row)"
    )
    assert not any(line.startswith("plan:") for line in err.splitlines())
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.timeout(120)
def test_the_plan_names_where_its_budgets_came_from(slide):
    """A test model's parameters in millions (it read "0.00 B params"), and the host budget a fit failure
    quotes as the user gave it ("allowed by --host-memory", not "available")."""
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu")
    assert status == 0, err
    assert re.match(r"tiny-llama: \d+\.\d\d M params, ", out), out.splitlines()[0]
    status, out, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--host-memory", "1MiB")
    assert status == 0, err
    assert "host RAM, 1.0 MiB allowed by --host-memory; " in out, out


@pytest.mark.timeout(120)
def test_a_gpu_budget_on_the_cpu_device_is_said_to_be_ignored(slide, caplog):
    with caplog.at_level("WARNING", logger="slide.plan"):
        status, _, err = slide("plan", "--model", "tiny-llama", "--device", "cpu", "--gpu-memory", "24GiB")
    assert status == 0, err
    assert "--gpu-memory is ignored on the CPU device" in caplog.messages


def test_a_broken_link_or_a_loop_named_like_a_hub_dataset_stays_local(tmp_path, monkeypatch):
    """``d/loop1``, a symbolic link loop here, was taken for a Hub dataset and sent to the network."""
    from slide_hf.data.hf_datasets import is_hub_name

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d/loop1").symlink_to("loop2")
    (tmp_path / "d/loop2").symlink_to("loop1")
    (tmp_path / "d/gone").symlink_to("nothing-here")
    assert not is_hub_name("d/loop1") and not is_hub_name("d/gone") and is_hub_name("org/name")
