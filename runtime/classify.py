"""Failure classification: the one place that decides whether an error means a slice is gone (or a step
hung), so that the controller recovers from it, or is a bug or bad input that ends the job."""

from __future__ import annotations

import enum
import re

import jax

from .faults import DeviceUnavailableError
from .guard import StepHungError

__all__ = ["FailureKind", "SliceLostError", "classify_failure", "is_recoverable", "is_slice_loss"]


class SliceLostError(RuntimeError):
    """Slices are gone, as the runtime itself observed (a worker process died, a group did not form, a pass ended
    with a peer lost): no error of jax's to parse, the loss is the fact. ``slices``: those known lost."""

    def __init__(self, message: str, slices: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.slices = slices


class FailureKind(enum.Enum):
    """What a failure means for the job: lose a slice, a hung step, or neither (re-raise)."""

    SLICE_LOSS = "slice_loss"  # devices are gone: recover on the survivors
    HUNG = "hung"  # a step made no progress within its bound: probe, then recover as from a slice loss
    OTHER = "other"  # a bug or bad input: surface it


# Status codes with which XLA runtimes report lost devices, lost hosts or broken collectives.
_SLICE_LOSS_CODES = ("DATA_LOSS", "UNAVAILABLE", "ABORTED")
# INTERNAL errors that mean hardware or a peer went away rather than a bug in the program.
_SLICE_LOSS_INTERNAL = re.compile(
    r"(halted|heartbeat|failed to connect|connection reset|socket closed|device or resource busy"
    r"|slice .* (down|lost|unhealthy)|barrier timed out)",
    re.IGNORECASE,
)
_CODE = re.compile(r"^\s*(?:[A-Za-z_.]+Error:\s*)?([A-Z_]+):")


def _status_code(message: str) -> str | None:
    match = _CODE.match(message)
    return match.group(1) if match else None


def classify_failure(err: BaseException) -> FailureKind:
    """Classify ``err`` (or any error in its ``__cause__``/``__context__`` chain). A simulated or injected
    :class:`~runtime.faults.DeviceUnavailableError` is read exactly as a real ``JaxRuntimeError``: by its status."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StepHungError):
            return FailureKind.HUNG
        if isinstance(current, SliceLostError):
            return FailureKind.SLICE_LOSS
        if isinstance(current, (jax.errors.JaxRuntimeError, DeviceUnavailableError)):  # real, or simulated
            message = str(current)
            code = _status_code(message)
            if code in _SLICE_LOSS_CODES:
                return FailureKind.SLICE_LOSS
            if code == "INTERNAL" and _SLICE_LOSS_INTERNAL.search(message):
                return FailureKind.SLICE_LOSS
        current = current.__cause__ or current.__context__
    return FailureKind.OTHER


def is_slice_loss(err: BaseException) -> bool:
    """``err`` means devices are gone (``classify_failure`` says ``SLICE_LOSS``)."""
    return classify_failure(err) is FailureKind.SLICE_LOSS


def is_recoverable(err: BaseException) -> bool:
    """A slice loss or a hung step: the controller probes the slices and recovers."""
    return classify_failure(err) is not FailureKind.OTHER
