"""The errors a simulated device failure raises: the runtime's own, not jax's.

A real lost device surfaces as ``jax.errors.JaxRuntimeError`` with an ``UNAVAILABLE`` status; a simulated slice
(:mod:`runtime.simulated`) or an injected fault raises :class:`DeviceUnavailableError` with the same message
(``"UNAVAILABLE: ..."``), and :func:`runtime.classify.classify_failure` classifies both alike.
"""

from __future__ import annotations

__all__ = ["DeviceUnavailableError", "TransientUnavailableError"]


class DeviceUnavailableError(RuntimeError):
    """Devices are unreachable, as a lost slice's are; the message carries the status (``"UNAVAILABLE: ..."``)."""


class TransientUnavailableError(DeviceUnavailableError):
    """A slice-loss error raised although every slice is healthy (an injected transient failure)."""
