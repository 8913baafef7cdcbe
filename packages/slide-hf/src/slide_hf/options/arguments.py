"""The flags of `slide train`, `slide plan`, `slide bench` and `slide data`, generated from the declared options.

Each command's parser gets every option whose declaration names the command (slide_hf/options/config.py),
with the flag, help, default and metavar the declaration gives. `slide train` leaves every default unset
(``None``): its values merge with a ``--config`` file, where a flag given wins and one not given must not
override the file. Choices are not argparse ``choices``: the option's rule checks them (with the aliases
resolved first) and names what is accepted in one line.
"""

from __future__ import annotations

import argparse
from typing import Any

from slide_hf.options.config import Launch, TrainConfig
from slide_hf.options.schema import Command, Declared, declared

__all__ = ["add_options", "command_options", "given_options"]


def command_options(command: Command) -> tuple[Declared, ...]:
    """The declared options ``command``'s parser takes, in declaration order (the run's, then the launch's)."""
    return tuple(item for item in (*declared(TrainConfig), *declared(Launch)) if item.takes(command))


def add_options(parser: argparse.ArgumentParser, command: Command) -> None:
    """Add ``command``'s declared options to ``parser``."""
    for item in command_options(command):
        kwargs: dict[str, Any] = {"dest": item.name, "help": item.help_for(command)}
        kwargs["default"] = None if command == "train" else item.default_for(command)
        if item.spec.action is not None:
            kwargs["action"] = item.spec.action
        else:
            kwargs["type"] = item.cli_type() or str
            metavar = item.metavar()
            if metavar is not None:
                kwargs["metavar"] = metavar
        if command in item.spec.required:
            kwargs["required"] = True
            kwargs.pop("default")
        parser.add_argument(item.flag, **kwargs)


def given_options(args: argparse.Namespace, command: Command, *, of: type[Any] = TrainConfig) -> dict[str, Any]:
    """The values of ``of``'s options that ``command``'s parser holds: for `slide train` only those given
    (unset is ``None``), for the other commands every one (their defaults are set)."""
    names = {item.name for item in declared(of) if item.takes(command)}
    values = {name: getattr(args, name, None) for name in names}
    return {name: value for name, value in values.items() if value is not None or command != "train"}
