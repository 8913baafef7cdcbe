"""``slide train --config FILE.toml``: the options of a run as TOML keys, the same names as the fields.

The keys are :class:`~slide_hf.options.TrainConfig`'s options (slide_hf/options/config.py), nothing else:
an unknown key is refused with the one meant (``no_packing = true``: ``packing = false``, see
slide_hf/options/suggest.py). A value of the wrong TOML type (``steps = 2.5``, ``data = 5``) is named here,
in one line, rather than deep in training. The values then go through the same rules as flags and keywords.
"""

from __future__ import annotations

import enum
import tomllib
import typing
from pathlib import Path
from typing import Any

from slide_hf.errors import UnknownOption, UserError
from slide_hf.options.config import train_options
from slide_hf.options.schema import Declared
from slide_hf.options.suggest import unknown_option

__all__ = ["toml_options"]


def toml_options(path: Path) -> dict[str, Any]:
    """The options in the TOML file at ``path``, each checked to be a known key of the right TOML type."""
    known = {item.name: item for item in train_options()}
    values: dict[str, Any] = {}
    for key, value in _read(path).items():
        if key not in known:
            raise UnknownOption(f"config file {path}: {unknown_option(key, value, style='toml')}")
        _check_type(path, known[key], value)
        if key == "report_to" and isinstance(value, list):
            value = ",".join(value)
        values[key] = value
    return values


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as error:
        raise UserError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"config file {path} is not valid TOML: {error}") from None


_TOML_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "Path": (str,),
    "bool": (bool,),
}


def _type_names(kinds: tuple[Any, ...]) -> list[str]:
    """``Path``, ``float``, ``str`` (a name from a set of choices is a TOML string)."""
    names = []
    for kind in kinds:
        if kind is type(None):
            continue
        names.append("str" if isinstance(kind, type) and issubclass(kind, enum.Enum) else kind.__name__)
    return names


def _check_type(path: Path, item: Declared, value: Any) -> None:
    """A ``tuple[X, ...]`` option takes a TOML list of X (``data = ["a.jsonl", "b.jsonl"]``)."""
    members = typing.get_args(item.hint) if typing.get_origin(item.hint) is not tuple else (item.hint,)
    members = members or (item.hint,)
    scalars = _type_names(tuple(m for m in members if typing.get_origin(m) is not tuple))
    items = _type_names(tuple(typing.get_args(m)[0] for m in members if typing.get_origin(m) is tuple))
    if isinstance(value, list) and items:
        if not all(_type_ok(element, items) for element in value):
            raise UserError(f"config file {path}: {item.name} must be a list of {' or '.join(items)}, got {value!r}")
        return
    if not _type_ok(value, scalars):
        wanted = " or ".join(scalars) if scalars else f"a list of {' or '.join(items)}"
        raise UserError(f"config file {path}: {item.name} must be {wanted}, got {value!r}")


def _type_ok(value: Any, names: list[str]) -> bool:
    allowed = tuple(kind for name in names for kind in _TOML_TYPES.get(name, (object,)))
    return not (isinstance(value, bool) and bool not in allowed) and isinstance(value, allowed)
