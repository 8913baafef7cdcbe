"""Options that do something only beside another: ``--decay-fraction`` shapes the ``wsd`` schedule alone,
``--allow-data-change`` answers a resume's data check, ``--init-weights-only`` says what ``--init-from``
takes, ``--eval-every`` times an evaluation that needs evaluation data, ``--data-weights`` weighs several
``--data`` sources, ``--nvme-fraction`` splits the Adam state between RAM and an ``--offload-optimizer`` tier,
``--gamma`` is SimPO's and ``--dpo-loss`` DPO's (written at their defaults beside another objective).

Given without its companion such an option would change nothing, silently, and a user who wrote
``--decay-fraction 0.2 --lr-schedule cosine`` would believe the run decays as asked. So it is refused in
one line naming the option and what it needs:

- by value, as a cross-option rule (slide_hf/options/validate.py), whichever way the value came in (flags,
  the TOML file, ``slide_hf.train``): an option away from its default asks for its companion;
- by what the user wrote (:func:`check_given`, at `slide train` and ``slide_hf.train``), so an option
  written at its default value asks too (``decay_shape = "linear"`` beside ``lr_schedule = "cosine"``),
  except where the default is "off" (``--eval-every 0``, ``allow_data_change = false``). A resumed run is
  held to this alone: its saved options were accepted when it started.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slide_hf.errors import UserError
from slide_hf.options.schema import default_of
from slide_hf.options.sources import data_sources
from slide_hf.spelling import option

if TYPE_CHECKING:
    from slide_hf.options.config import TrainConfig

__all__ = ["COMPANIONS", "Companion", "check_given"]


@dataclass(frozen=True)
class Companion:
    """Option ``name`` acts only where ``used(cfg)``: ``reads`` names the options ``used`` looks at (a rule
    applies to a command only when the command takes all of them), ``needs(cfg)`` says in the refusal what
    the option needs. ``default_asks``: naming the option at its default value asks for something (a
    schedule's shape does; ``--eval-every 0``, "off", does not)."""

    name: str
    reads: tuple[str, ...]
    used: Callable[[TrainConfig], bool]
    needs: Callable[[TrainConfig], str]
    default_asks: bool = True
    by_value: bool = True
    """Also refused by value, as a cross-option rule; False where a rule of its own (slide_hf/options/
    validate.py) already refuses the value, and only the written default is left to this check."""

    @property
    def options(self) -> tuple[str, ...]:
        return (self.name, *self.reads)

    def check(self, cfg: TrainConfig, given: Collection[str] | None = None) -> None:
        """Refuse the option where it is asked for and ``cfg`` makes no use of it: asked for by a value other
        than its default, or with ``given`` (the names the user wrote), by being written (at its default
        too where :attr:`default_asks`)."""
        value = getattr(cfg, self.name)
        changed = value != _default(cfg, self.name)
        written = given is not None and self.name in given and value is not None  # None: "not given"
        asked = changed if given is None else written and (changed or self.default_asks)
        if asked and not self.used(cfg):
            raise UserError(f"{_setting(self.name, value)} {self.needs(cfg)}")

    def rule(self, cfg: TrainConfig, world_size: int) -> None:
        """:meth:`check` by value, as a cross-option rule (slide_hf/options/validate.py). A resumed run is
        held to what its user gives now (:func:`check_given`), not to the options it saved: those were
        accepted when it started (by an older version, perhaps), and most of them cannot change now."""
        if cfg.resume is None and self.by_value:
            self.check(cfg)


def _default(cfg: TrainConfig, name: str) -> Any:
    """The declared default of ``cfg``'s option ``name`` (read from the config's class, so this module needs
    no import of config.py, which imports the rules that import it)."""
    return default_of(type(cfg), name)


def _setting(name: str, value: Any) -> str:
    """``--decay-fraction 0.2``, ``--allow-data-change`` (a switch is named alone)."""
    if isinstance(value, bool):
        return option(name)
    shown = getattr(value, "value", value)
    if isinstance(shown, tuple):
        shown = ",".join(f"{item:g}" if isinstance(item, float) else str(item) for item in shown)
    return option(name, shown)


def _schedule_only(name: str, schedule: str, part: str = "") -> Companion:
    """An option that shapes one lr schedule alone (``--lr-cycles`` for cosine_with_restarts); ``part``: of
    the schedule, the part it shapes (``"the decay of "`` for wsd's)."""
    return Companion(
        name,
        ("lr_schedule",),
        lambda cfg: cfg.lr_schedule == schedule,
        lambda cfg: (
            f"shapes {part}{option('lr_schedule', schedule)} only, and the schedule is {cfg.lr_schedule.value}; "
            f"give {option('lr_schedule', schedule)} or leave {option(name)} out"
        ),
    )


def _objective_only(name: str, objective: str) -> Companion:
    """An option of one preference objective's loss, written at its default beside another objective
    (validate.py's preference rules refuse its other values there)."""
    return Companion(
        name,
        ("objective",),
        lambda cfg: cfg.objective.value == objective,
        lambda cfg: f"acts only with {option('objective', objective)}, got {option('objective', cfg.objective.value)}",
        by_value=False,
    )


def _sources(cfg: TrainConfig) -> int:
    return len(data_sources(cfg))


COMPANIONS: tuple[Companion, ...] = (
    _schedule_only("decay_fraction", "wsd", "the decay of "),
    _schedule_only("decay_shape", "wsd", "the decay of "),
    _schedule_only("lr_cycles", "cosine_with_restarts"),
    _schedule_only("lr_power", "polynomial"),
    _schedule_only("lr_end", "polynomial"),
    _schedule_only("lr_timescale", "inverse_sqrt"),
    Companion(
        "hub_private",
        ("push_to_hub",),
        lambda cfg: cfg.push_to_hub is not None,
        lambda cfg: f"applies to the repository of {option('push_to_hub', 'REPO')}; give it",
        default_asks=False,
    ),
    Companion(
        "allow_data_change",
        ("resume",),
        lambda cfg: cfg.resume is not None,
        lambda cfg: f"applies only with {option('resume', 'RUN')}: a new run has no saved data to compare with",
        default_asks=False,
    ),
    Companion(
        "init_weights_only",
        ("init_from",),
        lambda cfg: cfg.init_from is not None,
        lambda cfg: f"applies only with {option('init_from', 'RUN')}: it says what to take of that run",
        default_asks=False,
    ),
    Companion(
        "eval_every",
        ("eval_data", "eval_fraction"),
        lambda cfg: cfg.evaluates,
        lambda cfg: (
            f"needs evaluation data: give {option('eval_data', 'FILE')} or {option('eval_fraction', 'F')} "
            "(without it nothing is evaluated)"
        ),
        default_asks=False,
    ),
    Companion(
        "nvme_fraction",
        ("offload_optimizer",),
        lambda cfg: cfg.offload_optimizer != "ram",
        lambda cfg: (
            f"says which share of the units' Adam state goes to the {option('offload_optimizer')} tier, and that "
            f"tier is ram (nothing offloaded); give {option('offload_optimizer', 'nvme')} or leave "
            f"{option('nvme_fraction')} out"
        ),
        default_asks=False,
    ),
    _objective_only("gamma", "simpo"),
    _objective_only("dpo_loss", "dpo"),
    Companion(
        "data_weights",
        ("data",),
        lambda cfg: _sources(cfg) > 1,
        lambda cfg: f"weighs two or more {option('data')} sources against each other; this run has one",
    ),
)
"""Every option that needs a companion, in the order they are checked."""


def check_given(cfg: TrainConfig, given: Collection[str]) -> None:
    """Refuse an option the user wrote (``given``: the names of the flags, TOML keys or keywords) that
    ``cfg`` makes no use of, even at its default value."""
    for companion in COMPANIONS:
        companion.check(cfg, given)
