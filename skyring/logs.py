"""Logging setup for the command line. The rest of skyring only logs; it never configures."""

from __future__ import annotations

import logging.config

__all__ = ["configure"]


def configure(level: str) -> None:
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
            "handlers": {
                "stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
            },
            "loggers": {
                "skyring": {"level": level.upper()},
                "aiohttp": {"level": "WARNING"},
            },
            "root": {"handlers": ["stderr"], "level": "WARNING"},
        }
    )
