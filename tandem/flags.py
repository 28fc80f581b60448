"""Command-line flags: generated from a pydantic settings model (one source for names, help and defaults),
a parser whose mistakes take one line, and `--log-level`."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import typing

from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo

from common.wire.user_error import UserError
from tandem.spellings import Spelling, spellings_of


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    skip: frozenset[str] = frozenset(),
    command: str | None = None,
) -> None:
    """One --flag per field of a settings model (all but `skip`), also under its other spellings for
    `command` (tandem/spellings.py); flags not given stay unset, so the model's environment variables (its
    env_prefix, or a field's validation_alias) can fill them."""
    prefix = model.model_config.get("env_prefix", "")
    others = spellings_of(command) if command else {}
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        spellings = others.get(name, [])
        flags = ["--" + name.replace("_", "-"), *(s.flag for s in spellings)]
        kind = field.annotation
        if type(None) in typing.get_args(kind):  # X | None: the flag is X's
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        args = typing.get_args(kind)
        env = env_names(field, prefix + name.upper())
        help_text = f"{field.description or ''} [env {env}, default {field.default}]{also_spelled(spellings)}"
        kw = dict(dest=name, default=argparse.SUPPRESS, help=help_text)
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(*flags, choices=args, **kw)
        elif typing.get_origin(kind) is list:  # NAME=PATH ...: one or more values
            inner = typing.get_args(args[0]) if typing.get_origin(args[0]) is typing.Literal else None
            parser.add_argument(*flags, nargs="+", choices=inner, **kw)
        else:
            parser.add_argument(*flags, **kw)
    for switch in others.get(None, []):
        parser.add_argument(switch.flag, action=AlwaysOn, help=f"accepted: {switch.why}")


def also_spelled(spellings: list[Spelling]) -> str:
    """What --help adds for a flag's other spellings: ` [SGLang's spelling: --tp, --tensor-parallel-size]`."""
    by_whose: dict[str, list[str]] = {}
    for s in spellings:
        by_whose.setdefault(s.whose, []).append(s.flag)
    return "".join(f" [{whose} spelling: {', '.join(flags)}]" for whose, flags in by_whose.items())


def env_names(field: FieldInfo, default: str) -> str:
    """The environment variable(s) a field is read from: its validation_alias (one name, or the choices of
    a renamed field: the new name first), else the prefixed field name."""
    alias = field.validation_alias
    if isinstance(alias, str):
        return alias
    if isinstance(alias, AliasChoices):
        return " or ".join(str(c) for c in alias.choices if str(c).isupper())
    return default


class AlwaysOn(argparse.Action):
    """An SGLang switch for what Tandem always does: takes no value, sets nothing."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: typing.Any):
        kwargs["default"] = argparse.SUPPRESS
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        pass


class FlagParser(argparse.ArgumentParser):
    """argparse whose mistakes take one line, naming the flag as the user spelled it (of its spellings,
    tandem/spellings.py) and where the help is, not the usage text."""

    typed: frozenset[str] = frozenset()

    def parse_known_args(self, args=None, namespace=None):
        self.typed = frozenset(a.partition("=")[0] for a in (sys.argv[1:] if args is None else args))
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        message = re.sub(r"^argument ((?:--[\w-]+/)+--[\w-]+):", self._as_typed, message)
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def _as_typed(self, match: re.Match) -> str:
        """`argument --a/--b:` (argparse names every spelling) as the one spelling the user typed."""
        spellings = match[1].split("/")
        return f"argument {next((f for f in spellings if f in self.typed), spellings[0])}:"


LOG_LEVEL_ENV = "TANDEM_LOG_LEVEL"  # every Tandem process reads it; `tandem up` hands it to its children
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    """For --help only: tandem/cli.py takes the flag off the command line before any parser sees it."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help=f"debug also prints the traceback of a start-up error [env {LOG_LEVEL_ENV}, default info]",
    )


def log_to_stderr(tag: str) -> None:
    """A process's log lines, at --log-level's level, each tagged with what the process is (`[router]`)."""
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def take_log_level(argv: list[str]) -> list[str]:
    """`argv` without `--log-level LEVEL` (anything after `--` is left alone); the level goes to the environment."""
    out, rest = list(argv), []
    if "--" in out:
        out, rest = out[: out.index("--")], out[out.index("--") :]
    for i, arg in enumerate(out):
        if arg == "--log-level" or arg.startswith("--log-level="):
            value = arg.partition("=")[2] if "=" in arg else (out[i + 1] if i + 1 < len(out) else "")
            if value.lower() not in LOG_LEVELS:
                raise UserError(f"--log-level {value}: use one of {', '.join(LOG_LEVELS)}")
            os.environ[LOG_LEVEL_ENV] = value.upper()
            return take_log_level(out[:i] + out[i + (1 if "=" in arg else 2) :]) + rest
    return out + rest
