"""Start-up errors a user causes: a flag out of range, flags that contradict each other, a model path that
is not there, a port another process holds (the CLI's port check, tandem/ports.py). `UserError`'s message names
the flag or path, says what is wrong and what to do; `tandem` (tandem/cli.py) prints it as one line and exits 1,
with a traceback only under `--log-level debug`. Any other exception is a bug and keeps its traceback.

Torch-free, so the router and the bootstrap registry check their flags with it too.
"""

from __future__ import annotations

from pydantic import ValidationError

ENV_PREFIXES = ("TANDEM_ROUTER_", "TANDEM_PLANNER_", "TANDEM_")  # the config models' env_prefix, longest first


class UserError(Exception):
    """A start-up error the user can fix; the message says what is wrong and what to do."""


def config_error(e: ValidationError) -> UserError:
    """The first problem of a config model's validation, named by its flag: `--page-size 0: Input
    should be ...`; a check across fields (no location) speaks for itself."""
    err = e.errors()[0]
    message = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:
        return UserError(message)
    where = ".".join(str(x) for x in err["loc"])
    if where.isupper():  # read from the environment under a field's alias (TANDEM_..._NAME): named by its flag
        where = next((where.removeprefix(p) for p in ENV_PREFIXES if where.startswith(p)), where).lower()
    flag = "--" + where.replace("_", "-")
    return UserError(f"{flag} {err.get('input')}: {message}")
