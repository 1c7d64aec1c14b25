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
        serve.add_argument(
            flag,
            dest=f.name,
            metavar="{" + ",".join(choices) + "}" if choices else field_type(f).__name__.upper(),
            default=None,
            help=f"{f.metadata['help']} [{ENV_PREFIX}{f.name.upper()}] (default: {getattr(defaults, f.name)})",
        )
    return parser


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Settings from the environment, overridden by the flags given. Raises ``ValueError``."""
    return Settings.from_env(environ, **{f.name: getattr(args, f.name) for f in FIELDS})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args, os.environ)
    except ValueError as exc:
        parser.exit(2, f"skyring: error: {exc}\n")
    logs.configure(settings.log_level)
    from .server import run

    return run(settings)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
