"""A job whose slices come from a pool (``ElasticConfig(pool=...)``; single-process mode): the glue between its
:class:`~elastic.pool.member.PoolMember` and the job.

At start the job joins the pool (bounded by ``startup_timeout_s``; a wait past it is a
:class:`~elastic.errors.PoolError` that says why) and is given notice, at once, for the slices the pool did not lend
it, so its first pass runs on the lent ones only. Then, on the member's thread: a reclaim is a notice (source
``pool``) through the job's one notice path, and once a step commits on a view without those slices they go back
to the pool (the job left them at a step boundary, nothing recomputed); a grant starts a new agent for each slice
lent, and the job grows onto it. At the end every slice goes back.

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
    """Job ``config``'s lease; ``notice(slices, deadline_s, reason)`` and ``spawn(slice)`` act on the job."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        notice: Callable[[frozenset[int], float, str], Any],
        spawn: Callable[[int], None],
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
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[frozenset[int] | None] = queue.SimpleQueue()  # slices to give back
        self._giver = threading.Thread(target=self._give_back, name=f"pool-give-back-{config.job_name}", daemon=True)
        self._log = get_logger("elastic.api.pool_lease", job=config.job_name, pool=config.pool)

    def join(self) -> frozenset[int]:
        """Wait for the job's minimum; the job's slices lent (``PoolError`` past ``startup_timeout_s``)."""
        lent = self.member.join(self._config.startup_timeout_s)
        self._giver.start()
        return lent

    def start(self) -> None:
        """The job is started: notices for the slices not lent to it, then follow the lease."""
        unlent = frozenset(range(self._config.num_slices)) - self.member.slices
        if unlent:
            self._notice(unlent, self._config.recovery_timeout_s, "not lent to the job by its pool")
        self.member.watch()

    # -- LeaseHooks (the member's thread) --------------------------------------------------------
    def reclaim(self, slices: frozenset[int], reason: str) -> None:
        with self._lock:
            self._pending |= slices
        try:
            self._notice(slices, self._config.recovery_timeout_s, f"pool {self._config.pool}: {reason}")
        except Exception as err:  # noqa: BLE001 - a notice refused (the slice failed meanwhile): the pool reclaims on
            self._log.warning("pool_notice_refused", slices=sorted(slices), error=str(err).splitlines()[0][:200])

    def granted(self, slices: frozenset[int]) -> None:
        for s in sorted(slices):
            self._spawn(s)

    # -- the job's side ---------------------------------------------------------------------------
    def committed(self, step: int, view: View) -> None:
        """A commit sink: a step committed on ``view``; the slices it no longer holds that the pool asked back go."""
        with self._lock:
            gone = frozenset(s for s in self._pending if s not in view.active)
            self._pending -= gone
        if gone:
            self._work.put(gone)  # a Ray call: not on the loop's thread

    def _give_back(self) -> None:
        while (slices := self._work.get()) is not None:
            try:
                self.member.left(slices)
            except Exception as err:  # noqa: BLE001 - the pool restarting: its operator sees the lease; logged
                self._log.warning("pool_give_back_failed", slices=sorted(slices), error=repr(err)[:200])

    def close(self) -> None:
        """Every slice back to the pool; the threads end."""
        self._work.put(None)
        self.member.close()
        if self._giver.is_alive():
            self._giver.join(timeout=30)
