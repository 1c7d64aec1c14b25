"""The ``skyring`` command. ``skyring serve`` runs a node; every flag is also ``SKYRING_<NAME>``, and flags win."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from . import __version__, logs
from .settings import ENV_PREFIX, FIELDS, Settings, field_type

__all__ = ["build_parser", "main", "settings_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyring", description="Distributed timers over HTTP.")
    parser.add_argument("--version", action="version", version=f"skyring {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run a node",
        description="Run a skyring node. Each flag can also be set as an environment variable SKYRING_<FLAG>.",
    )
    defaults = Settings()
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        choices = f.metadata.get("choices")
        kind = field_type(f)
        serve.add_argument(
            flag,
            dest=f.name,
            metavar="{" + ",".join(choices) + "}" if choices else kind.__name__.upper(),
            nargs="?" if kind is bool else None,  # a bare --flag means true
            const="true" if kind is bool else None,
            default=None,
            help=f"{f.metadata['help']} [{ENV_PREFIX}{f.name.upper()}] (default: {getattr(defaults, f.name)})",
        )
    cluster = commands.add_parser(
        "cluster",
        help="run a local cluster: a NATS server and several nodes",
        description="Start nats-server and N nodes on consecutive ports on this machine; Ctrl-C stops them all.",
    )
    cluster.add_argument("--nodes", type=int, default=3, help="how many nodes (default: 3)")
    cluster.add_argument("--host", default="127.0.0.1", help="address for every node (default: 127.0.0.1)")
    cluster.add_argument("--port", type=int, default=8080, help="first node's port; 0 picks free ports (default: 8080)")
    cluster.add_argument("--nats-port", type=int, default=4222, help="NATS port; 0 picks a free one (default: 4222)")
    cluster.add_argument("--data-dir", default="skyring-data", help="each node keeps its data in <dir>/<node>")
    cluster.add_argument("--storage", choices=["sqlite", "memory"], default="sqlite", help="(default: sqlite)")
    cluster.add_argument("--cluster", default="local", help="cluster name (default: local)")
    return parser


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Settings from the environment, overridden by the flags given. Raises ``ValueError``."""
    return Settings.from_env(environ, **{f.name: getattr(args, f.name) for f in FIELDS})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "cluster":
        return _run_cluster(args)
    try:
        settings = settings_from_args(args, os.environ)
    except ValueError as exc:
        parser.exit(2, f"skyring: error: {exc}\n")
    logs.configure(settings.log_level)
    from .server import run

    return run(settings)


def _run_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from .localcluster import run_cluster

    if args.nodes < 1:
        raise SystemExit("skyring: error: --nodes must be at least 1")
    options = {name: getattr(args, name) for name in ("nodes", "host", "port", "nats_port", "data_dir", "storage")}
    return asyncio.run(run_cluster(cluster=args.cluster, **options))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
