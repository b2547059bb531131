"""Structured events: structlog to stderr, with job/slice/epoch/step bound by the callers."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "get_logger"]


class _Stderr:
    """Whatever ``sys.stderr`` is when an event is written (a test runner swaps it, and closes the old one: a logger
    that kept the stream it was built with would then fail in every thread that logs)."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except ValueError:  # closed: an event of a thread outliving its test run is dropped, never raised
            return 0

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except ValueError:
            pass


def configure_logging(level: int = logging.INFO) -> None:
    """Send structured events at ``level`` and above to stderr (stdout stays free for results)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "elastic", **bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name).bind(**bound)
