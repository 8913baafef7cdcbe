"""Hostile run directories for `slide train --resume`, `--overwrite` and `slide export`: one line, no file lost.

Each case breaks the user's folder (a finished run of a model directory, with two checkpoints, beside
the user's data), runs one command in-process and requires exactly one line on stderr (no traceback), a
non-zero exit, and every file the user had unchanged: the folder is hashed before and after, as in
tests/hf/test_red_team.py. The cases: a newest checkpoint without its ``state.json`` (refused like
every other damage, not skipped and later replaced), a ``state.json`` nested too deeply for the JSON
parser, and ``--overwrite`` asked to remove an input of the run or a directory whose record of slide's
files is missing, damaged or hostile.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from slide_hf.cli.main import main
from slide_hf.run_files import RECORD_FILE

MAY_CHANGE = frozenset({"train.log", "options.json", ".slide.lock"})
"""A run's own log, its options as last started, and its lock: rewritten by a resume refused late."""

TINY = ("--device", "cpu", "--dtype", "float32", "--seq-len", "16", "--batch-size", "2")
NEWEST = "run/checkpoints/step-00000002"
OLDER = "run/checkpoints/step-00000001"


@dataclass(frozen=True)
class World:
    """``tmp/user`` holds a model directory, a data file and a finished run (``run``) of two checkpoints."""

    tmp: Path

    @property
    def user(self) -> Path:
        return self.tmp / "user"

    def paths(self) -> dict[str, str]:
        user = self.user
        return {"tmp": str(self.tmp), "user": str(user), "model": str(user / "model"), "run": str(user / "run")}


@dataclass(frozen=True)
class Case:
    """``argv`` with ``{tmp}``, ``{user}``, ``{model}``, ``{run}`` placeholders; ``setup`` breaks the folder
    before it is hashed; ``match`` must appear in the one stderr line."""

    name: str
    argv: tuple[str, ...]
    match: str
    setup: Callable[[World], None] | None = None
    code: int = 2


@pytest.fixture(scope="module")
def originals(tmp_path_factory, torch_kernels_module) -> tuple[Path, Path]:
    """A `test-llama` directory over the byte tokenizer, and a 2-step run trained from it."""
    import torch
    from transformers import AutoModelForCausalLM

    from slide_hf import PRESETS
    from slide_hf.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

    root = tmp_path_factory.mktemp("resume-hostile")
    model = root / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(PRESETS["test-llama"](vocab_size=BYTE_VOCAB_SIZE)).save_pretrained(model)
    byte_tokenizer().save_pretrained(str(model))
    run = root / "run"
    assert main(["train", "--output", str(run), "--model", str(model), *TINY, "--steps", "2", "--save-every", "1"]) == 0
    return model, run


@pytest.fixture
def world(tmp_path: Path, originals: tuple[Path, Path], torch_kernels: None) -> World:
    world = World(tmp_path)
    world.user.mkdir()
    shutil.copytree(originals[0], world.user / "model")
    shutil.copytree(originals[1], world.user / "run")
    lines = "".join(json.dumps({"text": f"line {i} of the user's data"}) + "\n" for i in range(64))
    (world.user / "data.jsonl").write_text(lines)
    return world


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (folders too) and each file's hash."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.name in MAY_CHANGE:
            continue
        key = str(path.relative_to(root))
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found


# ---- how the cases break things -------------------------------------------------------------------------


def _remove(relative: str) -> Callable[[World], None]:
    def setup(world: World) -> None:
        target = world.user / relative
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    return setup


def _write(relative: str, content: str) -> Callable[[World], None]:
    def setup(world: World) -> None:
        (world.user / relative).write_text(content)

    return setup


def _link(relative: str, to: str) -> Callable[[World], None]:
    def setup(world: World) -> None:
        (world.user / relative).symlink_to(world.user / to)

    return setup


def _then(*setups: Callable[[World], None]) -> Callable[[World], None]:
    def setup(world: World) -> None:
        for step in setups:
            step(world)

    return setup


DEEP = "[" * 100_000 + "]" * 100_000
RESUME = ("train", "--resume", "{run}")
EXPORT = ("export", "{run}", "{tmp}/out")
OVERWRITE = ("train", "--output", "{run}", *TINY, "--steps", "1", "--overwrite")

CASES = [
    # ---- a newest checkpoint without its state.json ----
    Case(
        "resume: newest checkpoint without state.json",
        RESUME,
        "checkpoint {run}/checkpoints/step-00000002 is corrupt (state.json is missing); the newest intact one is "
        "{run}/checkpoints/step-00000001: resume from it with --resume {run}/checkpoints/step-00000001",
        setup=_remove(f"{NEWEST}/state.json"),
    ),
    Case(
        "export: newest checkpoint without state.json",
        EXPORT,
        "step-00000002 is corrupt (state.json is missing); the newest intact one is {run}/checkpoints/step-00000001: "
        "export it with `slide export {run}/checkpoints/step-00000001",
        setup=_remove(f"{NEWEST}/state.json"),
    ),
    Case(
        "resume: no checkpoint has its state.json",
        RESUME,
        "step-00000002 is corrupt (state.json is missing); no older intact checkpoint of this run exists",
        setup=_then(_remove(f"{NEWEST}/state.json"), _remove(f"{OLDER}/state.json")),
    ),
    # ---- a state.json nested deeper than the JSON parser goes ----
    Case(
        "resume: state.json of 100000 nested brackets",
        RESUME,
        "state.json is not valid JSON: it nests arrays or objects too deeply",
        setup=_write(f"{NEWEST}/state.json", DEEP),
    ),
    Case(
        "export: state.json of 100000 nested brackets",
        EXPORT,
        "state.json is not valid JSON: it nests arrays or objects too deeply",
        setup=_write(f"{NEWEST}/state.json", DEEP),
    ),
    Case(
        "resume a checkpoint: state.json of 100000 nested brackets",
        ("train", "--resume", "{run}/checkpoints/step-00000001"),
        "step-00000001 is corrupt (state.json is not valid JSON: it nests",
        setup=_write(f"{OLDER}/state.json", DEEP),
    ),
    # ---- --overwrite and the run's inputs ----
    Case(
        "overwrite: --model is the run's own model",
        (*OVERWRITE, "--model", "{run}/model"),
        "--model {run}/model is in {run}, whose files from an earlier run --overwrite would remove",
    ),
    Case(
        "overwrite: --model is a link to the run's model",
        (*OVERWRITE, "--model", "{user}/linked-model"),
        "--model {user}/linked-model is in {run}",
        setup=_link("linked-model", "run/model"),
    ),
    Case(
        "overwrite: --tokenizer is the run's tokenizer",
        (*OVERWRITE, "--model", "{model}", "--tokenizer", "{run}/tokenizer"),
        "--tokenizer {run}/tokenizer is in {run}",
    ),
    Case(
        "overwrite: --data is a link to a file of the run",
        (*OVERWRITE, "--data", "{user}/rows.jsonl"),
        "--data {user}/rows.jsonl is in {run}",
        setup=_link("rows.jsonl", "run/metrics.jsonl"),
    ),
    Case(
        "overwrite: --eval-data is a file of the run",
        (*OVERWRITE, "--data", "{user}/data.jsonl", "--eval-data", "{run}/metrics.jsonl"),
        "--eval-data {run}/metrics.jsonl is in {run}",
    ),
    Case(
        "overwrite: --chat-template is a file of the run",
        (*OVERWRITE, "--data", "{user}/data.jsonl", "--chat-template", "{run}/tokenizer/chat_template.jinja"),
        "--chat-template {run}/tokenizer/chat_template.jinja is in {run}",
    ),
    # ---- --overwrite and the record of slide's files ----
    Case(
        "overwrite: a run without a record of its files",
        OVERWRITE,
        "--overwrite: {run} holds a run of a slide that kept no record of the files it wrote",
        setup=_remove(f"run/{RECORD_FILE}"),
    ),
    Case(
        "overwrite: record not JSON",
        OVERWRITE,
        f"{{run}}/{RECORD_FILE}, slide's record of the files it wrote in {{run}}, is damaged",
        setup=_write(f"run/{RECORD_FILE}", "[[[" + DEEP),
    ),
    Case(
        "overwrite: record names a file outside the run",
        OVERWRITE,
        "is damaged",
        setup=_write(f"run/{RECORD_FILE}", json.dumps({"format": 1, "files": ["../data.jsonl"]})),
    ),
    Case(
        "overwrite: record names an absolute path",
        OVERWRITE,
        "is damaged",
        setup=lambda world: _write(
            f"run/{RECORD_FILE}", json.dumps({"format": 1, "files": [str(world.user / "data.jsonl")]})
        )(world),
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_run_directory_is_one_line_and_loses_nothing(case: Case, world: World, capsys) -> None:
    if case.setup is not None:
        case.setup(world)
    before = _snapshot(world.tmp)
    argv = [part.format(**world.paths()) for part in case.argv]
    capsys.readouterr()
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == case.code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert case.match.format(**world.paths()) in lines[0], lines[0]
    assert _snapshot(world.tmp) == before, "a file of the user's changed, or something was left behind"


def test_resuming_the_intact_checkpoint_sets_the_damaged_one_aside(world: World, capsys, caplog) -> None:
    """What the refusal says to do works: the damaged step folder moves aside with the abandoned line (a
    warning names it), so the new line's save of that step does not silently replace it and the next
    --resume follows the new line."""
    run = world.user / "run"
    (run / "checkpoints" / "step-00000002" / "state.json").unlink()
    caplog.set_level("WARNING", logger="slide.train")
    assert main(["train", "--resume", str(run / "checkpoints" / "step-00000001")]) == 0
    moved = [r.getMessage() for r in caplog.records if "belong to an abandoned line" in r.getMessage()]
    assert len(moved) == 1 and "(step-00000002)" in moved[0], moved
    assert (run / "checkpoints" / "step-00000002" / "state.json").is_file()  # the new line's step 2
    assert main(["train", "--resume", str(run)]) == 0  # nothing left to train: no refusal
    assert "nothing left to train" in capsys.readouterr().out


# ---- a resume onto data shorter than the saved position ----------------------------------------------------


@pytest.fixture
def shortened(tmp_path: Path, torch_kernels: None) -> tuple[Path, Path]:
    """A 2-step run over 64 lines (its checkpoint at row 4 of epoch 0), whose data file then shrinks to
    three rows: the saved position lies past the end of the new data."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of the user's data"}) + "\n" for i in range(64)))
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--output", str(run), *TINY, "--steps", "2"]) == 0
    data.write_text(json.dumps({"text": "a shorter file of the user, in three rows"}) + "\n")
    return run, data


def test_allow_data_change_onto_shorter_data_starts_its_next_epoch(shortened, caplog) -> None:
    run, _ = shortened
    caplog.set_level("WARNING", logger="slide.train")
    assert main(["train", "--resume", str(run), "--steps", "4", "--allow-data-change"]) == 0
    lines = [r.getMessage() for r in caplog.records if "training continues at the start of epoch" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "--allow-data-change: the data now has 3 rows and" in lines[0]
    assert "stopped at row 4 of epoch 0; training continues at the start of epoch 1" in lines[0]
    state = json.loads((run / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["extra"]["data"]["epoch"] >= 1  # it trained on the new data's epochs


def test_shorter_data_under_a_checkpoint_without_a_digest_is_named(shortened, capsys) -> None:
    """A checkpoint that predates the data digest cannot tell a changed file from a damaged position: the
    line gives both sizes and the option, and calls nothing corrupt."""
    from slide_core.checkpoint.manifest import checksum

    run, _ = shortened
    file = run / "checkpoints" / "step-00000002" / "state.json"
    state = json.loads(file.read_text())
    del state["extra"]["data_digest"]
    state["checksum"] = checksum(state)
    file.write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "stopped at row 4 of epoch 0, but the data now has 3 rows" in lines[0], lines[0]
    assert "--allow-data-change" in lines[0] and "corrupt" not in lines[0]
