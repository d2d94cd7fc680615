"""structlog configuration: JSON lines (console on a TTY), contextvars for batch/episode ids."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(level: str = "INFO", fmt: str = "auto", service: str = "") -> None:
    """Configure structlog and stdlib logging once per process."""
    renderer: Any
    if fmt == "console" or (fmt == "auto" and sys.stderr.isatty()):
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(name)s %(message)s")
    if service:
        structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str = "") -> Any:
    return structlog.get_logger(name)
