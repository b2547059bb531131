"""What the supervisor knows of each slice's agent: a plain registry, no Ray, no asyncio, the clock passed in.

A slice's agent is an *incarnation* (0, 1, ...: each new agent of the slice, a higher one). The registry holds, per
slice: the agent registered now (judged by its heartbeats) and when it last beat, the newest incarnation seen (older
ones are refused), the handle it registered with, and per ``(slice, incarnation)`` whether it is refused for good
(its agent died, or the client saw the slice fail), watched (its lifeline), being asked whether it lives (a
silence), expected (a replacement started), or leaving on a notice. The supervisor reads and changes it only
through these methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from elastic.errors import SupervisorError
from elastic.supervision.notices import Notice

__all__ = ["AgentRegistry", "AGENT_DIED", "CLIENT_REPORT", "Pair"]

AGENT_DIED = "agent died"  # the cause of a refusal whose agent died (a respawnable slice)
CLIENT_REPORT = "client report: "  # how the cause of a health event from the client's report_lost begins

Pair = tuple[int, int]  # (slice, incarnation): one agent of one slice


class AgentRegistry:
    """The agents of one job's slices, as the supervisor knows them (empty: nothing known yet)."""

    def __init__(self) -> None:
        self._registered: dict[int, int | None] = {}  # the agent judged by heartbeats (None: unknown, after replay)
        self._beats: dict[int, float] = {}  # when each registered slice last beat (monotonic)
        self._newest: dict[int, int] = {}  # the newest incarnation seen per slice: older ones are refused
        self._handles: dict[int, Any] = {}  # the handle each slice's agent registered with (to ask a silent one)
        self._revoked: set[Pair] = set()  # dead or failed: never healthy again
        self._died: set[Pair] = set()  # whose agent died (its lifeline failed)
        self._client_lost: set[Pair] = set()  # whose slice the client saw fail
        self._watched: set[Pair] = set()  # whose agent's lifeline is watched
        self._asking: set[int] = set()  # silent slices whose agent is being asked whether it lives
        self._published: dict[int, int] = {}  # the agent of each active slice when the view was published
        self._coming: dict[int, tuple[int, float]] = {}  # slice -> (incarnation, deadline) of a replacement started
        self._leaving: dict[int, tuple[int | None, Notice]] = {}  # slice -> (its agent, the notice) while leaving
        self.late_beats = 0  # silences past the timeout whose agent answered: slow, not dead (not dropped)
        self.silent_drops = 0  # slices dropped for their silence (no beat, no answer)
        self.notices = 0  # notices taken

    # -- registration and heartbeats -----------------------------------------------------------------------------
    def admits(self, slice_index: int, incarnation: int) -> bool:
        """Not refused, and not older than the slice's newest agent."""
        return (slice_index, incarnation) not in self._revoked and incarnation >= self._newest.get(
            slice_index, incarnation
        )

    def register(self, slice_index: int, incarnation: int, handle: Any, now: float) -> None:
        """The agent holds the slice from ``now`` (an admitted one): it is the newest, no longer expected, and a
        slice leaving under an older agent is back (it went and came back)."""
        s = slice_index
        if self._coming.get(s, (incarnation + 1,))[0] <= incarnation:
            del self._coming[s]  # the replacement (or a newer agent) is here
        self._newest[s] = incarnation
        self._registered[s] = incarnation
        self._handles[s] = handle
        left = self._leaving.get(s, (None, None))[0]
        if left is not None and left < incarnation:
            del self._leaving[s]
        self._beats[s] = now

    def watch(self, pairs: Iterable[Pair]) -> list[Pair]:
        """The pairs whose lifeline is not watched yet, watched from now (an agent back from a lapse is already)."""
        fresh = [pair for pair in pairs if pair not in self._watched]
        self._watched.update(fresh)
        return fresh

    def unwatch(self, pairs: Iterable[Pair]) -> None:
        self._watched.difference_update(pairs)

    def beat(self, slice_index: int, incarnation: int, now: float) -> bool:
        """Whether this agent is the slice's registered one (then its beat counts); False: it must register."""
        if self._registered.get(slice_index) != incarnation:
            return False
        self._beats[slice_index] = now
        return True

    def holds(self, slice_index: int) -> bool:
        """Whether an agent is registered for the slice (its incarnation may be unknown after a replay)."""
        return slice_index in self._registered

    def agent(self, slice_index: int) -> int | None:
        """The registered agent's incarnation (None: none, or unknown after a replay)."""
        return self._registered.get(slice_index)

    def current(self, slice_index: int) -> int | None:
        """The registered agent's incarnation if one is registered, else the newest seen."""
        if slice_index in self._registered:
            return self._registered[slice_index]
        return self._newest.get(slice_index)

    def newest(self, slice_index: int) -> int | None:
        return self._newest.get(slice_index)

    def handle(self, slice_index: int) -> Any:
        """The handle the slice's agent registered with (None: none registered with this supervisor)."""
        return self._handles.get(slice_index)

    def target(self, slice_index: int, active: AbstractSet[int]) -> tuple[int, Any]:
        """The slice's live agent, its incarnation and handle, for an operator's fault (``SupervisorError`` if it has
        none, or none that registered with this supervisor: a handle is never found by its name)."""
        incarnation = self._newest.get(slice_index)
        if incarnation is None or (slice_index, incarnation) in self._revoked:
            raise SupervisorError(f"inject: slice {slice_index} has no live agent (active: {sorted(active)})")
        handle = self._handles.get(slice_index)
        if handle is None:
            name = f"agent-{slice_index}-{incarnation}"
            raise SupervisorError(f"inject: slice {slice_index}'s agent {name} is not registered here")
        return incarnation, handle

    def handles(self) -> dict[int, Any]:
        return dict(self._handles)

    def drop(self, slice_index: int) -> None:
        """The slice has no registered agent any more (an agent that beats again must register)."""
        self._registered.pop(slice_index, None)

    def lapsed(self, slice_index: int) -> None:
        """The slice is dropped for its silence (counted): its agent must register again if it beats."""
        self.silent_drops += 1
        self._registered.pop(slice_index, None)

    def count(self) -> int:
        """Slices with a registered agent."""
        return len(self._registered)

    # -- refusals ------------------------------------------------------------------------------------------------
    def refuse(self, slice_index: int, incarnation: int) -> bool:
        """This agent never counts as healthy again; whether it was not refused before."""
        pair = (slice_index, incarnation)
        if pair in self._revoked:
            return False
        self._revoked.add(pair)
        return True

    def refused(self, slice_index: int, incarnation: int) -> bool:
        return (slice_index, incarnation) in self._revoked

    @property
    def refusals(self) -> int:
        """Agents refused for good."""
        return len(self._revoked)

    def died(self, slice_index: int, incarnation: int) -> None:
        """This agent died (a new one may bring the slice back: see :meth:`respawnable`)."""
        self._died.add((slice_index, incarnation))

    def client_lost(self, slice_index: int, incarnation: int) -> None:
        """The client saw the slice fail under this agent: its hardware is suspect."""
        self._client_lost.add((slice_index, incarnation))

    def saw(self, slice_index: int, incarnation: int) -> None:
        """A record names this agent: the slice's newest is at least it."""
        self._newest[slice_index] = max(self._newest.get(slice_index, incarnation), incarnation)

    # -- silence -------------------------------------------------------------------------------------------------
    def overdue(self, now: float, timeout_s: float) -> list[tuple[int, int | None]]:
        """Registered slices silent past ``timeout_s`` and not being asked yet: from now they are (``asked`` ends
        it); each with its agent."""
        due = []
        for s, seen in self._beats.items():
            if s in self._registered and now - seen > timeout_s and s not in self._asking:
                self._asking.add(s)
                due.append((s, self._registered[s]))
        return due

    def asked(self, slice_index: int) -> None:
        self._asking.discard(slice_index)

    def last_beat(self, slice_index: int, default: float) -> float:
        return self._beats.get(slice_index, default)

    def late(self, slice_index: int, now: float) -> None:
        """The silent agent answered: it lives, its beats are late (counted), its silence starts again."""
        self._beats[slice_index] = now
        self.late_beats += 1

    def stalled(self, seconds: float) -> None:
        """The supervisor itself did not run for ``seconds``: nobody's silence grew meanwhile."""
        for s in self._beats:
            self._beats[s] += seconds

    # -- replacements --------------------------------------------------------------------------------------------
    def expect(self, slice_index: int, incarnation: int, until: float) -> None:
        """A replacement agent was started and may register until ``until`` (unless older than the newest)."""
        if incarnation >= self._newest.get(slice_index, incarnation):
            self._coming[slice_index] = (incarnation, until)

    def arriving(self, now: float) -> frozenset[int]:
        """Slices whose started replacement may still register in time (late or refused ones are forgotten)."""
        for s, (incarnation, until) in list(self._coming.items()):
            if until <= now or (s, incarnation) in self._revoked:
                del self._coming[s]
        return frozenset(self._coming)

    def renewed(self, active: AbstractSet[int]) -> frozenset[int]:
        """Active slices whose registered agent is not the one they had when the view was published (a lost member
        replaced before the view could drop it; after a restart, against the agents the log names). A slice whose
        published agent is unknown adopts its registered one silently."""
        renewed = set()
        for s in active:
            now = self._registered.get(s)
            if now is None:
                continue
            if self._published.setdefault(s, now) != now:
                renewed.add(s)
        return frozenset(renewed)

    def published(self, active: AbstractSet[int]) -> None:
        """A view over ``active`` was published: its slices' agents are those registered now."""
        self._published = {s: inc for s in active if (inc := self._registered.get(s)) is not None}

    def respawnable(self, quarantined: AbstractSet[int], wall: float) -> dict[int, int]:
        """Slices whose newest agent died, each with that incarnation: no agent holds the slice now, it is neither
        ``quarantined`` nor seen failing by the client, nor leaving on a notice whose deadline is after ``wall``."""
        return {
            s: incarnation
            for s, incarnation in self._newest.items()
            if (s, incarnation) in self._died
            and (s, incarnation) not in self._client_lost
            and s not in self._registered
            and s not in quarantined
            and not (s in self._leaving and self._leaving[s][1].deadline > wall)
        }

    # -- notices -------------------------------------------------------------------------------------------------
    def leave(self, agents: Mapping[int, int | None], notice: Notice) -> None:
        """``notice`` takes these slices (each with its agent then): they are leaving; one notice more taken."""
        self._leaving.update({s: (incarnation, notice) for s, incarnation in agents.items()})
        self.notices += 1

    @property
    def leaving(self) -> frozenset[int]:
        return frozenset(self._leaving)

    def notice_of(self, slice_index: int) -> Notice:
        """The notice a leaving slice goes on."""
        return self._leaving[slice_index][1]

    # -- after a replay ------------------------------------------------------------------------------------------
    def resume(self, healthy: Iterable[int], active: AbstractSet[int], now: float) -> None:
        """State rebuilt from the log: a slice leaving under an agent older than its newest went and came back;
        ``healthy`` slices count as registered (agent unknown) and beating from ``now`` until their agents fail to
        register again; each ``active`` slice's published agent is the newest the log names."""
        for s, (incarnation, _) in list(self._leaving.items()):
            if incarnation is not None and self._newest.get(s, incarnation) > incarnation:
                del self._leaving[s]
        for s in healthy:
            self._beats[s] = now
            self._registered[s] = None
        self._published = {s: self._newest[s] for s in active if s in self._newest}
