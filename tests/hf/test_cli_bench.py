"""`slide bench` on the CPU (its smoke path): the JSON it prints, NVMe offload of the Adam state, bad input."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


TINY = ("--model", "test-llama", "--batch-size", "2", "--seq-len", "16", "--steps", "3", "--warmup", "1")


def test_bench_prints_and_writes_one_result(slide, tmp_path) -> None:
    status, out, _ = slide("bench", *TINY, "--json", tmp_path / "r.json")
    assert status == 0
    result = json.loads(out)
    assert result == json.loads((tmp_path / "r.json").read_text())
    engine = result.get("slide", result)
    assert len(engine["losses"]) == 3 and engine["tokens_per_s"] > 0
    assert engine["nvme_state_units"] == [] and engine["planned_disk_bytes"] == 0


def test_bench_trace_draws_the_main_threads_waits_beside_the_updates(slide, tmp_path) -> None:
    """A step longer than its busiest resource stood still somewhere: the trace shows each wait for a unit's
    parameters on its own track, in the same clock as the host updates it waited on, over the last two
    steps, so that the boundary where the second waits for the first one's updates is in it."""
    status, _, err = slide("bench", *TINY, "--trace", tmp_path / "trace")
    assert status == 0, err
    events = json.loads((tmp_path / "trace" / "trace.json").read_text())["traceEvents"]
    tracks = {event["args"]["name"]: event["tid"] for event in events if event["ph"] == "M"}
    assert list(tracks) == ["GPU compute", "h2d", "d2h", "CPU update", "main thread waits"]
    spans = [event for event in events if event["ph"] == "X"]
    waits = [span for span in spans if span["tid"] == tracks["main thread waits"]]
    updates = [span for span in spans if span["tid"] == tracks["CPU update"]]
    assert waits and updates
    assert {span["cat"] for span in waits} == {"wait"} and {span["cat"] for span in updates} == {"update"}
    assert all(span["dur"] >= 0 for span in waits)
    forwards = sorted(
        s["ts"] for s in spans if s["tid"] == tracks["GPU compute"] and s["cat"] == "forward" and s["name"] == "block.0"
    )
    assert len(forwards) == 2  # two steps
    first_wait_of_second_step = max(s["ts"] for s in waits if s["name"] == "embedding" and s["ts"] < forwards[1])
    embedding_updates = [span for span in updates if span["name"] == "embedding"]
    assert any(span["ts"] + span["dur"] <= first_wait_of_second_step for span in embedding_updates)  # the boundary


def test_bench_seq_len_defaults_to_2048_or_the_models_context_length(slide) -> None:
    status, out, err = slide("bench", "--model", "test-gpt2", "--batch-size", "1", "--steps", "2", "--warmup", "1")
    assert status == 0, err
    assert json.loads(out)["seq_len"] == 64  # test-gpt2 has 64 positions, fewer than 2048


def test_bench_offloads_adam_state_to_nvme_with_identical_losses(slide, tmp_path) -> None:
    _, out, _ = slide("bench", *TINY)
    in_ram = json.loads(out)
    status, out, _ = slide(
        "bench", *TINY, "--offload-optimizer", "nvme", "--nvme-dir", tmp_path, "--nvme-fraction", "0.5"
    )
    assert status == 0
    on_nvme = json.loads(out)
    ram, nvme = (r.get("slide", r) for r in (in_ram, on_nvme))
    assert nvme["nvme_state_units"] == [
        "block.0",
        "block.1",
    ]  # half of 4 units (2 blocks, embedding, head): blocks first
    assert nvme["planned_disk_bytes"] > 0
    assert nvme["losses"] == ram["losses"]
    assert list(tmp_path.iterdir()) == []  # the tier's files are removed when the run ends


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--offload-optimizer", "nvme"), "--offload-optimizer nvme needs --nvme-dir"),
        (("--nvme-fraction", "1.5"), "--nvme-fraction must be a finite number in [0, 1], got 1.5"),
        (("--steps", "1"), "--steps (1) must exceed --warmup (1)"),
        (("--layers", "0"), "--layers must be"),
        (("--layers", "3"), "--layers must be a whole number from 1 to 2 (the model's layers), got 3"),
    ],
)
def test_bench_bad_input_is_one_line(slide, argv, message) -> None:
    status, _out, err = slide("bench", *TINY, *argv)
    assert status == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_refuses_a_run_the_host_cannot_hold(slide, monkeypatch) -> None:
    """As `slide train`: the plan is checked against the host's free RAM before anything is allocated."""
    import slide_hf.planner

    monkeypatch.setattr(slide_hf.planner, "available_host_bytes", lambda: 1 << 20)  # 1 MiB free
    status, out, err = slide("bench", *TINY)
    assert status == 2 and out == ""
    assert "host RAM" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_takes_plugins_by_name_with_identical_losses(slide, tmp_path) -> None:
    """The same setup as `slide train`: --device, --optimizer (and its old short names) and any tier."""
    _, out, _ = slide("bench", *TINY, "--device", "cpu", "--optimizer", "torch-adamw")
    base = json.loads(out)["slide"]
    assert base["optimizer"] == "TorchAdamW"
    status, out, err = slide("bench", *TINY, "--optimizer", "torch", "--offload-optimizer", "pinned")
    assert status == 0, err
    pinned = json.loads(out)["slide"]
    assert pinned["optimizer"] == "TorchAdamW" and pinned["nvme_state_units"] == [
        "block.0",
        "block.1",
        "embedding",
        "head",
    ]
    assert pinned["planned_disk_bytes"] == 0  # a tier in memory is planned as host RAM
    assert pinned["losses"] == base["losses"]
    status, out, _ = slide("bench", *TINY, "--optimizer", "fused")
    assert status == 0 and json.loads(out)["slide"]["optimizer"] in ("FusedAdamW", "TorchAdamW")


@pytest.mark.parametrize(
    ("flag", "value"), [("--device", "tpu"), ("--optimizer", "sgd"), ("--offload-optimizer", "tape")]
)
def test_bench_unknown_plugin_name_is_one_line(slide, flag, value) -> None:
    status, _out, err = slide("bench", *TINY, flag, value)
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert f"{flag} must be one of" in err and f"got {value!r}" in err


def test_bench_runs_the_first_layers_of_a_model(slide) -> None:
    status, out, _ = slide("bench", *TINY[2:], "--model", "test-llama4", "--layers", "1")
    assert status == 0
    result = json.loads(out)
    assert result["layers"] == {"run": 1, "of": 2}
    assert [unit for unit in result["slide"]["units"] if unit.startswith("block")] == ["block.0"]


def test_bench_reports_the_linear_attention_path(slide) -> None:
    status, out, err = slide("bench", *TINY[2:], "--model", "test-qwen3.5")
    assert status == 0, err
    result = json.loads(out)
    engine = result.get("slide", result)
    assert engine["linear_attention"] == (
        "torch path (flash-linear-attention's kernels run on CUDA only, not on the cpu device)"
    )
    status, out, _ = slide("bench", *TINY)
    assert json.loads(out).get("slide", json.loads(out))["linear_attention"] is None  # no delta-net layers
