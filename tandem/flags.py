"""Command-line flags: generated from a pydantic settings model (one source for names, help and defaults),
a parser whose mistakes take one line, and `--log-level`."""

from __future__ import annotations

import argparse
import os
import typing

from pydantic import BaseModel

from common.wire.user_error import UserError


def add_model_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], skip: frozenset[str] = frozenset()
) -> None:
    """One --flag per field of a settings model (all but `skip`); flags not given stay unset, so the
    model's environment variables (its env_prefix, or a field's validation_alias) can fill them."""
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        env = field.validation_alias if isinstance(field.validation_alias, str) else prefix + name.upper()
        flag = "--" + name.replace("_", "-")
        kind = field.annotation
        if type(None) in typing.get_args(kind):  # X | None: the flag is X's
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        args = typing.get_args(kind)
        help_text = (field.description or "") + f" [env {env}, default {field.default}]"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=args, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, default=argparse.SUPPRESS, help=help_text)


class FlagParser(argparse.ArgumentParser):
    """argparse whose mistakes take one line, naming the flag and where the help is, not the usage text."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


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
