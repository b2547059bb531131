"""The controller as a state machine: named states, the events that move it, the actions it takes.

``transition(machine, event, max_transient_retries)`` is pure (no Ray, no clock, no jax): it answers
what state comes next and which action the controller's executors carry out. The failure path reads
as a sequence of states::

    STARTING --Started--> RESTORING --Ready--> RUNNING --LoopReturned--> FINISHED
    RUNNING --Stopped(the job was asked to stop: its state saved at a step boundary)--> FINISHED
    RUNNING --Resumed(suspended at a step boundary, its state on its keepers; slices back)--> RESTORING
    RUNNING --Boundary(bigger view)--> GROWING --Ready--> RUNNING
    RUNNING --Boundary(smaller view)--> RESHARDING --Ready--> RUNNING
    RUNNING --Boundary(a view leaving slices on notice)--> LEAVING --Ready--> RUNNING
    RUNNING --Boundary(the same, past the notice's deadline)--> RESTORING (from the boundary's snapshot)
    RUNNING|RESTORING|RESHARDING|GROWING|LEAVING --Failed(slice-loss error or hung step)--> FAILED
    FAILED --Noted(supervisor already dropped a slice)--> RESTORING
    FAILED --Noted--> PROBING --Probed(dead)--> AWAITING_VIEW --ViewSeen--> RESTORING
    PROBING --Probed(none dead, retries left)--> RESTORING (same view; past the retries: GAVE_UP)
    any view that gave up --> GAVE_UP
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from elastic.supervision.membership import View

__all__ = [
    "Abort",
    "Action",
    "AwaitView",
    "Boundary",
    "Event",
    "Failed",
    "Finish",
    "GiveUp",
    "LoopReturned",
    "Machine",
    "NoteFailure",
    "Noted",
    "Prepare",
    "Probe",
    "Probed",
    "Ready",
    "Resumed",
    "RunPass",
    "Started",
    "State",
    "Stopped",
    "ViewSeen",
    "transition",
]


class State(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    PROBING = "probing"
    AWAITING_VIEW = "awaiting_view"
    RESTORING = "restoring"
    RESHARDING = "resharding"
    LEAVING = "leaving"  # moving the live state off slices that will go (a notice), onto the rest
    GROWING = "growing"
    FINISHED = "finished"
    GAVE_UP = "gave_up"


@dataclass(frozen=True)
class Machine:
    state: State = State.STARTING
    view: View = field(default_factory=View)  # the view the job runs on (or is moving to)


# -- events -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    view: View


@dataclass(frozen=True)
class Ready:
    """The state is in place on the machine's view (restored, initialised or resharded)."""


@dataclass(frozen=True)
class LoopReturned:
    complete: bool  # the last step was committed
    last_committed: int | None = None
    last_step: int = 0


@dataclass(frozen=True)
class Boundary:
    """At a step boundary the supervisor's view differs from the one the pass runs on. ``late``: the view leaves
    slices on notice and a deadline of its notices passed before the boundary (the slices count as gone)."""

    view: View
    late: bool = False


@dataclass(frozen=True)
class Stopped:
    """The job was asked to stop (``ElasticJob.stop``) and its pass ended at the step boundary before ``step``."""

    step: int


@dataclass(frozen=True)
class Resumed:
    """The job was suspended at a step boundary (its state on its keepers, its slices released) and resumes on
    ``view``, over the slices lent back."""

    view: View


@dataclass(frozen=True)
class Failed:
    cause: str  # a slice-loss error or a hung step, classified by runtime.classify_failure


@dataclass(frozen=True)
class Noted:
    latest: View  # the newest view the client holds


@dataclass(frozen=True)
class Probed:
    dead: frozenset[int]
    attempt: int
    cause: str = ""  # the failure that led to the probe (named in the error past the retries)
    hung: bool = False  # that failure was a hung step (the step watchdog), not a slice-loss error


@dataclass(frozen=True)
class ViewSeen:
    view: View


Event = Started | Ready | LoopReturned | Stopped | Resumed | Boundary | Failed | Noted | Probed | ViewSeen


# -- actions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prepare:
    view: View
    live: bool  # move the live state device to device (True) or restore the newest snapshot (False)


@dataclass(frozen=True)
class RunPass:
    pass


@dataclass(frozen=True)
class NoteFailure:
    cause: str


@dataclass(frozen=True)
class Probe:
    slices: frozenset[int]


@dataclass(frozen=True)
class AwaitView:
    dead: frozenset[int]
    after_epoch: int


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class GiveUp:
    reason: str
    epoch: int


@dataclass(frozen=True)
class Abort:
    """End the job with an error that says what went wrong (``kind``: "early_return" or "persistent")."""

    kind: str
    message: str


Action = Prepare | RunPass | NoteFailure | Probe | AwaitView | Finish | GiveUp | Abort

_ACTIVE = (State.RUNNING, State.RESTORING, State.RESHARDING, State.GROWING, State.LEAVING)


def _bad(machine: Machine, event: object) -> ValueError:
    return ValueError(f"no transition from {machine.state.value} on {type(event).__name__}")


def transition(machine: Machine, event: Event, max_transient_retries: int) -> tuple[Machine, Action]:
    """The next machine and the action that takes it there. ``ValueError`` for an impossible pair."""
    s = machine.state
    if isinstance(event, (Started, Boundary, ViewSeen, Resumed)) and event.view.gave_up is not None:
        if isinstance(event, Started) and s is not State.STARTING:
            raise _bad(machine, event)
        return replace(machine, state=State.GAVE_UP, view=event.view), GiveUp(event.view.gave_up, event.view.epoch)
    if isinstance(event, Started):
        if s is not State.STARTING:
            raise _bad(machine, event)
        return Machine(State.RESTORING, event.view), Prepare(event.view, live=False)
    if isinstance(event, Ready):
        if s not in (State.RESTORING, State.RESHARDING, State.GROWING, State.LEAVING):
            raise _bad(machine, event)
        return replace(machine, state=State.RUNNING), RunPass()
    if isinstance(event, LoopReturned):
        if s is not State.RUNNING:
            raise _bad(machine, event)
        if event.complete:
            return replace(machine, state=State.FINISHED), Finish()
        last = "none" if event.last_committed is None else str(event.last_committed)
        return replace(machine, state=State.FINISHED), Abort(
            "early_return",
            f"the loop returned before committing step {event.last_step} (last committed: "
            f"{last}): iterate run.steps to the end",
        )
    if isinstance(event, Stopped):
        if s is not State.RUNNING:
            raise _bad(machine, event)
        return replace(machine, state=State.FINISHED), Finish()
    if isinstance(event, Resumed):
        if s is not State.RUNNING:
            raise _bad(machine, event)
        return Machine(State.RESTORING, event.view), Prepare(event.view, live=False)
    if isinstance(event, Boundary):
        if s is not State.RUNNING:
            raise _bad(machine, event)
        if event.view.leaving & machine.view.active:  # slices on notice: their state moves off them, live
            if event.late:  # never waits past the deadline: the failure path's restore (the boundary's snapshot)
                return Machine(State.RESTORING, event.view), Prepare(event.view, live=False)
            return Machine(State.LEAVING, event.view), Prepare(event.view, live=True)
        grew = len(event.view.active) > len(machine.view.active)
        return (Machine(State.GROWING if grew else State.RESHARDING, event.view), Prepare(event.view, live=True))
    if isinstance(event, Failed):
        if s not in _ACTIVE:
            raise _bad(machine, event)
        return replace(machine, state=State.FAILED), NoteFailure(event.cause)
    if isinstance(event, Noted):
        if s is not State.FAILED:
            raise _bad(machine, event)
        latest = event.latest
        if latest.gave_up is not None:
            return replace(machine, state=State.GAVE_UP, view=latest), GiveUp(latest.gave_up, latest.epoch)
        if latest.epoch > machine.view.epoch and latest.active < machine.view.active:
            # The supervisor already dropped the lost slice(s): act on its view, no probe, no round trip.
            return Machine(State.RESTORING, latest), Prepare(latest, live=False)
        return replace(machine, state=State.PROBING), Probe(machine.view.active)
    if isinstance(event, Probed):
        if s is not State.PROBING:
            raise _bad(machine, event)
        if event.dead:
            return replace(machine, state=State.AWAITING_VIEW), AwaitView(event.dead, machine.view.epoch)
        if event.attempt > max_transient_retries:
            what = "hung steps" if event.hung else "slice-loss errors"
            last = f"; the last: {event.cause}" if event.cause else ""
            return replace(machine, state=State.GAVE_UP), Abort(
                "persistent", f"{what} persist with every slice healthy after {event.attempt - 1} retries{last}"
            )
        return replace(machine, state=State.RESTORING), Prepare(machine.view, live=False)
    if isinstance(event, ViewSeen):
        if s is not State.AWAITING_VIEW:
            raise _bad(machine, event)
        return Machine(State.RESTORING, event.view), Prepare(event.view, live=False)
    raise _bad(machine, event)
