"""structlog configuration: JSON lines (console on a TTY), contextvars for batch/episode ids, the current trace id;
the stdlib loggers of the libraries we run (uvicorn, vLLM, nats-py, httpx, ...) rendered by the same processors into
the same stream."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from rollout_ledger.shared.kit.tracing import add_trace_ids

_STDLIB_FLOOR = logging.WARNING
"""Library loggers speak from this level up (or the service's level, when higher): their INFO lines are noise."""


class _Stderr:
    """``sys.stderr`` as it is at each write, not as it was when logging was configured: a command run in-process
    (a test's CLI runner) swaps it for a buffer it closes afterwards, and a logger holding that buffer would fail
    every later write."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(level: str = "INFO", fmt: str = "auto", service: str = "") -> None:
    """Configure structlog and stdlib logging once per process."""
    renderer: Any
    if fmt == "console" or (fmt == "auto" and sys.stderr.isatty()):
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,  # trace_id/span_id of the current span (shared/kit/tracing.py); nothing outside one
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    # Library (stdlib) records: the same processors and renderer, with the logger's name. vLLM installs its own
    # plain-text handler unless told not to (read when vllm is imported, after this).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric, _STDLIB_FLOOR))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "vllm"):
        lib = logging.getLogger(name)  # drop handlers a library installed itself; its records reach ours
        for old in list(lib.handlers):
            lib.removeHandler(old)
        lib.propagate = True
    if service:
        structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str = "") -> Any:
    return structlog.get_logger(name)
