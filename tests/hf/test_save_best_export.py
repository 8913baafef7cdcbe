"""`slide train --save-best`: the run's ``model/`` is the export of its best checkpoint when that one is older
than the last step, byte for byte what `slide export` writes of that checkpoint; `slide export RUN` and the
push of the run's ``model/`` follow the same rule, and a finished run resumed writes the same model again.

The best evaluation comes early for a reason the test controls: the model trains at a high constant lr on
one repeated line and is evaluated on unrelated prose, so after a step or two it learns that line at the
expense of everything else and the eval loss climbs (by tenths of a nat a step, far beyond any rounding).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slide_hf.cli.main import main
from slide_hf.hub import finished_model

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter

PROSE = [
    "The sliding window keeps one layer on the device.",
    "Adam moments live in host memory.",
    "Packing places whole documents side by side in one row of the batch.",
    "Position ids restart at every document.",
    "No token predicts the first token of the next document.",
    "Evaluation runs the same forward without touching optimizer state.",
]
STEPS = 4
RUN = ("--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--seq-len", "96", "--batch-size", "2")
RUN += ("--lr", "3e-3", "--lr-schedule", "constant", "--eval-every", "1", "--save-best", "--keep-checkpoints", "1")


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _safetensors(model_dir: Path) -> dict[str, bytes]:
    files = {f.name: f.read_bytes() for f in sorted(model_dir.glob("*.safetensors"))}
    assert files, f"no safetensors in {model_dir}"
    return files


def _evals(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.fixture(scope="module")
def best_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A finished --save-best run whose best evaluation is before its last step: ``(run, best step)``."""
    root = tmp_path_factory.mktemp("save_best")
    train = _jsonl(root / "train.jsonl", ["zzzz qqqq " * 8] * 16)
    held_out = _jsonl(root / "eval.jsonl", PROSE)
    run = root / "run"
    argv = ["train", *RUN, "--data", str(train), "--eval-data", str(held_out), "--steps", str(STEPS)]
    assert main([*argv, "--output", str(run)]) == 0
    evals = _evals(run)
    best = min(evals, key=evals.__getitem__)
    assert sorted(evals) == list(range(1, STEPS + 1))
    assert best < STEPS and evals[STEPS] > evals[best] + 0.1, f"test setup: the last step must not be the best {evals}"
    assert json.loads((run / "checkpoints/best.json").read_text())["step"] == best
    return run, best


def test_model_is_the_best_checkpoints_export(best_run: tuple[Path, int], tmp_path: Path, capsys) -> None:
    run, best = best_run
    of_best, of_last = tmp_path / "best", tmp_path / "last"
    assert main(["export", str(run / f"checkpoints/step-{best:08d}"), str(of_best)]) == 0
    assert main(["export", str(run / f"checkpoints/step-{STEPS:08d}"), str(of_last)]) == 0
    model = _safetensors(run / "model")
    assert model == _safetensors(of_best)
    assert model.keys() == _safetensors(of_last).keys() and model != _safetensors(of_last)
    assert json.loads((run / "model/slide-export.json").read_text()) == {"step": best}
    log = (run / "train.log").read_text()
    assert f"holds the best checkpoint, step {best} (eval loss" in log
    assert f"the checkpoint of step {STEPS} stays in" in log
    assert (run / f"checkpoints/step-{STEPS:08d}/state.json").is_file()  # the last step's, to resume from


def test_slide_export_of_the_run_writes_the_same_model(best_run: tuple[Path, int], tmp_path: Path, capsys) -> None:
    run, best = best_run
    out = tmp_path / "again"
    assert main(["export", str(run), str(out)]) == 0
    said = capsys.readouterr().out
    assert f"exported step {best} of {run / f'checkpoints/step-{best:08d}'}, the run's best (eval loss" in said
    assert _safetensors(out) == _safetensors(run / "model")
    # The push of the run's model/ takes it as the export of the run's model checkpoint, not a stale one.
    assert finished_model(run, "me/model") == (run / "model", best)


def test_a_resumed_finished_run_writes_the_best_again_and_keeps_user_files(
    best_run: tuple[Path, int], tmp_path: Path
) -> None:
    run, best = best_run
    before = _safetensors(run / "model")
    note = run / "model" / "NOTES.md"
    note.write_text("mine")
    assert main(["train", "--resume", str(run)]) == 0
    assert _safetensors(run / "model") == before
    assert note.read_text() == "mine"
    assert json.loads((run / "model/slide-export.json").read_text()) == {"step": best}


def test_resumed_without_save_best_the_newest_is_the_model(best_run: tuple[Path, int], tmp_path: Path) -> None:
    """What the newest checkpoint's options say decides: a run resumed with ``save_best=False`` exports its
    newest checkpoint, whatever an older best.json names, and so does `slide export RUN`."""
    import slide_hf

    source, _ = best_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    slide_hf.train(resume=run, steps=STEPS + 1, save_best=False)
    newest = tmp_path / "newest"
    assert main(["export", str(run / f"checkpoints/step-{STEPS + 1:08d}"), str(newest)]) == 0
    assert _safetensors(run / "model") == _safetensors(newest)
    assert json.loads((run / "model/slide-export.json").read_text()) == {"step": STEPS + 1}
    again = tmp_path / "again"
    assert main(["export", str(run), str(again)]) == 0
    assert _safetensors(again) == _safetensors(newest)
