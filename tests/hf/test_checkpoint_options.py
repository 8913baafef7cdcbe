"""`slide train`'s checkpoint options: retention with --save-best and abandoned lines, weights-only saves,
--save-delete-first, --save-async (bytes and resume exact, failures raised), and the output disk they take."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slide_hf import recipe
from slide_hf.errors import UserError
from slide_hf.planner.output_disk import checkpoints_at_once, output_disk, run_output_disk, weights_saves
from slide_hf.recipe import TrainConfig, train

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def _config(output: Path, **overrides: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        output=output,
        device="cpu",
        dtype="float32",
        steps=4,
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        lr=3e-3,
        weight_decay=0.01,
        lr_schedule="cosine",
        warmup_steps=1,
        seed=3,
        metrics=output / "metrics.jsonl",
    )
    base.update(overrides)
    return TrainConfig(**base)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _checkpoints_before_each_save(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The step folders on disk as each checkpoint save begins, one list per save, filled as the run goes."""
    seen: list[list[str]] = []
    save = recipe.save_checkpoint

    def spy(root: Path, step: int, *args: Any, **kwargs: Any) -> Path:
        seen.append(sorted(p.name for p in root.glob("step-*")) if root.is_dir() else [])
        return save(root, step, *args, **kwargs)

    monkeypatch.setattr(recipe, "save_checkpoint", spy)
    return seen


# -- retention ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("save_async", [False, True])
def test_keep_one_with_save_best_keeps_the_newest_and_an_older_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save_async: bool
) -> None:
    """Scripted evaluation losses make step 2 the best: --keep-checkpoints 1 keeps step 5, and the best in
    addition; once a later step is the best, one checkpoint stays, not two."""
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 2.7}

    def evaluate(self: Any, step: int, **_: Any) -> dict[str, Any]:
        return {"step": step, "eval_loss": losses[step], "perplexity": 1.0, "eval_loss_tokens": 1, "eval_time_s": 0.0}

    monkeypatch.setattr(recipe._Evaluator, "run", evaluate)
    run = tmp_path / "run"
    common = dict(eval_fraction=0.2, eval_every=1, save_best=True, save_every=1, keep_checkpoints=1)
    train(_config(run, steps=5, save_async=save_async, **common))
    assert _listing(run / "checkpoints") == ["best.json", "step-00000002", "step-00000005"]
    assert json.loads((run / "checkpoints/best.json").read_text())["path"] == "checkpoints/step-00000002"
    losses.update({6: 0.5, 7: 0.9})
    train(_config(run, steps=7, resume=run, save_async=save_async, **common))
    assert _listing(run / "checkpoints") == ["best.json", "step-00000006", "step-00000007"]


def test_keep_one_when_the_best_is_the_newest_leaves_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def evaluate(self: Any, step: int, **_: Any) -> dict[str, Any]:  # every step improves: the best is the newest
        return {"step": step, "eval_loss": 10.0 - step, "perplexity": 1.0, "eval_loss_tokens": 1, "eval_time_s": 0.0}

    monkeypatch.setattr(recipe._Evaluator, "run", evaluate)
    run = tmp_path / "run"
    train(_config(run, steps=3, eval_fraction=0.2, eval_every=1, save_best=True, save_every=1, keep_checkpoints=1))
    assert _listing(run / "checkpoints") == ["best.json", "step-00000003"]


def test_weights_saves_and_an_abandoned_line_pruned_by_the_same_rule(tmp_path: Path) -> None:
    """Weights-only saves are the export of their step; a resume from an older checkpoint sets the later
    checkpoints and weights aside, and the new line's saves prune them."""
    from slide_hf.cli.main import main

    run = tmp_path / "run"
    train(_config(run, steps=4, save_every=1, keep_checkpoints=3, save_weights_every=1))
    assert _listing(run / "checkpoints") == ["step-00000002", "step-00000003", "step-00000004"]
    # No weights save at the last step: its weights are model/.
    assert _listing(run / "weights") == ["step-00000001", "step-00000002", "step-00000003"]
    saved = run / "weights/step-00000002"
    assert not list(saved.glob("*.bin")) and (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()
    exported = tmp_path / "export2"
    assert main(["export", str(run / "checkpoints/step-00000002"), str(exported)]) == 0
    assert _listing(saved) == _listing(exported)
    want, got = _weights(exported), _weights(saved)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    checkpoint_bytes = sum(p.stat().st_size for p in (run / "checkpoints/step-00000002").iterdir())
    assert sum(p.stat().st_size for p in saved.iterdir()) < checkpoint_bytes / 2  # no optimizer state
    step3 = _weights(run / "weights/step-00000003")

    # Resume from step 2 with --keep-checkpoints 2: steps 3 and 4 are abandoned, then pruned by the new line.
    train(
        _config(
            run,
            steps=4,
            save_every=1,
            keep_checkpoints=2,
            save_weights_every=1,
            resume=run / "checkpoints/step-00000002",
        )
    )
    # No abandoned checkpoint is left; the folder keeps what was set aside with them, never pruned.
    (aside,) = (run / "checkpoints").glob("abandoned-*")
    assert _listing(run / "checkpoints") == [aside.name, "step-00000003", "step-00000004"]
    assert _listing(aside) == ["model", "weights"] and (aside / "model/config.json").is_file()
    assert _listing(run / "weights") == ["step-00000001", "step-00000002", "step-00000003"]
    again = _weights(run / "weights/step-00000003")  # the new line's own (bit-exact: the same step again)
    assert all(torch.equal(step3[k], again[k]) for k in step3)


def _scripted(monkeypatch: pytest.MonkeyPatch, losses: dict[int, float]) -> None:
    def evaluate(self: Any, step: int, **_: Any) -> dict[str, Any]:
        return {"step": step, "eval_loss": losses[step], "perplexity": 1.0, "eval_loss_tokens": 1, "eval_time_s": 0.0}

    monkeypatch.setattr(recipe._Evaluator, "run", evaluate)


def test_the_older_best_stays_until_the_new_best_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--save-delete-first makes room before the save of a new best: the older best is still the best
    then (the new one is not on disk), so it stays until the new one is published."""
    _scripted(monkeypatch, {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5, 5: 0.7})
    seen = _checkpoints_before_each_save(monkeypatch)
    run = tmp_path / "run"
    common = dict(eval_fraction=0.2, eval_every=1, save_best=True, save_every=1, keep_checkpoints=1)
    train(_config(run, steps=5, save_delete_first=True, **common))
    # What the disk held as each save began: the best so far is among it, also as a better one is written.
    assert seen == [[], ["step-00000001"], ["step-00000002"], ["step-00000002"], ["step-00000004"]]
    assert _listing(run / "checkpoints") == ["best.json", "step-00000004", "step-00000005"]


def test_a_background_best_is_named_and_protected_once_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--save-async: best.json never names a checkpoint still being written, and collecting the save
    before a new best's never prunes the older best the new one is to replace."""
    from slide_core.checkpoint import background

    _scripted(monkeypatch, {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5, 5: 0.7})
    run = tmp_path / "run"
    named: list[bool] = []
    write_best = recipe._write_best

    def best_spy(checkpoints: Path, best: dict[str, Any]) -> None:
        named.append((run / best["path"] / "state.json").is_file())
        write_best(checkpoints, best)

    seen: dict[int, list[str]] = {}
    save = background.save_checkpoint

    def save_spy(root: Path, step: int, *args: Any, **kwargs: Any) -> Path:
        seen[step] = sorted(p.name for p in root.glob("step-*"))
        return save(root, step, *args, **kwargs)

    monkeypatch.setattr(recipe, "_write_best", best_spy)
    monkeypatch.setattr(background, "save_checkpoint", save_spy)
    common = dict(eval_fraction=0.2, eval_every=1, save_best=True, save_every=1, keep_checkpoints=1)
    train(_config(run, steps=5, save_async=True, **common))
    assert named and all(named)
    assert seen[4] == ["step-00000002", "step-00000003"]  # the best of step 2 stays while step 4 is written
    assert _listing(run / "checkpoints") == ["best.json", "step-00000004", "step-00000005"]
    assert json.loads((run / "checkpoints/best.json").read_text())["path"] == "checkpoints/step-00000004"


@pytest.mark.parametrize("save_async", [False, True])
def test_the_record_follows_the_pruning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save_async: bool) -> None:
    """The record of the run's files is taken after a save's pruning, so it never lists a pruned checkpoint."""
    from slide_hf.run_dir import RunDir

    run = tmp_path / "run"
    recorded: list[list[str]] = []
    record = RunDir.record_outputs

    def spy(self: RunDir) -> None:
        recorded.append(sorted(p.name for p in (run / "checkpoints").glob("step-*")))
        record(self)

    monkeypatch.setattr(RunDir, "record_outputs", spy)
    train(_config(run, steps=3, save_every=1, keep_checkpoints=1, save_async=save_async))
    assert recorded and all(len(names) <= 1 for names in recorded), recorded


def test_a_stop_skips_the_weights_only_save(tmp_path: Path) -> None:
    """A stop writes the step's checkpoint and ends: the weights-only save of that step is not written."""
    import os
    import signal

    from slide_hf.errors import RunStopped

    def stop_after_second(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    run = tmp_path / "run"
    with pytest.raises(RunStopped):
        train(_config(run, steps=4, save_weights_every=1), on_step=stop_after_second)
    assert _listing(run / "checkpoints") == ["step-00000002"]
    assert _listing(run / "weights") == ["step-00000001"]


def test_weights_staging_is_a_killed_runs_leftover(tmp_path: Path) -> None:
    """A weights-only save stages in weights/.step-N.tmp-* (and sets the save it replaces aside as
    .old-*): a killed run's are removed like its other temporary folders, and a failed run that created
    its directory removes its weights/ with the rest."""
    from slide_hf.run_dir import RunDir, clean_if_idle

    run = tmp_path / "run"
    stale = [run / "weights/.step-00000002.tmp-0123456789ab", run / "weights/.step-00000001.old-0123456789ab"]
    kept = run / "weights/step-00000001"
    for path in (*stale, kept):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    clean_if_idle(run)
    assert not any(p.exists() for p in stale) and (kept / "config.json").is_file()

    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="the step failed"), RunDir(fresh):
        (fresh / "weights/step-00000001").mkdir(parents=True)
        raise RuntimeError("the step failed")
    assert not fresh.exists()


# -- delete first ---------------------------------------------------------------------------------------------
def test_save_delete_first_deletes_before_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    seen = _checkpoints_before_each_save(monkeypatch)
    train(_config(run, steps=4, save_every=1, keep_checkpoints=2, save_delete_first=True))
    # What the disk held as each save began: never more than --keep-checkpoints - 1.
    assert seen == [[], ["step-00000001"], ["step-00000002"], ["step-00000003"]]
    assert _listing(run / "checkpoints") == ["step-00000003", "step-00000004"]


# -- background saves -----------------------------------------------------------------------------------------
def _manifest(checkpoint: Path) -> dict[str, Any]:
    """state.json without what may differ between two runs of the same steps: the options (which name
    --save-async) and the checksum over them."""
    state = json.loads((checkpoint / "state.json").read_text())
    state.pop("checksum")
    state["extra"]["config"].pop("save_async")
    state["extra"]["config"].pop("output")
    state["extra"]["config"].pop("metrics")
    return state


def test_background_checkpoints_equal_foreground_ones_and_resume_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted: list[int] = []
    submit = recipe.BackgroundSaver.submit

    def spy(self: Any, root: Path, step: int, *args: Any, **kwargs: Any) -> None:
        submitted.append(step)
        submit(self, root, step, *args, **kwargs)

    monkeypatch.setattr(recipe.BackgroundSaver, "submit", spy)
    full = train(_config(tmp_path / "full", steps=6, save_every=2, keep_checkpoints=3))
    train(_config(tmp_path / "async", steps=6, save_every=2, keep_checkpoints=3, save_async=True))
    assert submitted == [2, 4, 6]  # the last one is waited for before the export
    for step in ("step-00000002", "step-00000004", "step-00000006"):
        fg, bg = tmp_path / "full/checkpoints" / step, tmp_path / "async/checkpoints" / step
        assert _listing(fg) == _listing(bg) == ["shard-00000-of-00001.bin", "state.json"]
        assert (fg / "shard-00000-of-00001.bin").read_bytes() == (bg / "shard-00000-of-00001.bin").read_bytes()
        assert _manifest(fg) == _manifest(bg)
    # Resume from the background checkpoint of step 2: bit-identical to the uninterrupted run.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "async/checkpoints/step-00000002", resumed_dir / "checkpoints/step-00000002")
    resumed = train(_config(resumed_dir, steps=6, resume=resumed_dir))
    assert _losses(resumed_dir / "metrics.jsonl") == _losses(tmp_path / "full/metrics.jsonl")[2:]
    want, got = _weights(full.model_dir), _weights(resumed.model_dir)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.timeout(300)
def test_a_background_write_failure_stops_the_run_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slide_core.checkpoint import writer

    write = writer._write

    def full_at_step_2(handle: Any, data: memoryview) -> None:
        if ".tmp-step-00000002" in handle.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(handle, data)

    monkeypatch.setattr(writer, "_write", full_at_step_2)
    run = tmp_path / "run"
    steps: list[int] = []
    with pytest.raises(UserError) as raised:
        train(_config(run, steps=6, save_every=1, save_async=True), on_step=lambda r: steps.append(r["step"]))
    message = str(raised.value)
    assert "\n" not in message and "cannot write checkpoint" in message and "step-00000002" in message
    assert "free at" in message and "the previous checkpoint" in message and "step-00000001 is kept" in message
    assert steps[-1] < 6  # raised while training, not at the end
    assert _listing(run / "checkpoints") == ["step-00000001"]  # nothing half-written that looks complete


# -- options and the output disk ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["save_weights_every", "save_async"])
def test_one_process_saving_options_are_refused_with_data_parallel(name: str, tmp_path: Path) -> None:
    cfg = _config(tmp_path, **{name: 2 if name == "save_weights_every" else True})
    cfg.validate(1)
    with pytest.raises(UserError, match=rf"--{name.replace('_', '-')} does not run with data parallel \(2 processes\)"):
        cfg.validate(2)


def test_output_disk_prices_every_checkpoint_option() -> None:
    numels, params = [1000, 2000], 2900
    base = dict(params=params, export_itemsize=2, keep_checkpoints=2, save_best=False)
    plain = output_disk(numels, [], **base)
    assert plain.checkpoint_bytes == 4 * 3000 and plain.checkpoints_kept == 2 and plain.checkpoints_at_once == 3
    assert plain.total_bytes == 3 * 12000 + 2 * params
    best = output_disk(numels, [], **{**base, "save_best": True})
    assert (best.checkpoints_kept, best.checkpoints_at_once) == (3, 4)
    first = output_disk(numels, [], **{**base, "save_best": True}, delete_first=True)
    assert (first.checkpoints_kept, first.checkpoints_at_once) == (3, 3)
    weights = output_disk(numels, [], **base, save_weights_every=10, total_steps=100)
    assert weights.weights_saves == 9 and weights.weights_bytes == 9 * 2 * params  # none at step 100: model/
    assert weights.total_bytes == plain.total_bytes + 9 * 2 * params
    assert weights.to_dict()["weights_bytes"] == weights.weights_bytes
    assert checkpoints_at_once(1, False, delete_first=True) == 1
    assert weights_saves(None, 10) == 0 and weights_saves(101, 10) == 10 and weights_saves(100, 0) == 0
    # From the options, as slide train and slide plan call it.
    cfg = TrainConfig(
        keep_checkpoints=2, save_best=True, eval_fraction=0.1, save_delete_first=True, save_weights_every=10, steps=100
    )
    planned = run_output_disk(cfg, numels, [], params=params, export_itemsize=2)
    assert planned == output_disk(
        numels, [], **{**base, "save_best": True}, delete_first=True, save_weights_every=10, total_steps=100
    )
    assert (planned.checkpoints_kept, planned.checkpoints_at_once, planned.weights_saves) == (3, 3, 9)
