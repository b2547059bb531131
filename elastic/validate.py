"""Checks shared by the configuration dataclasses: each raises ``ConfigError`` saying what to fix."""

from __future__ import annotations

import math

from elastic.errors import ConfigError

__all__ = ["count", "instance", "positive"]


def count(name: str, value: object, minimum: int = 1, *, maximum: int | None = None, what: str = "") -> None:
    """``ConfigError`` unless ``value`` is an ``int`` (not a bool or a float) in ``minimum..maximum - 1``;
    ``what`` words the range in the message."""
    what = what or f"an integer of at least {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int ({what}), got {value!r} of type {type(value).__name__}")
    if value < minimum or (maximum is not None and value >= maximum):
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def positive(name: str, value: object) -> None:
    """``ConfigError`` unless ``value`` is a finite, positive number of seconds (an int or a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r} of type {type(value).__name__}")
    if not 0 < value < math.inf:  # also false for nan
        raise ConfigError(f"{name} must be positive and finite (seconds), got {value!r}")


def instance(name: str, value: object, kind: type) -> None:
    """``ConfigError`` unless ``value`` is a ``kind``."""
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be a {kind.__name__}, got {value!r} of type {type(value).__name__}")
