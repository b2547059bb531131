"""Who may call the pool: its operator (the pool's token) and its users (each a credential derived from it).

The operator who starts a pool makes its token; each user admitted at start gets ``user_credential(token, user)``
(HMAC-derived, :mod:`elastic.supervision.credential`), which names that user and no other. The actor keeps only
digests. Every public method of the pool is :func:`pool_guarded`: the call's ``token`` (and ``user``, for a user's
call) is checked before the body runs, and the body learns who called (:class:`Caller`), so that a user acts on
their own jobs' leases only. A refusal raises :class:`~elastic.errors.AccessError` and is written to the pool's
stream under a writer of its own (``pool-refusals``, bounded like the supervisor's).
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from elastic.errors import AccessError
from elastic.log import get_logger
from elastic.supervision import credential
from elastic.supervision.events import EventStream

__all__ = ["REFUSALS_WRITER", "Caller", "PoolGate", "pool_guarded", "user_credential"]

REFUSALS_WRITER = "pool-refusals"
REFUSALS_KEPT = 1_000
BURST, EVERY_S = 10, 1.0


def user_credential(token: str, user: str) -> str:
    """The credential of ``user`` on the pool whose token is ``token``."""
    return credential.derive(token, f"user/{user}")


@dataclass(frozen=True, kw_only=True)
class Caller:
    """Who made a call: the operator (``user`` None) or a user."""

    user: str | None

    @property
    def operator(self) -> bool:
        return self.user is None


class PoolGate:
    """Checks each call on pool ``pool`` (refusals written to run ``run`` of its event stream ``stream``): ``token``
    None is an open gate (tests)."""

    def __init__(self, pool: str, stream: str, run: str, token: str | None, users: Iterable[str]) -> None:
        self._pool = pool
        self._operator = credential.digest(token) if token is not None else None
        self._users = {u: credential.digest(user_credential(token, u)) for u in users} if token is not None else {}
        key = credential.derive(token, "stream") if token is not None else None
        self._stream = EventStream(stream, run, REFUSALS_WRITER, keep=REFUSALS_KEPT, key=key)
        self._written: dict[str, tuple[int, float]] = {}
        self.refused = 0
        self._log = get_logger("elastic.pool.access", pool=pool)

    @property
    def pool(self) -> str:
        return self._pool

    def check(self, token: Any, user: Any, method: str, *, operator: bool = False) -> Caller:
        """The caller, or ``AccessError``: the operator's token (with no ``user``), or ``user``'s credential
        (``operator``: the operator's only)."""
        if self._operator is None:
            return Caller(user=user if isinstance(user, str) else None)
        if user is None and credential.check(token, self._operator):
            return Caller(user=None)
        if not operator and isinstance(user, str) and credential.check(token, self._users.get(user)):
            return Caller(user=user)
        self.refused += 1
        now = time.monotonic()
        written, last = self._written.get(method, (0, -math.inf))
        if written < BURST or now - last >= EVERY_S:
            self._written[method] = (written + 1, now)
            self._stream.append("refused_command", command=method[:64], refused=self.refused)
            self._log.warning("command_refused", command=method[:64], refused=self.refused)
        if operator:
            raise AccessError(f"{method[:64]} refused: only pool {self._pool!r}'s operator may call it")
        raise AccessError(
            f"{method[:64]} refused: it carries neither pool {self._pool!r}'s operator credential nor the credential "
            "of a user admitted to it (a user passes user= with their own)"
        )


class Gated(Protocol):
    gate: PoolGate


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def pool_guarded(method: str, *, operator: bool = False) -> Callable[[F], F]:
    """The credential check of a pool method, its only one: the call's ``token`` and ``user`` go through
    ``self.gate``; the body gets ``caller=`` (a :class:`Caller`; one the call itself carried is replaced).
    ``operator``: users are refused."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        async def checked(self: Gated, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs).arguments
            caller = self.gate.check(bound.get("token"), bound.get("user"), method, operator=operator)
            return await fn(self, *args, **{**kwargs, "caller": caller})

        return cast(F, checked)

    return wrap
