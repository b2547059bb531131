"""The driver's view of a multi-process group's workers: their handles, incarnations, processes and nodes, the
calls it makes to them all at once (:meth:`Members.collect`), ending one (:meth:`Members.kill`), and probing them
after a failure. A worker that dies or does not answer is a lost slice; one that answers with a failed
:class:`~elastic.placements.outcome.Joined` is mapped to the controller's errors here, by its ending."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray

from elastic import runtime
from elastic.control.cluster import ActorGroup
from elastic.errors import ElasticError
from elastic.log import get_logger
from elastic.placements.outcome import Ending, Joined

__all__ = ["PROBE_S", "Members", "restarted"]

PROBE_S = 10.0  # a worker that does not answer a ping within this is dead (a stopped process, a lost node)


class Members:
    """The current group's workers, and what the driver remembers of the slices' processes across groups."""

    def __init__(self, group: Callable[[], ActorGroup], *, job: str) -> None:
        self._group = group
        self._log = get_logger("elastic.placement", job=job)
        self.handles: dict[int, Any] = {}  # the current group's workers
        self.incarnations: dict[int, int] = {}  # and their agent incarnations
        self.died: set[int] = set()  # the members whose process died in the last collect
        self.gone: set[int] = set()  # slices whose process died or was ended since their last group (replaced)
        self.last_pid: dict[int, int] = {}  # slice -> the process it ran the last group in
        self.pids: dict[int, int] = {}
        self.nodes: dict[int, str] = {}  # slice -> the Ray node its worker of the current group runs on

    def collect(
        self,
        refs: dict[Any, int],
        *,
        timeout: float,
        what: str,
        on_death: Callable[[set[int]], None] | None = None,
    ) -> dict[int, Any]:
        """Every member's answer; a member that died or did not answer is a lost slice (a slice-loss error), and
        so is one whose join broke on a lost peer; one whose join failed on its own error is an ``ElasticError``.
        ``on_death(waiting)``: called once, as soon as a member's process died, with the members still answering
        (to release them from a wait on it)."""
        ready = _gather(refs, timeout, on_death)
        out: dict[int, Any] = {}
        missing = []
        self.died = set()
        for ref, s in refs.items():
            if ref not in ready:
                missing.append(s)
                continue
            try:
                out[s] = ray.get(ref)
            except ray.exceptions.RayActorError:
                missing.append(s)
                self.died.add(s)
        if missing:
            raise runtime.SliceLostError(
                f"slice(s) {sorted(missing)} did not answer while waiting for {what}", slices=tuple(sorted(missing))
            )
        for s, answer in out.items():
            if isinstance(answer, Joined) and answer.ending.failed:
                why = f"slice {s}'s worker failed while waiting for {what}: {answer.error}"
                if answer.ending is Ending.ERROR:
                    raise ElasticError(f"{why}\n{answer.error.traceback if answer.error else ''}")
                raise runtime.SliceLostError(why, slices=(s,))
        return out

    def ask(self, handles: dict[int, Any], call: Callable[[Any], Any], *, timeout: float, what: str) -> dict[int, Any]:
        """``call(handle)`` of every worker in ``handles``, collected (:meth:`collect`)."""
        return self.collect({call(h): s for s, h in handles.items()}, timeout=timeout, what=what)

    def kill(self, s: int) -> None:
        """End the process slice ``s`` ran the current group in (``ray.kill``; a stopped process on this node is
        SIGKILLed too). A newer worker of that slice, starting meanwhile, is left alone."""
        self.gone.add(s)
        handle = self.handles.get(s)
        if handle is not None:
            try:
                ray.kill(handle.handle, no_restart=True)  # a Credentialed handle's actor
            except Exception:  # noqa: BLE001 - already gone
                pass
        pid = self.pids.get(s)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def replace(self, s: int) -> None:
        """Start a new process for slice ``s``, whose worker of the current group died."""
        if s in self.incarnations:
            self._group().replace(s, self.incarnations[s])

    def collateral(self, lost: set[int]) -> set[int]:
        """The lost workers whose node lives on: not taken by their host's loss, they died with a peer's failure."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return {s for s in lost if self.nodes.get(s) in alive}

    def formed(self, handles: dict[int, Any], incarnations: dict[int, int | None], joined: dict[int, Joined]) -> None:
        """A new group formed of ``handles`` (its workers' ``joined`` answers): remember its processes."""
        self.handles = handles
        self.incarnations = {s: i for s, i in incarnations.items() if i is not None}
        for s, res in joined.items():
            self.last_pid[s] = self.pids[s] = res.pid
            self.nodes[s] = res.node
        self.gone -= set(joined)

    def probe(
        self, slices: frozenset[int], timeout_s: float | None, *, early: Callable[[frozenset[int]], None] | None = None
    ) -> frozenset[int]:
        """Which workers do not answer a ping within a few seconds (dead, stopped, or on a lost node). A worker
        replaced or gone from the group is known dead before any ping is awaited (``early``)."""
        group = self._group()
        bound = min(timeout_s or PROBE_S, PROBE_S)
        refs = {}
        dead = set()
        for s in slices:
            if s in self.incarnations and group.incarnation(s) != self.incarnations[s]:
                dead.add(s)  # the group's worker died and a replacement was started: not the same process
                continue
            try:
                refs[s] = group.agent(s).ping.remote()
            except KeyError:
                dead.add(s)
        if dead and early is not None:
            early(frozenset(dead))
        for s, ref in refs.items():
            try:
                ray.get(ref, timeout=bound)
            except Exception:  # noqa: BLE001 - no answer: that worker is gone
                dead.add(s)
        return frozenset(dead)

    def lost(self, slices: frozenset[int]) -> dict[int, int]:
        """The incarnations of the group's workers among ``slices``."""
        return {s: self.incarnations[s] for s in slices if s in self.incarnations}

    def replaced(self, slices: frozenset[int], lost: dict[int, int] | None) -> frozenset[int]:
        """Which of these lost slices already have a newer worker than the one lost (``lost``: as ``lost`` said)."""
        group = self._group()
        return frozenset(s for s in slices if lost and s in lost and (group.incarnation(s) or -1) > lost[s])


def _gather(refs: dict[Any, int], timeout: float, on_death: Callable[[set[int]], None] | None) -> set[Any]:
    """The refs that resolved within ``timeout``; ``on_death`` as :meth:`Members.collect` says."""
    if on_death is None:
        return set(ray.wait(list(refs), num_returns=len(refs), timeout=timeout)[0])
    deadline = time.monotonic() + timeout
    ready: set[Any] = set()
    pending = list(refs)
    told = False
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        ready.update(done)
        if not told and pending and any(_died(ref) for ref in done):
            told = True
            on_death({refs[ref] for ref in pending})
    return ready


def _died(ref: Any) -> bool:
    """Whether the member behind a resolved ``ref`` died (any other error is its answer, read by collect)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001, S110 - its answer
        pass
    return False


def restarted(pids: dict[int, int], previous: Iterable[int], last: dict[int, int], gone: set[int]) -> set[int]:
    """The members of a new group (slice -> process id, ``pids``) that were in the ``previous`` group in another
    process (``last``), though that process was neither lost nor ended (``gone``): a survivor restarted instead of
    re-formed in place. A lost worker's replacement is not one (its loss is counted where it was seen)."""
    return {s for s in previous if s in pids and s in last and s not in gone and pids[s] != last[s]}
