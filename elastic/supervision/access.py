"""The supervisor's gate: who may call which method, and how a refused call is recorded without a flood.

A call carries ``token=``, signed for that one call (:mod:`elastic.snapshot.calls`); every public method of the
supervisor is :func:`guarded` (its one check, before its body runs), and :meth:`Gate.check` accepts a token signed
with the job's token, or for the methods open to agents with their derived credential, once (only the call keys
are held, :mod:`elastic.supervision.credential`). A refusal raises
:class:`~elastic.errors.AccessError` and is written to the job's stream as ``refused_command`` naming the
*method* (a fixed name of the supervisor's, never a string the caller chose), under a writer of its own
(``supervisor-refusals``, its own bound of kept records): refusals can never push the supervisor's replay history
out of the stream. Bounded: ten records of a method, then one a second at most (Ray tells an actor nothing of
its caller, so the bound is per method, which bounds every caller together); each record under
:data:`MAX_RECORD_BYTES`.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

from elastic.errors import AccessError
from elastic.log import get_logger
from elastic.snapshot.calls import CallCheck, call_key
from elastic.supervision import credential
from elastic.supervision.events import EventStream

__all__ = ["Gate", "Guarded", "Refusals", "guarded", "MAX_RECORD_BYTES", "REFUSALS_KEPT", "REFUSALS_WRITER"]

REFUSALS_WRITER = "supervisor-refusals"
REFUSALS_KEPT = 1_000  # refusal records kept per run (older ones are deleted as new ones land)
MAX_RECORD_BYTES = 4096
BURST, EVERY_S = 10, 1.0  # per method: the first ten refusals written, then one per EVERY_S


class Refusals:
    """The record of refused calls on one actor: ``refused_command`` records in run ``run`` of stream ``stream``
    under their own writer (``keep`` newest, signed with ``key``), at most :data:`BURST` of a method, then one per
    :data:`EVERY_S`; each under :data:`MAX_RECORD_BYTES`. ``refused`` counts every refusal, written or not."""

    def __init__(self, stream: str, run: str, key: str | None, log: Any, *, writer: str = REFUSALS_WRITER) -> None:
        self._stream = EventStream(stream, run, writer, keep=REFUSALS_KEPT, key=key)
        self._written: dict[str, tuple[int, float]] = {}  # method -> (refusals written, when the last was)
        self._log = log
        self.refused = 0

    def add(self, method: str, why: str, **fields: Any) -> None:
        """Count a refused call of ``method`` (``why``: the reason), and record it unless over the bound."""
        self.refused += 1
        now = time.monotonic()
        written, last = self._written.get(method, (0, -math.inf))
        if written < BURST or now - last >= EVERY_S:
            self._written[method] = (written + 1, now)
            record = {"command": method[:64], "reason": why, "refused": self.refused}
            self._stream.append("refused_command", **fields, **record)
            self._log.warning("command_refused", **record)


class Gate:
    """Checks the credential of each call on one job's supervisor (``token`` None: an open gate, for tests);
    ``epoch`` gives the epoch a refusal's record names."""

    def __init__(self, job: str, run: str, token: str | None, *, epoch: Callable[[], int] = lambda: 0) -> None:
        self._job = job
        self._epoch = epoch
        agent = credential.derive(token, "agent") if token is not None else None
        self._calls = CallCheck(call_key(token) if token is not None else None, call_key(agent) if agent else None)
        key = credential.derive(token, "stream") if token is not None else None
        self.refusals = Refusals(job, run, key, get_logger("elastic.supervision.access", job=job))

    @property
    def open(self) -> bool:
        return self._calls.open

    @property
    def refused(self) -> int:
        """Calls refused (written or not)."""
        return self.refusals.refused

    def check(self, token: Any, method: str, *, agents: bool = False, signed_for: str | None = None) -> None:
        """``AccessError`` unless ``token`` is a fresh call signed with the job's credential (``agents``: or its
        agents') for the Ray method ``signed_for`` (default ``method``). ``method`` is the supervisor's own name
        for the call, which a refusal records."""
        why = self._calls.refusal(token, signed_for or method, keys=(0, 1) if agents else (0,))
        if why is None:
            return
        self.refusals.add(method, why, epoch=self._epoch())
        raise AccessError(
            f"{method[:64]} refused ({why}): only job {self._job!r}'s own client, its agents, or an operator "
            "holding its token may call it, each call signed once"
        )


class Guarded(Protocol):
    """An actor whose public methods are :func:`guarded`: it holds its :class:`Gate`."""

    gate: Gate


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def guarded(method: str, *, agents: bool = False) -> Callable[[F], F]:
    """The credential check of a public method of a :class:`Guarded` actor, the only one: the call's ``token``
    (keyword or positional) goes through ``self.gate`` (:meth:`Gate.check`, ``method`` the fixed name a refusal
    records; ``agents``: the agents' credential is accepted too) before the body runs."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        async def checked(self: Guarded, *args: Any, **kwargs: Any) -> Any:
            token = signature.bind(self, *args, **kwargs).arguments.get("token")
            self.gate.check(token, method, agents=agents, signed_for=fn.__name__)
            return await fn(self, *args, **kwargs)

        return cast(F, checked)

    return wrap
