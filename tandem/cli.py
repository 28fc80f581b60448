"""`tandem serve | router | epp | sidecar | planner | bootstrap | kv-store | up | bench` — the composition root.

A start-up mistake of the user (common.wire.user_error.UserError) ends the command with one line on
stderr, `tandem <command>: <what is wrong and what to do>`, and exit code 1; a command line argparse
cannot read, with one line and exit code 2. `--log-level debug` (anywhere on the line) adds the
traceback; any other exception is a bug and always shows its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback

from common.wire.user_error import UserError
from tandem.flags import LOG_LEVEL_ENV, FlagParser, add_log_level_flag, take_log_level

COMMANDS = ("serve", "router", "epp", "sidecar", "planner", "bootstrap", "kv-store", "up", "bench")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = f"tandem {argv[0]}" if argv[:1] and argv[0] in COMMANDS else "tandem"
    try:
        run(take_log_level(argv))
    except UserError as e:
        if os.environ.get(LOG_LEVEL_ENV, "").upper() == "DEBUG":
            traceback.print_exc()
        sys.exit(f"{command}: {e}")


def run(argv: list[str]) -> None:
    if argv[:1] == ["router"]:  # its own parser: repeated `--prefill URL [PORT]` groups
        from tandem.router_cli import run_router_cli

        return run_router_cli(argv[1:])
    if argv[:1] in (["epp"], ["sidecar"]):  # the gateway's endpoint picker, and the pair sidecar of a decode pod
        from tandem.epp_cli import run_epp_cli, run_sidecar_cli

        return (run_epp_cli if argv[0] == "epp" else run_sidecar_cli)(argv[1:])
    if argv[:1] == ["planner"]:
        from tandem.planner_cli import run_planner_cli

        return run_planner_cli(argv[1:])
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        from tandem.server import serve_from_args

        serve_from_args(ns)
    elif ns.command == "up":
        from tandem.up import run_up

        sys.exit(run_up(ns))
    elif ns.command == "kv-store":
        from tandem.kv_store import run_kv_store

        sys.exit(run_kv_store(ns))
    elif ns.command == "bench":
        from tandem.bench.main import run_bench

        run_bench(ns)
    elif ns.command == "bootstrap":
        from bootstrap.app import run_bootstrap
        from common.edge.tls import server_context
        from tandem.ports import require_free_ports

        try:
            tls = server_context(ns.ssl_certfile, ns.ssl_keyfile) if ns.ssl_certfile else None
        except (OSError, ValueError) as e:
            raise UserError(f"--ssl-certfile {ns.ssl_certfile} / --ssl-keyfile {ns.ssl_keyfile}: {e}") from None
        require_free_ports(ns.host, {"--port": ns.port})
        run_bootstrap(ns.host, ns.port, ns.cluster_secret, tls)


def build_parser() -> FlagParser:
    from common.config import ServerConfig
    from tandem.bench.flags import add_bench_flags
    from tandem.flags import add_model_flags
    from tandem.kv_store import add_kv_store_flags
    from tandem.up import add_up_flags

    parser = FlagParser(prog="tandem", description="Prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one engine server (monolithic, prefill or decode)")
    add_model_flags(serve, ServerConfig, command="serve")
    up = sub.add_parser("up", help="bring up a whole local cluster on the built-in model")
    add_up_flags(up)
    bench = sub.add_parser("bench", help="load-test any endpoint")
    add_bench_flags(bench)
    sub.add_parser("router", help="run the PD router (see `tandem router --help`)")
    sub.add_parser(
        "planner", help="decide the P:D split and flip servers or scale Deployments (see `tandem planner --help`)"
    )
    boot = sub.add_parser("bootstrap", help="run a standalone bootstrap server")
    boot.add_argument("--host", default="127.0.0.1")
    boot.add_argument("--port", type=int, default=8998)
    # from the environment too, as every server's, so a Kubernetes Secret can feed it without a flag
    boot.add_argument(
        "--cluster-secret", default=os.environ.get("TANDEM_CLUSTER_SECRET"), help="[env TANDEM_CLUSTER_SECRET]"
    )
    boot.add_argument("--ssl-certfile", help="serve HTTPS with this PEM certificate")
    boot.add_argument("--ssl-keyfile", help="the certificate's private key (default: in --ssl-certfile)")
    store = sub.add_parser("kv-store", help="run a Mooncake Store for --hicache-storage-backend mooncake")
    add_kv_store_flags(store)
    for p in (serve, up, boot, store):
        add_log_level_flag(p)
    return parser


if __name__ == "__main__":
    main()
