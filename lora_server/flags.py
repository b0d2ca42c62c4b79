"""Command-line flags from the config dataclasses: every field of lora_server.config with flag metadata becomes a
flag (its help, unit and default live there), and a command's parsed flags become the config again. The commands'
registry lives here too, so that the CLI and the benchmarks' commands add to it alike."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from typing import Any

from lora_server.config import EngineConfig

_METAVARS = {int: "N", float: "X", str: "TEXT"}
AddArgs = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]
Commands = dict[str, tuple[str, AddArgs, Run]]  # name -> (help, add its arguments, run it: exit code)


def registry(commands: Commands) -> Callable[[str, str, AddArgs], Callable[[Run], Run]]:
    """A decorator ``@command(name, help, add_args)`` that adds the function it decorates to ``commands``."""

    def command(name: str, help_text: str, add_args: AddArgs) -> Callable[[Run], Run]:
        def register(run: Run) -> Run:
            commands[name] = (help_text, add_args, run)
            return run

        return register

    return command


def add_config_flags(p: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """A flag for every field of ``cls`` with flag metadata (lora_server.config.flag): its type, choices, unit and
    help from the field; its default the field's, or ``defaults[field]`` (in the flag's unit) for this command."""
    group = p.add_argument_group("engine" if cls is EngineConfig else "server")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        name = meta["flag"] or "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            if meta["negate"]:
                group.add_argument(meta["negate"], dest=f.name, action="store_false", help=f"{meta['help']}: off")
            else:
                group.add_argument(name, dest=f.name, action="store_true", help=meta["help"])
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        if typing.get_origin(base) is tuple:  # list-valued: commas and repetition
            group.add_argument(
                name, dest=f.name, action="append", default=None, metavar="VALUE[,VALUE...]", help=meta["help"]
            )
            continue
        unit = meta["unit"]
        if f.name in defaults:  # this command's default, already in the flag's unit
            shown = defaults[f.name]
        else:  # the field's, in its own unit (bytes for a GiB flag)
            value = f.default if f.default is not dataclasses.MISSING else None
            shown = value if value is None or unit == 1 else value / unit
        unit_text = f" {meta['unit_name']}" if meta["unit_name"] else ""
        help_text = (
            meta["help"]
            if "default:" in meta["help"]
            else f"{meta['help']} (default: {'none' if shown is None else shown}{unit_text})"
        )
        group.add_argument(
            name,
            dest=f.name,
            type=float if unit != 1 else base,
            default=shown,
            choices=meta["choices"] or None,
            help=help_text,
            metavar=meta["unit_name"] or (None if meta["choices"] else _METAVARS.get(base, "TEXT")),
        )


def config_from_flags(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """``cls`` built from the flags ``add_config_flags`` added (units converted, lists split on commas), plus
    ``values``."""
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in values or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(value, list):
            value = tuple(v for item in value for v in item.split(",") if v)
        elif f.metadata["unit"] != 1 and value is not None:
            value = int(value * f.metadata["unit"])
        values[f.name] = value
    try:
        return cls(**values)
    except ValueError as exc:  # a value out of range: an error line, not a traceback
        from lora_server.errors import ConfigError

        raise ConfigError(str(exc)) from exc
