"""Structured events: structlog to stderr, with job/slice/epoch/step bound by the callers."""
from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "get_logger"]


def configure_logging(level: int = logging.INFO) -> None:
    """Send structured events at ``level`` and above to stderr (stdout stays free for results)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "elastic", **bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name).bind(**bound)
