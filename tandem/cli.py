"""`tandem serve | router | bootstrap | up | bench` — the composition root."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:  # its own parser: repeated `--prefill URL [PORT]` groups
        from tandem.router_cli import run_router_cli

        return run_router_cli(argv[1:])
    from common.config import ServerConfig

    parser = argparse.ArgumentParser(prog="tandem", description="Prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one engine server (monolithic, prefill or decode)")
    from tandem.flags import add_model_flags

    add_model_flags(serve, ServerConfig)
    up = sub.add_parser("up", help="bring up a whole local cluster on the built-in model")
    from tandem.up import add_up_flags

    add_up_flags(up)
    bench = sub.add_parser("bench", help="load-test any endpoint")
    from tandem.bench.flags import add_bench_flags

    add_bench_flags(bench)
    sub.add_parser("router", help="run the PD router (see `tandem router --help`)")
    boot = sub.add_parser("bootstrap", help="run a standalone bootstrap server")
    boot.add_argument("--host", default="127.0.0.1")
    boot.add_argument("--port", type=int, default=8998)
    # from the environment too, as every server's, so a Kubernetes Secret can feed it without a flag
    boot.add_argument(
        "--cluster-secret", default=os.environ.get("TANDEM_CLUSTER_SECRET"), help="[env TANDEM_CLUSTER_SECRET]"
    )

    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from tandem.server import serve_from_args

        serve_from_args(ns)
    elif ns.command == "up":
        from tandem.up import run_up

        sys.exit(run_up(ns))
    elif ns.command == "bench":
        from tandem.bench.main import run_bench

        run_bench(ns)
    elif ns.command == "bootstrap":
        from bootstrap.app import run_bootstrap

        run_bootstrap(ns.host, ns.port, ns.cluster_secret)


if __name__ == "__main__":
    main()
