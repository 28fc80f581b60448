"""A machine where xgrammar does not import (an `xgrammar` on PYTHONPATH that raises ImportError, as a missing
or broken install does), through `tandem serve`: with the default grammar backend the server says so in one
warning line, serves unconstrained requests exactly as a server with xgrammar does, and answers each
constrained one with a 400 naming its field before anything is scheduled; `--grammar-backend xgrammar`
given explicitly refuses to start with one line, before the model loads."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.ports import free_port

# the flags of test_structured_output.py's shared server: the reference here is that same server
BUILTIN = ("--model", "builtin", "--page-size", "4", "--chunked-prefill-size", "32", "--max-total-tokens", "4096")
BROKEN = "xgrammar is broken on this machine (tests/integration/test_grammar_unavailable.py)"


@pytest.fixture(scope="module")
def no_xgrammar(tmp_path_factory) -> str:
    """A PYTHONPATH directory whose `xgrammar` fails to import."""
    site = tmp_path_factory.mktemp("no-xgrammar")
    (site / "xgrammar").mkdir()
    (site / "xgrammar" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return str(site)


@pytest.fixture(scope="module")
def server(no_xgrammar):
    port = free_port()
    proc = ServerProcess(["serve", "--port", str(port), *BUILTIN], port, "no-xgrammar", env={"PYTHONPATH": no_xgrammar})
    yield proc.wait_ready()
    proc.stop()


def generate(server, **sampling) -> httpx.Response:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12, "temperature": 0} | sampling}
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def test_unconstrained_requests_are_served_as_with_xgrammar(server, reference_servers):
    warnings = [line for line in server.log_tail(400).splitlines() if "constrained decoding is off" in line]
    assert len(warnings) == 1 and f"xgrammar does not import (ImportError: {BROKEN})" in warnings[0], warnings
    got, want = generate(server), generate(reference_servers.get(*BUILTIN))
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["output_ids"] == want.json()["output_ids"] and len(got.json()["output_ids"]) == 12
    assert server.info()["grammar"] == {
        "backend": "none",
        "reason": f"xgrammar does not import (ImportError: {BROKEN})",
    }


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4}}, "sampling_params.regex"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)  # fmt: skip
def test_a_constrained_request_is_a_400_naming_its_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"] == (
        f"{param}: constrained decoding is off on this server: xgrammar does not import (ImportError: {BROKEN})"
    )
    assert server.wait_idle()["in_use"] == 0


def test_an_explicit_grammar_backend_refuses_to_start_without_xgrammar(no_xgrammar):
    port = free_port()
    args = ["serve", "--port", str(port), *BUILTIN, "--grammar-backend", "xgrammar"]
    code, last = ServerProcess(args, port, "no-xgrammar-explicit", env={"PYTHONPATH": no_xgrammar}).run_to_exit()
    assert code == 1
    assert last == (
        f"tandem serve: --grammar-backend xgrammar: xgrammar does not import here (ImportError: {BROKEN}); install it "
        "(pip install --no-deps xgrammar==0.2.8), or leave the flag out to serve unconstrained requests only"
    )
