"""Command-line flags generated from a pydantic settings model: one source for names, help and defaults."""

from __future__ import annotations

import argparse
import typing

from pydantic import BaseModel


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
        args = typing.get_args(kind)
        help_text = (field.description or "") + f" [env {env}, default {field.default}]"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=args, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, default=argparse.SUPPRESS, help=help_text)
