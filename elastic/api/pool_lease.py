"""A job whose slices come from a pool (``ElasticConfig(pool=...)``, both modes): the glue between its
:class:`~elastic.pool.member.PoolMember` and the job.

At start the job joins the pool (bounded by ``startup_timeout_s``; a wait past it is a
:class:`~elastic.errors.PoolError` that says why), so that its first pass runs on the lent slices only: in
multi-process mode only their workers are started (:attr:`PoolLease.launch_slices`); in single-process mode the
others are given notice at once. Then, on the member's thread: a reclaim is a notice (source ``pool``) through the
job's one notice path, and once a step commits on a view without those slices they go back to the pool (the job
left them at a step boundary, nothing recomputed); a grant starts a new agent (multi-process: a worker process) for
each slice lent, and the job grows onto it. A slice the job held that a committed step's view no longer has, and
that the pool did not reclaim, failed: the job says so to the pool (:meth:`~elastic.pool.member.PoolMember.failed`),
which replaces it up to the job's ``spares`` and lends it again once it returns. The job itself starts no
replacement for a lost slice (``ActorGroup.respawn_every_s``): the pool decides what it runs on. At the end every
slice goes back, and the report's ``extra`` gets the pool's figures for the job (``pool``: ``seconds_below_asked``,
the slices reported failed).

The job's pool user is ``$ELASTIC_POOL_USER`` (default: the login name); its credential ``$ELASTIC_POOL_TOKEN``, or
the file ``$ELASTIC_HOME/tokens/pool-<pool>.user-<user>`` that ``elastic pool start`` wrote for that user.
"""

from __future__ import annotations

import getpass
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from elastic.config import ElasticConfig
from elastic.control.private import elastic_home
from elastic.errors import ConfigError
from elastic.log import get_logger
from elastic.pool.client import find_pool
from elastic.pool.member import PoolMember
from elastic.pool.model import JobSpec
from elastic.supervision.membership import View

__all__ = ["PoolLease", "pool_identity"]


def pool_identity(pool: str) -> tuple[str, str]:
    """The job's pool user and credential, as this module's docstring says (``ConfigError`` when there is none)."""
    user = os.environ.get("ELASTIC_POOL_USER") or getpass.getuser()
    token = os.environ.get("ELASTIC_POOL_TOKEN")
    path = elastic_home() / "tokens" / f"pool-{pool}.user-{user}"
    if not token:
        try:
            token = path.read_text().strip()
        except OSError:
            token = None
    if not token:
        raise ConfigError(
            f"no credential of user {user!r} for pool {pool!r}: set ELASTIC_POOL_TOKEN, or put the file the pool's "
            f"operator handed you at {path} (ELASTIC_POOL_USER names another user)"
        )
    return user, token


class PoolLease:
    """Job ``config``'s lease; ``notice(slices, deadline_s, reason)`` and ``spawn(slice)`` act on the job; the pool's
    figures go to ``extra`` (the report's) at ``close``."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        notice: Callable[[frozenset[int], float, str], Any],
        spawn: Callable[[int], None],
        extra: dict[str, Any] | None = None,
    ) -> None:
        assert config.pool is not None
        user, token = pool_identity(config.pool)
        spec = JobSpec(
            name=config.job_name,
            user=user,
            priority=config.priority,
            min_slices=config.pool_min_slices,
            max_slices=config.pool_max_slices,
            spares=config.spares,
        )
        self._config, self._notice, self._spawn = config, notice, spawn
        self.member = PoolMember(find_pool(config.pool, token, user=user), spec, self)
        self._pending: set[int] = set()  # the job's slices it was told to leave, not yet given back
        self._seen: set[int] = set()  # the job's slices held in a committed step's view, not since given back
        self._failed: list[int] = []  # the job's slices it told the pool failed, in order
        self._extra = extra if extra is not None else {}
        self._lock = threading.Lock()
        self._controller: Any = None  # the job's run, once it can suspend (``attach``)
        self._lent = threading.Condition()  # notified once the slices lent have their agents
        # (what, slices) to tell the pool off the loop's thread: "left" (give back) or "failed"
        self._work: queue.SimpleQueue[tuple[str, frozenset[int]] | None] = queue.SimpleQueue()
        self._giver = threading.Thread(target=self._give_back, name=f"pool-give-back-{config.job_name}", daemon=True)
        self._log = get_logger("elastic.api.pool_lease", job=config.job_name, pool=config.pool)

    def join(self) -> frozenset[int]:
        """Wait for the job's minimum; the job's slices lent (``PoolError`` past ``startup_timeout_s``)."""
        lent = self.member.join(self._config.startup_timeout_s)
        self._giver.start()
        return lent

    @property
    def launch_slices(self) -> frozenset[int] | None:
        """The slices whose agents the job starts with: in multi-process mode the lent ones only (a worker process
        needs its slice's devices); None (every slice) in single-process mode."""
        return self.member.slices if self._config.processes is not None else None

    def start(self) -> None:
        """The job is started: notices for the slices not lent to it (single-process mode: their agents were
        started), then follow the lease."""
        unlent = frozenset(range(self._config.num_slices)) - self.member.slices
        if unlent and self._config.processes is None:
            self._notice(unlent, self._config.recovery_timeout_s, "not lent to the job by its pool")
        self.member.watch()

    # -- LeaseHooks (the member's thread) --------------------------------------------------------
    def attach(self, controller: Any) -> None:
        """The job's run: single-process mode with keepers, a reclaim of every slice it holds (the pool suspends
        it: its minimum is needed by a higher-priority job) suspends it (``Controller.request_suspend``); without
        them, such a notice is kept while the slices last."""
        if self._config.processes is None and self._config.tiers.keeper_every:
            self._controller = controller
            controller.on_suspend = self.suspended

    def reclaim(self, slices: frozenset[int], reason: str) -> None:
        with self._lock:
            self._pending |= slices
            whole = bool(self._pending) and self._pending >= self.member.slices
        if whole and self._controller is not None:
            self._controller.request_suspend(f"pool {self._config.pool}: {reason}")
            return
        try:
            self._notice(slices, self._config.recovery_timeout_s, f"pool {self._config.pool}: {reason}")
        except Exception as err:  # noqa: BLE001 - a notice refused (the slice failed meanwhile): the pool reclaims on
            self._log.warning("pool_notice_refused", slices=sorted(slices), error=str(err).splitlines()[0][:200])

    def granted(self, slices: frozenset[int]) -> None:
        """Start an agent for each slice lent, all at once (a worker process takes seconds to start): the job grows
        onto those that registered by its next step boundary, and onto the rest at a later one."""
        starts = [threading.Thread(target=self._start, args=(s,), name=f"pool-spawn-{s}") for s in sorted(slices)]
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        with self._lent:
            self._lent.notify_all()

    def _start(self, index: int) -> None:
        try:
            self._spawn(index)
        except Exception as err:  # noqa: BLE001 - its agent did not start: the job runs on the rest, the pool is told
            self._log.error("pool_spawn_failed", slice=index, error=repr(err)[:200])
            with self._lock:
                self._failed.append(index)
            self._work.put(("failed", frozenset({index})))

    # -- the job's side ---------------------------------------------------------------------------
    def committed(self, step: int, view: View) -> None:
        """A commit sink: a step committed on ``view``; the slices it no longer holds that the pool asked back go,
        and those it held in an earlier committed view that it lost without being asked are reported failed."""
        held = self.member.slices  # not the slices never lent (single-process mode ran on them before leaving them)
        with self._lock:
            gone = frozenset(s for s in self._pending if s not in view.active)
            self._pending -= gone
            lost = frozenset(self._seen - view.active - gone - self._pending) & held
            self._seen = ((self._seen | set(view.active)) & held) - gone - lost
            self._failed.extend(sorted(lost))
        if gone:
            self._work.put(("left", gone))  # a Ray call: not on the loop's thread
        if lost:
            self._work.put(("failed", lost))

    def suspended(self, step: int, view: View) -> frozenset[int]:
        """The job is suspended before ``step``, its state on its keepers (the loop's thread): every slice goes back
        to the pool; once the pool lends the job its minimum again and their agents are started, the slices of
        ``view`` not lent back are left by notice, and the job's numbers of those lent are returned."""
        with self._lock:
            self._pending.clear()
            self._seen.clear()
        try:
            self.member.left(self.member.slices)
        except ConfigError:  # a release in flight got there first: the rest
            self.member.left(self.member.slices)
        self._log.warning("pool_suspended", step=step, slices=sorted(self.member.slices))
        with self._lent:
            self._lent.wait_for(lambda: len(self.member.slices) >= self._config.pool_min_slices)
            lent = self.member.slices
        if stale := view.active - lent:
            self._notice(frozenset(stale), self._config.recovery_timeout_s, "not lent back by the pool")
        self._log.warning("pool_resumed", step=step, slices=sorted(lent))
        return lent

    def _give_back(self) -> None:
        while (item := self._work.get()) is not None:
            what, slices = item
            try:
                if what == "left":
                    self.member.left(slices)
                else:
                    self.member.failed(slices)
            except Exception as err:  # noqa: BLE001 - the pool restarting: its operator sees the lease; logged
                self._log.warning(f"pool_{what}_not_told", slices=sorted(slices), error=repr(err)[:200])

    def close(self) -> None:
        """Every slice back to the pool (what was still to tell it told first); the threads end."""
        self._work.put(None)
        if self._giver.is_alive():
            self._giver.join(timeout=30)
        try:
            below = self.member.lease_now().get("seconds_below_asked")
        except Exception as err:  # noqa: BLE001 - the pool gone: the figure is missing, the job's result stands
            self._log.warning("pool_lease_unread", error=repr(err)[:200])
            below = None
        self._extra["pool"] = {"seconds_below_asked": below, "slices_failed": list(self._failed)}
        self.member.close()
