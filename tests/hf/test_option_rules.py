"""Options that need a companion, misspelt option names, mixture weights of any magnitude, and the exit
status of a run stopped by a second signal (slide_hf/options/companions.py, slide_hf/options/suggest.py,
slide_hf/data/mixture.py, slide_hf/recipe.py's stop requests).

The hostile-input table (:data:`CASES`) follows tests/hf/test_red_team.py: each case, through the
`slide` CLI in-process, on the command line or in a ``--config`` TOML file, must end with exactly one
stderr line naming the bad option, exit status 2, no traceback, and no file of the user's folder changed
or added.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import slide_hf
from slide_hf.cli.main import build_parser, main
from slide_hf.data.mixture import mixture_counts, mixture_order, weight_shares
from slide_hf.errors import UnknownOption, UserError
from slide_hf.options import TrainConfig, config_dict, resume_config
from slide_hf.options.companions import check_given

# ---- the hostile-input table ------------------------------------------------------------------------------

RUN = ("train", "--output", "{tmp}/out", "--model", "tiny-llama", "--device", "cpu", "--steps", "2")


@dataclass(frozen=True)
class Case:
    """``argv`` after :data:`RUN` (``{tmp}`` and ``{user}`` placeholders); ``toml``: a ``--config`` file's
    text; ``match``: what the one stderr line must hold."""

    name: str
    argv: tuple[str, ...]
    match: str
    toml: str | None = None


WSD_ONLY = "shapes the decay of --lr-schedule wsd only"
EVAL_DATA = "needs evaluation data: give --eval-data FILE or --eval-fraction F"
BAD_WEIGHTS = "--data-weights must be positive finite numbers"
TWO_SOURCES = ("--data", "{user}/a.jsonl", "--data", "{user}/b.jsonl")

CASES: list[Case] = [
    # Options that act only beside another, on the command line...
    Case("decay fraction without wsd", ("--decay-fraction", "0.2"), f"--decay-fraction 0.2 {WSD_ONLY}"),
    Case(
        "decay fraction at its default with cosine",
        ("--decay-fraction", "0.1", "--lr-schedule", "cosine"),
        f"--decay-fraction 0.1 {WSD_ONLY}, and the schedule is cosine",
    ),
    Case("decay shape without wsd", ("--decay-shape", "cosine"), f"--decay-shape cosine {WSD_ONLY}"),
    Case(
        "decay shape at its default with constant",
        ("--decay-shape", "linear", "--lr-schedule", "constant"),
        f"--decay-shape linear {WSD_ONLY}",
    ),
    Case(
        "allow data change without resume",
        ("--allow-data-change",),
        "--allow-data-change applies only with --resume RUN",
    ),
    Case("eval every without eval data", ("--eval-every", "5"), f"--eval-every 5 {EVAL_DATA}"),
    Case(
        "data weights for one source",
        ("--data", "{user}/a.jsonl", "--data-weights", "2"),
        "--data-weights 2 weighs two or more --data sources against each other; this run has one",
    ),
    # ...and in the TOML file.
    Case("toml decay fraction without wsd", (), f"--decay-fraction 0.2 {WSD_ONLY}", toml="decay_fraction = 0.2\n"),
    Case(
        "toml decay shape at its default with cosine",
        (),
        f"--decay-shape linear {WSD_ONLY}, and the schedule is cosine",
        toml='decay_shape = "linear"\nlr_schedule = "cosine"\n',
    ),
    Case(
        "toml decay shape with cosine from the command line",
        ("--lr-schedule", "cosine"),
        f"--decay-shape cosine {WSD_ONLY}",
        toml='decay_shape = "cosine"\n',
    ),
    Case(
        "toml allow data change without resume",
        (),
        "--allow-data-change applies only with --resume RUN",
        toml="allow_data_change = true\n",
    ),
    Case("toml eval every without eval data", (), f"--eval-every 5 {EVAL_DATA}", toml="eval_every = 5\n"),
    Case(
        "toml data weights for one source",
        (),
        "--data-weights 3 weighs two or more --data sources",
        toml='data = ["{user}/a.jsonl"]\ndata_weights = [3]\n',
    ),
    # Unknown TOML keys name the key meant.
    Case(
        "toml no_packing",
        (),
        "unknown option 'no_packing'; did you mean `packing = false`?",
        toml="no_packing = true\n",
    ),
    Case(
        "toml no-packing",
        (),
        "unknown option 'no-packing'; did you mean `packing = false`?",
        toml="no-packing = true\n",
    ),
    Case(
        "toml no_packing = false",
        (),
        "unknown option 'no_packing'; did you mean `packing = true`?",
        toml="no_packing = false\n",
    ),
    Case("toml shuffle", (), "did you mean `no_shuffle = true`?", toml="shuffle = false\n"),
    Case("toml learning_rate", (), "unknown option 'learning_rate'; did you mean 'lr'?", toml="learning_rate = 1e-4\n"),
    Case("toml max_steps", (), "unknown option 'max_steps'; did you mean 'steps'?", toml="max_steps = 10\n"),
    Case("toml dashes", (), "unknown option 'grad-accum'; did you mean 'grad_accum'?", toml="grad-accum = 2\n"),
    Case("toml near miss", (), "unknown option 'warmup_step'; did you mean 'warmup_steps'?", toml="warmup_step = 3\n"),
    Case(
        "toml launch option",
        (),
        "unknown option 'nproc_per_node'; --nproc-per-node is a flag of `slide train` alone",
        toml="nproc_per_node = 2\n",
    ),
    Case("toml nonsense key", (), "unknown option 'zzz'; the TOML keys are", toml="zzz = 1\n"),
    # Mixture weights: only the truly bad are refused (any positive finite magnitude is a mixture).
    *(
        Case(f"data weights {weights}", (*TWO_SOURCES, f"--data-weights={weights}"), BAD_WEIGHTS)
        for weights in ("nan,1", "inf,1", "1e400,1", "-1,1", "0,0", "1,-inf")
    ),
    Case(
        "toml data weights nan",
        (),
        BAD_WEIGHTS,
        toml='data = ["{user}/a.jsonl", "{user}/b.jsonl"]\ndata_weights = [nan, 1]\n',
    ),
]


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (directories too) and each file's hash."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(root.rglob("*"))
    }


def _write_data(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("a", "b"):
        lines = (json.dumps({"text": f"{name}: line {i} of the user's data"}) + "\n" for i in range(16))
        (folder / f"{name}.jsonl").write_text("".join(lines))


def test_the_table_is_unique() -> None:
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_option_is_one_line_and_touches_nothing(case: Case, tmp_path: Path, torch_kernels, capsys) -> None:
    user = tmp_path / "user"
    _write_data(user)
    places = {"tmp": str(tmp_path), "user": str(user)}
    argv = [part.format(**places) for part in (*RUN, *case.argv)]
    if case.toml is not None:
        (user / "c.toml").write_text(case.toml.format(**places))
        argv += ["--config", str(user / "c.toml")]
    before = _snapshot(tmp_path)
    capsys.readouterr()
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("slide train: error: ") and case.match in lines[0], lines[0]
    assert _snapshot(tmp_path) == before, "a file changed, or something was left behind"


# ---- what the companions accept ----------------------------------------------------------------------------


def _build(*argv: str) -> TrainConfig:
    from slide_hf.cli.train import build_config

    return build_config(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize(
    "argv",
    [
        ("--decay-fraction", "0.2", "--decay-shape", "cosine", "--lr-schedule", "wsd"),
        ("--eval-every", "5", "--eval-fraction", "0.1"),
        ("--eval-every", "0"),  # "off" asks for nothing
        ("--data", "a.jsonl", "--data", "b.jsonl", "--data-weights", "3,1"),
    ],
)
def test_an_option_beside_its_companion_is_accepted(argv) -> None:
    _build(*argv)


def test_toml_options_meet_their_companions_from_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("decay_fraction = 0.3\nallow_data_change = false\neval_every = 0\n")
    cfg = _build("--config", str(config), "--lr-schedule", "wsd")
    assert cfg.decay_fraction == 0.3 and not cfg.allow_data_change


def test_a_resumed_run_is_held_to_what_is_given_now_not_to_its_saved_options() -> None:
    """A run saved (by an older version) with ``eval_every`` and no evaluation data still resumes; giving
    ``--eval-every`` now, with no evaluation data to time, is refused."""
    saved = config_dict(TrainConfig())
    saved.update(eval_every=5, decay_fraction=0.3)
    cfg = resume_config(saved, {"resume": Path("runs/a")}, source="runs/a")
    assert cfg.eval_every == 5
    check_given(cfg, {"resume"})
    given = {"resume": Path("runs/a"), "eval_every": 7}
    with pytest.raises(UserError, match=r"^--eval-every 7 needs evaluation data"):
        check_given(resume_config(saved, given, source="runs/a"), given)
    allowed = {"resume": Path("runs/a"), "allow_data_change": True}
    check_given(resume_config(saved, allowed, source="runs/a"), allowed)


# ---- the Python API --------------------------------------------------------------------------------------------


def test_a_misspelt_keyword_names_the_option_meant(tmp_path: Path) -> None:
    with pytest.raises(UnknownOption, match=r"^unknown option 'learning_rate'; did you mean 'lr'\?$") as caught:
        slide_hf.train("tiny-llama", learning_rate=1e-3, output=tmp_path / "run")
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, UserError)
    with pytest.raises(TypeError, match=r"^unknown option 'no_packing'; did you mean packing=False\?$"):
        slide_hf.train("tiny-llama", no_packing=True, output=tmp_path / "run")
    with pytest.raises(TypeError, match=r"^unknown option 'num_train_epochs'; did you mean 'epochs'\?$"):
        slide_hf.train("tiny-llama", num_train_epochs=3, output=tmp_path / "run")
    with pytest.raises(TypeError, match=r"^unknown option 'eval_evrey'; did you mean 'eval_every'\?$"):
        slide_hf.train("tiny-llama", eval_evrey=3, output=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        ({"decay_shape": "linear"}, r"^decay_shape='linear' shapes the decay of lr_schedule='wsd' only"),
        ({"eval_every": 2}, r"^eval_every='2' needs evaluation data: give eval_data='FILE' or eval_fraction='F'"),
        ({"allow_data_change": True}, r"^allow_data_change= applies only with resume='RUN'"),
    ],
)
def test_the_python_api_refuses_an_option_without_its_companion(tmp_path: Path, keywords, match) -> None:
    with pytest.raises(UserError, match=match):
        slide_hf.train("tiny-llama", output=tmp_path / "run", **keywords)
    assert not (tmp_path / "run").exists()


# ---- mixture weights of any magnitude ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "counts"),
    [
        ((1e308, 1e308), [50, 50]),  # a float sum overflows to inf, the shares to 0/NaN
        ((1e308, 1.0), [100, 0]),  # total * 1e308 overflows
        ((5e-324, 5e-324), [50, 50]),  # subnormal
        ((1e308, 1e308, 1e-300), [50, 50, 0]),
        ((3.0, 1.0), [75, 25]),
    ],
)
def test_mixture_counts_take_weights_of_any_magnitude(weights, counts) -> None:
    assert mixture_counts([50] * len(weights), weights, 100) == counts
    assert sum(weight_shares(weights)) == pytest.approx(1.0)


def test_huge_equal_weights_are_the_even_mixture() -> None:
    even = mixture_order([30, 20], [1, 1], seed=3, epoch=1)
    assert torch.equal(mixture_order([30, 20], [1e308, 1e308], seed=3, epoch=1), even)
    assert weight_shares([1e308, 1e308]) == [0.5, 0.5]


def test_slide_data_reports_shares_of_huge_weights(tmp_path: Path, capsys) -> None:
    _write_data(tmp_path)
    argv = ["data", "--data", str(tmp_path / "a.jsonl"), "--data", str(tmp_path / "b.jsonl"), "--seq-len", "64"]
    assert main([*argv, "--show", "0", "--json", "--data-weights", "1e308,1e308"]) == 0
    shares = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]["sources"]
    assert [share["sampled_share"] for share in shares] == [0.5, 0.5]


@pytest.mark.timeout(180)
def test_slide_train_on_a_mixture_with_a_huge_weight_runs(tmp_path: Path, torch_kernels, capsys) -> None:
    _write_data(tmp_path)
    argv = ["train", "--device", "cpu", "--dtype", "float32", "--seq-len", "16", "--batch-size", "2"]
    argv += ["--data", str(tmp_path / "a.jsonl"), "--data", str(tmp_path / "b.jsonl"), "--data-weights", "1e308,1"]
    assert main([*argv, "--steps", "2", "--output", str(tmp_path / "run")]) == 0, capsys.readouterr().err


# ---- a second signal ---------------------------------------------------------------------------------------------

SIGNAL_RUN = ("--device", "cpu", "--dtype", "float32", "--seq-len", "16", "--batch-size", "2", "--steps", "50")


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_second_sigterm_to_a_running_slide_train_exits_143(tmp_path: Path, torch_kernels) -> None:
    """The first SIGTERM asks for a checkpoint after the step; a second, while the step still runs, ends
    the run at once with 143 (128 + 15), as a shell reports a process SIGTERM ended: a scheduler that sends
    SIGTERM twice must not read the 130 of a Ctrl-C."""
    marker = tmp_path / "in-step-2"
    run = tmp_path / "run"
    argv = ["train", "--output", str(run), *SIGNAL_RUN]
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from slide_core.engine import Engine
        real_step = Engine.step
        def step(self, *args, **kwargs):
            result = real_step(self, *args, **kwargs)
            if result.step == 2:  # hold step 2 open while the signals arrive
                Path({str(marker)!r}).touch()
                time.sleep(120)
            return result
        Engine.step = step
        from slide_hf.cli.main import main
        sys.exit(main({argv!r}))
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the first is handled (a checkpoint requested) before the second comes
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert process.returncode == 143, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "slide train: interrupted by SIGTERM"
    assert not list(run.glob("**/.tmp-*")) and not list(run.glob(".model.tmp-*"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("first", "second", "status"),
    [("SIGTERM", "SIGTERM", 143), ("SIGINT", "SIGTERM", 143), ("SIGTERM", "SIGINT", 130), ("SIGINT", "SIGINT", 130)],
)
def test_the_status_is_the_signal_that_ended_the_run(
    tmp_path: Path, monkeypatch, capsys, torch_kernels, first, second, status
) -> None:
    """Whichever signal came first, the run ends with 128 + the number of the one that forced the exit."""
    from slide_core.engine import Engine

    real_step = Engine.step

    def step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if result.step == 2:  # both arrive during step 2: the second before the step's checkpoint
            os.kill(os.getpid(), getattr(signal, first))
            os.kill(os.getpid(), getattr(signal, second))
        return result

    monkeypatch.setattr(Engine, "step", step)
    assert main(["train", "--output", str(tmp_path / "run"), *SIGNAL_RUN]) == status
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"slide train: interrupted by {second}"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handlers are gone again
