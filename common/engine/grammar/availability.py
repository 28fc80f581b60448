"""Whether constrained decoding can run here: xgrammar is imported by the grammar backend, and a machine may
lack it (or hold a build that does not load). A server started with the default `--grammar-backend xgrammar`
then says so in one line and serves every unconstrained request; a constrained one gets a 400 naming its field
(`GrammarOff`). Given explicitly (the flag or TANDEM_GRAMMAR_BACKEND), xgrammar is a requirement: the server
refuses to start, before its weights load (`check_grammar_backend`)."""

from __future__ import annotations

import functools
import importlib

from common.config import ServerConfig
from common.wire.errors import InvalidRequest
from common.wire.structured_output import GrammarSpec
from common.wire.user_error import UserError

XGRAMMAR_PIN = "xgrammar==0.2.8"  # what scripts/setup.sh installs


@functools.cache
def xgrammar_import_error() -> str | None:
    """Why `import xgrammar` fails here (its exception, one line), None when it imports."""
    try:
        importlib.import_module("xgrammar")
    except (ImportError, OSError) as e:  # a missing package, or a native library that does not load
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0]}" if text else repr(e)
    return None


def explicit(config: ServerConfig) -> bool:
    """Whether `--grammar-backend` (or its variable) was given, rather than left at its default."""
    return "grammar_backend" in config.model_fields_set


def check_grammar_backend(config: ServerConfig) -> None:
    """A UserError when `--grammar-backend xgrammar` was asked for and xgrammar does not import here."""
    error = xgrammar_import_error() if config.grammar_backend == "xgrammar" and explicit(config) else None
    if error is not None:
        raise UserError(
            f"--grammar-backend xgrammar: xgrammar does not import here ({error}); install it "
            f"(pip install --no-deps {XGRAMMAR_PIN}), or leave the flag out to serve unconstrained requests only"
        )


class GrammarOff:
    """The engine's grammar backend when xgrammar cannot import: every constrained request is a 400 naming
    its field, before anything is scheduled (the HTTP layer's `check`)."""

    def __init__(self, reason: str):
        self.reason = reason

    async def check(self, spec: GrammarSpec) -> None:
        raise InvalidRequest(
            f"{spec.param}: constrained decoding is off on this server: xgrammar does not import ({self.reason})",
            param=spec.param,
        )

    def info_dict(self) -> dict:
        return {"backend": "none", "reason": f"xgrammar does not import ({self.reason})"}

    def close(self) -> None:
        pass
