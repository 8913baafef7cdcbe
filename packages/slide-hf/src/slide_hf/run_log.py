"""What a run leaves for its user to read: ``options.json``, ``train.log``, ``metrics.jsonl`` and trackers.

Every run writes these into its output directory by default, so a run started under nohup, SLURM or a
notebook can be read afterwards without having asked for anything:
- ``options.json``: the resolved options (what ``--resume`` restores, for people to read);
- ``train.log``: every log line of the run, with times;
- ``metrics.jsonl``: one JSON record per optimizer step and per evaluation (``--metrics`` moves it).

Writing them must never cost the run: a full disk under the metrics file warns once and training goes
on (the checkpoints are what matter). A resumed run first drops the records of steps after its
checkpoint, which the interrupted run wrote but the resumed one is about to redo, so the file holds one
record per step.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError
from slide_hf.spelling import option
from slide_hf.trackers import Tracker, open_trackers

__all__ = ["RunLog"]

log = logging.getLogger("slide.train")


class RunLog:
    """The run's log files and trackers, open for the run's life. A context manager."""

    def __init__(
        self,
        output: Path,
        options: Mapping[str, Any],
        *,
        metrics: Path | None = None,
        report_to: tuple[str, ...] = (),
        inputs: tuple[Path, ...] = (),
    ) -> None:
        self.output = output
        self.options = dict(options)
        self.metrics_path = metrics if metrics is not None else output / "metrics.jsonl"
        self.report_to = report_to
        self._check_not_an_input(inputs)
        self._metrics: Any = None
        self._handler: logging.Handler | None = None
        self._previous_level = logging.NOTSET
        self._trackers: list[Tracker] = []
        self._warned: set[str] = set()

    def _check_not_an_input(self, inputs: tuple[Path, ...]) -> None:
        target = self.metrics_path.expanduser().resolve()
        for path in inputs:
            if path.expanduser().resolve() == target:
                raise UserError(
                    f"{option('metrics', self.metrics_path)} is an input of this run; metrics would be appended to it"
                )

    def __enter__(self) -> RunLog:
        self._write_options()
        try:
            self._handler = logging.FileHandler(self.output / "train.log", encoding="utf-8")
        except OSError as error:
            raise UserError(f"cannot write {self.output / 'train.log'}: {error.strerror}") from None
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        slide = logging.getLogger("slide")
        slide.addHandler(self._handler)
        self._previous_level = slide.level
        if slide.getEffectiveLevel() > logging.INFO:  # train.log has the progress lines whatever the console shows
            slide.setLevel(logging.INFO)
        self._trackers = open_trackers(self.report_to, self.output, self.options)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for tracker in self._trackers:
            self._guard(tracker.name, tracker.close)
        self._trackers = []
        if self._metrics is not None:
            self._guard("metrics", self._metrics.close)
            self._metrics = None
        if self._handler is not None:
            slide = logging.getLogger("slide")
            slide.removeHandler(self._handler)
            slide.setLevel(self._previous_level)
            self._handler.close()
            self._handler = None

    def _write_options(self) -> None:
        path = self.output / "options.json"
        temp = path.with_name(f".options.json.tmp-{os.getpid()}")
        try:
            temp.write_text(json.dumps(self.options, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(temp, path)
        except OSError as error:
            temp.unlink(missing_ok=True)
            raise UserError(f"cannot write {path}: {error.strerror}") from None

    def start(self, first_step: int) -> None:
        """Open the metrics file for a run that starts at ``first_step`` (> 0 when resumed)."""
        path = self.metrics_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if first_step > 0 and path.is_file():
                self._drop_records_after(path, first_step)
            self._metrics = path.open("a", encoding="utf-8")
        except OSError as error:
            raise UserError(f"cannot write metrics to {path}: {error.strerror}") from None

    @staticmethod
    def _drop_records_after(path: Path, step: int) -> None:
        """Keep the records of steps up to ``step`` (the checkpoint a resumed run continues from)."""
        kept = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line)
        temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temp, path)

    def record(self, record: Mapping[str, Any]) -> None:
        """Append one record to the metrics file and every tracker; failures warn once and are dropped."""
        clean = {key: (None if isinstance(v, float) and not math.isfinite(v) else v) for key, v in record.items()}
        if self._metrics is not None:
            self._guard("metrics", lambda: self._write_line(json.dumps(clean)))
        for tracker in self._trackers:
            self._guard(tracker.name, lambda t=tracker: t.log(record, int(record["step"])))

    def _write_line(self, line: str) -> None:
        self._metrics.write(line + "\n")
        self._metrics.flush()

    def _guard(self, what: str, action: Any) -> None:
        try:
            action()
        except Exception as error:
            if what not in self._warned:
                self._warned.add(what)
                detail = getattr(error, "strerror", None) or str(error).splitlines()[0] if str(error) else repr(error)
                target = self.metrics_path if what == "metrics" else f"the {what} tracker"
                log.warning("cannot write to %s (%s); training goes on without it", target, detail)
