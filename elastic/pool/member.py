"""One job's side of a pool: its lease, kept in the job's own slice numbers, and the notices that come with it.

A job numbers its slices ``0..max_slices-1``; the pool numbers its own. :class:`PoolMember` keeps the map: a pool
slice lent to the job takes the job's lowest free number and keeps it while lent. ``join`` submits the job and waits
(bounded) until the pool lends it its minimum; ``watch`` starts a thread that long-polls the lease and tells the job,
through its :class:`LeaseHooks`, which of its slices the pool reclaims (a notice: leave them at a step boundary)
and which it was lent. The job says when it has left reclaimed slices (``left``), and they go back to the pool, and
when slices it held failed (``failed``: the pool replaces them, up to the job's spares); ``close`` gives every slice
back. A pool that is restarting (its actor replaying its log) is asked again, bounded:
the job keeps what it holds meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from elastic.errors import AccessError, ConfigError, PoolError
from elastic.log import get_logger
from elastic.pool.client import PoolHandle
from elastic.pool.model import JobSpec

__all__ = ["LeaseHooks", "PoolMember"]

POLL_S = 10.0  # one long poll of the lease
RETRY_S = 0.5  # between asks of a pool that did not answer


class LeaseHooks(Protocol):
    """What a job does when its lease changes (called on the member's thread, in the job's slice numbers)."""

    def reclaim(self, slices: frozenset[int], reason: str) -> None:
        """The pool takes these slices back: leave them at a step boundary, then call ``PoolMember.left``."""

    def granted(self, slices: frozenset[int]) -> None:
        """The pool lent these slices to the job: it may grow onto them."""


class PoolMember:
    """Job ``spec`` in pool ``pool`` (a handle carrying the job's user's credential)."""

    def __init__(self, pool: PoolHandle, spec: JobSpec, hooks: LeaseHooks | None = None) -> None:
        self._pool, self.spec, self._hooks = pool, spec, hooks
        self._slots: dict[int, int] = {}  # pool slice -> the job's number for it
        self._told: set[int] = set()  # pool slices whose reclaim the job was told of
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.version = -1
        self.lease: dict[str, Any] = {}
        self._log = get_logger("elastic.pool.member", job=spec.name, pool_user=spec.user)

    @property
    def slices(self) -> frozenset[int]:
        """The job's numbers of the slices it holds now."""
        with self._lock:
            return frozenset(self._slots.values())

    def join(self, timeout_s: float) -> frozenset[int]:
        """Submit the job and wait until it holds its minimum; the job's numbers of its slices. ``PoolError`` past
        ``timeout_s`` (the pool's reason for the wait in it; the job leaves the pool), or when it refuses the job."""
        try:
            lease = self._pool.call("submit", self.spec)
        except (ConfigError, AccessError) as err:
            raise PoolError(f"pool refused job {self.spec.name!r}: {err}") from err
        deadline = time.monotonic() + timeout_s
        while lease["state"] != "running" or len(lease["slices"]) < self.spec.min_slices:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise PoolError(
                    f"job {self.spec.name!r} waited {timeout_s:g} s for {self.spec.min_slices} slice(s) of the pool: "
                    f"{lease['state']}, {lease['reason']}"
                )
            lease = self._pool.call(
                "wait_lease", self.spec.name, lease["version"], min(left, POLL_S), timeout_s=left + 30
            )
        self._take(lease, tell=False)  # the slices it starts on
        return self.slices

    def watch(self) -> None:
        """Follow the lease on a thread of its own until ``close``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name=f"pool-lease-{self.spec.name}", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        import ray

        while not self._stop.is_set():
            if not ray.is_initialized():  # this process left Ray: a call now would start a local Ray of its own
                self._log.info("pool_lease_ended", reason="this process is no longer connected to Ray")
                return
            try:
                lease = self._pool.call("wait_lease", self.spec.name, self.version, POLL_S, timeout_s=POLL_S + 30)
            except (ConfigError, AccessError) as err:  # the job is out of the pool (it left, or was removed)
                self._log.info("pool_lease_ended", reason=str(err).splitlines()[0][:200])
                return
            except Exception as err:  # noqa: BLE001 - a pool restarting (or gone): the job keeps what it holds
                self._log.warning("pool_unanswered", error=str(err).splitlines()[0][:200] if str(err) else repr(err))
                self._stop.wait(RETRY_S)
                continue
            self._take(lease)

    def _take(self, lease: dict[str, Any], *, tell: bool = True) -> None:
        """Fold a lease into the map; tell the hooks what is new (``tell``)."""
        with self._lock:
            if lease["version"] < self.version:
                return
            self.version, self.lease = lease["version"], lease
            held = set(lease["slices"])
            for s in [s for s in self._slots if s not in held]:  # released, or failed
                del self._slots[s]
                self._told.discard(s)
            fresh = sorted(held - set(self._slots))
            free = iter(sorted(set(range(self.spec.max_slices)) - set(self._slots.values())))
            for s in fresh:
                self._slots[s] = next(free)
            granted = frozenset(self._slots[s] for s in fresh)
            leaving = [s for s in lease["leave"] if s not in self._told]
            self._told.update(leaving)
            notice = frozenset(self._slots[s] for s in leaving)
            why = "; ".join(sorted({lease["why"].get(s, "the pool takes it back") for s in leaving}))
        if self._hooks is None or not tell:
            return
        try:
            if granted:
                self._hooks.granted(granted)
            if notice:
                self._hooks.reclaim(notice, why)
        except Exception as err:  # noqa: BLE001 - the job's hook failed: logged; the lease is still followed
            self._log.error("lease_hook_failed", granted=sorted(granted), reclaimed=sorted(notice), error=repr(err))

    def left(self, slices: Iterable[int]) -> None:
        """The job left these slices (its numbers): they go back to the pool."""
        mine = set(slices)
        with self._lock:
            pool_slices = sorted(s for s, n in self._slots.items() if n in mine)
        if pool_slices:
            self._take(self._pool.call("release", self.spec.name, pool_slices))

    def lease_now(self) -> dict[str, Any]:
        """The job's lease as the pool has it now (its ``seconds_below_asked`` included)."""
        lease: dict[str, Any] = self._pool.call("lease", self.spec.name)
        return lease

    def failed(self, slices: Iterable[int]) -> None:
        """These slices of the job (its numbers) failed while it held them: the pool stops lending them until they
        return (``elastic pool mark --returned``), and replaces them from lower-priority jobs up to the job's
        ``spares`` (a hot swap)."""
        mine = set(slices)
        with self._lock:
            pool_slices = sorted(s for s, n in self._slots.items() if n in mine)
        for s in pool_slices:
            self._pool.call("slice_failed", s)
        if pool_slices:
            self._log.warning("pool_slices_failed", slices=pool_slices)

    def close(self) -> None:
        """Stop following and give every slice back (a pool that does not answer is logged, not raised)."""
        self._stop.set()
        try:
            self._pool.call("leave", self.spec.name, timeout_s=30.0)
        except Exception as err:  # noqa: BLE001 - the job's end stands; the pool's operator sees the lease
            self._log.warning("pool_leave_failed", error=str(err).splitlines()[0][:200] if str(err) else repr(err))
        with self._lock:
            self._slots.clear()
        if self._thread is not None:  # its long poll answers at once: the job is out of the pool
            self._thread.join(timeout=POLL_S + 35)
            self._thread = None
