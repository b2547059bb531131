"""What a worker tells the driver, as values: how its pass ended (:class:`PassOutcome`) and how it joined a group
(:class:`Joined`). They cross Ray as pickles; the driver maps each :class:`Ending` to the controller's events
without reading any message.

A worker's error is classified here, once (:func:`classify`): a hung step, a peer process lost (a collective
broken by a dead peer, ``runtime.distributed.is_peer_loss``), or an error of its own (the loop's, a bad
configuration): recovered from, recovered from, reported.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass, field
from typing import Any

from elastic import runtime
from elastic.runtime import distributed

__all__ = ["Ending", "ErrorInfo", "Joined", "PassOutcome", "classify", "error_info", "numbers"]

Commit = tuple[int, int, dict[str, Any]]  # step, batch, metrics as numbers


class Ending(enum.Enum):
    """How a worker's pass (or its joining of a group) ended."""

    FINISHED = "finished"  # the loop ran to its end (a join: the group formed, the state in place)
    REGROUP = "regroup"  # left at a step boundary for a new view (a regroup)
    STOPPED = "stopped"  # left at a step boundary because the job stops there (its final snapshot taken)
    PEER_LOST = "peer_lost"  # a peer process of the group was lost (or the driver aborted the pass for one)
    HUNG = "hung"  # a step did not finish within the step timeout
    ERROR = "error"  # an error of the worker's own: the job fails with it

    @property
    def failed(self) -> bool:
        """The pass broke (a peer lost, a hung step, an error)."""
        return self in (Ending.PEER_LOST, Ending.HUNG, Ending.ERROR)


@dataclass(frozen=True, kw_only=True)
class ErrorInfo:
    """An error in a worker, as text: its class name, message (bounded), traceback, and what it interrupted
    (``context``, e.g. a rendezvous)."""

    type_name: str
    message: str
    traceback: str = ""
    context: str = ""

    def __str__(self) -> str:
        text = f"{self.type_name}: {self.message}" if self.type_name else self.message
        return f"{self.context}: {text}" if self.context else text


def classify(err: BaseException) -> Ending:
    """The one classification of a worker's error: ``HUNG``, ``PEER_LOST`` or ``ERROR`` (never the others)."""
    if runtime.classify_failure(err) is runtime.FailureKind.HUNG:
        return Ending.HUNG
    return Ending.PEER_LOST if distributed.is_peer_loss(err) else Ending.ERROR


def error_info(err: BaseException, *, context: str = "", limit: int = 400) -> ErrorInfo:
    """``err`` as an :class:`ErrorInfo` (call while handling it: the traceback is the current one)."""
    return ErrorInfo(
        type_name=type(err).__name__,
        message=str(err)[:limit],
        traceback=traceback.format_exc()[-2000:],
        context=context,
    )


def numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics a step committed, as Python numbers (arrays already computed: commit waited for them)."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


@dataclass(frozen=True, kw_only=True)
class PassOutcome:
    """How slice ``slice``'s pass of group ``epoch`` ended (``ending``; ``error`` for a failed one, at
    ``failed_at``), its commits (all of them, in order), the next step, and its figures."""

    slice: int
    epoch: int
    pid: int
    ending: Ending
    error: ErrorInfo | None = None
    failed_at: float | None = None
    aborted: bool = False  # the driver aborted the pass (a member was lost)
    commits: tuple[Commit, ...] = ()
    next_step: int = 0
    compile_seconds: float = 0.0
    snapshots: dict[str, Any] = field(default_factory=dict)  # the worker's snapshot counters
    ledger: dict[str, Any] | None = None  # the ledger as runs, when the pass did not fail
    persisted: int | None = None  # ``STOPPED``: the step saved to the Orbax tier (None: the job has no such tier)
    first_commit_at: float | None = None
    first_step_compile_seconds: float | None = None
    first_step_phases: dict[str, float | None] | None = None

    def describe(self) -> str:
        """One line on why the pass failed (empty for one that did not)."""
        return "" if self.error is None else str(self.error)


@dataclass(frozen=True, kw_only=True)
class Joined:
    """Slice ``slice``'s worker joined group ``epoch`` (``ending`` ``FINISHED``: formed, the state in place) or
    could not (``PEER_LOST``: a peer died meanwhile; ``ERROR``: its own error, ``error`` says which)."""

    slice: int
    epoch: int
    pid: int
    node: str = ""
    ending: Ending = Ending.FINISHED
    error: ErrorInfo | None = None
    meta: dict[str, Any] | None = None
    reform_seconds: float = 0.0
    restore_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
