"""The version a server and a router answer on GET /version (vLLM's and SGLang's endpoint): the package's."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
