"""The Python entry point for notebooks and scripts: ``slide_hf.train(...)``, the same run as `slide train`.

    import slide_hf
    summary = slide_hf.train("Qwen/Qwen2.5-0.5B", data="chat.jsonl", steps=200, output="runs/qwen",
                             on_step=lambda record: print(record["loss"]))

Options are the keyword names of `slide train`'s flags (underscores), validated by the same layer
(:mod:`slide_hf.options`); paths may be ``str`` or ``Path``. ``resume="runs/qwen"`` restores the saved
run's options as ``--resume`` does. Bad input raises :class:`~slide_hf.errors.UserError` with the same one
line the CLI prints, naming keyword arguments (``resume=``) where the CLI names flags (slide_hf/spelling.py);
a misspelt keyword raises :class:`~slide_hf.errors.UnknownOption` (``unknown option 'learning_rate'; did you
mean 'lr'?``), which is a ``TypeError`` as well. Log lines go to the notebook's output (stderr) unless the
caller configured logging.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slide_hf.options import TrainConfig, resume_config, train_options
from slide_hf.options.companions import check_given
from slide_hf.options.suggest import unknown_option
from slide_hf.recipe import TrainSummary
from slide_hf.recipe import train as run_training
from slide_hf.spelling import keyword_spelling

__all__ = ["train", "train_config"]

Record = dict[str, Any]

log = logging.getLogger("slide.train")


def _visible_logging() -> None:
    """Make the run's progress lines appear where a notebook shows them, once, if nobody set up logging."""
    root, slide = logging.getLogger(), logging.getLogger("slide")
    if root.handlers or slide.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    slide.addHandler(handler)
    slide.setLevel(logging.INFO)


def train(
    model: str | Path = "tiny-llama",
    data: str | Path | Sequence[str | Path] | None = None,
    *,
    on_step: Callable[[Record], None] | None = None,
    on_eval: Callable[[Record], None] | None = None,
    **options: Any,
) -> TrainSummary:
    """Train ``model`` on ``data`` with `slide train`'s options; return the run's summary.

    ``data`` may list several sources (``data=["a.jsonl", "b.jsonl"], data_weights=[3, 1]``, docs/data.md).

    ``on_step`` receives each step's metrics record (the same dict as a ``metrics.jsonl`` line) and
    ``on_eval`` each evaluation's; both run on the training thread between steps, so keep them quick."""
    _visible_logging()
    with keyword_spelling():  # messages name keyword arguments (resume=), not flags (slide_hf/spelling.py)
        return _train(model, data, on_step, on_eval, options)


def _train(
    model: str | Path,
    data: str | Path | Sequence[str | Path] | None,
    on_step: Callable[[Record], None] | None,
    on_eval: Callable[[Record], None] | None,
    options: dict[str, Any],
) -> TrainSummary:
    summary = run_training(train_config(model, data, **options), on_step=on_step, on_eval=on_eval)
    if summary.steps == 0:  # said here, once: `slide train` prints its own summary instead
        log.info("nothing left to train in %s; model written to %s", summary.output, summary.model_dir)
    else:
        log.info(
            "loss %.4f -> %.4f over %d steps; model written to %s",
            summary.first_loss,
            summary.last_loss,
            summary.steps,
            summary.model_dir,
        )
    return summary


def train_config(
    model: str | Path = "tiny-llama", data: str | Path | Sequence[str | Path] | None = None, **options: Any
) -> TrainConfig:
    """The run's options as :func:`train` takes them (its keywords are :class:`TrainConfig`'s options,
    slide_hf/options/config.py), checked by the same rules as `slide train`'s flags; ``resume=`` restores
    the saved run's options first. A keyword that is no option raises :class:`~slide_hf.errors.UnknownOption`
    (a ``UserError`` and a ``TypeError``) naming the option meant. Call it inside
    :func:`~slide_hf.spelling.keyword_spelling` for messages that name keywords."""
    known = {item.name for item in train_options()}
    for key, value in options.items():
        if key not in known:
            raise unknown_option(key, value, style="keyword")
    given: dict[str, Any] = {"model": str(model), **options}
    if data is not None:
        given["data"] = data
    if given.get("resume") is not None:
        from slide_hf.run_options import saved_options

        if model == "tiny-llama":
            given.pop("model")  # the default: take the saved run's model
        saved, source = saved_options(Path(given["resume"]))
        cfg = resume_config(saved, given, source=source)
    else:
        from slide_hf.run_options import init_model_options

        if model == "tiny-llama" and given.get("init_from") is not None:
            given.pop("model")  # the default: take the model of the run it starts from
        cfg = TrainConfig(**init_model_options(given))
    check_given(cfg, options)  # a keyword the run would not use (decay_shape= without a wsd schedule)
    return cfg
