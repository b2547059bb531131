"""Who may call the pool: its operator (the pool's token) and its users (each a credential derived from it).

The operator who starts a pool makes its token; each user admitted at start gets ``user_credential(token, user)``
(HMAC-derived, :mod:`elastic.supervision.credential`), which names that user and no other. A call carries a token
signed once under the caller's call key (:mod:`elastic.snapshot.calls`); the actor keeps only call keys. Every public
method of the pool is :func:`pool_guarded`: the call's ``token`` (and ``user``, for a user's
call) is checked before the body runs, and the body learns who called (:class:`Caller`), so that a user acts on
their own jobs' leases only. A refusal raises :class:`~elastic.errors.AccessError` and is written to the pool's
stream under a writer of its own (``pool-refusals``, bounded like the supervisor's).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from elastic.errors import AccessError
from elastic.log import get_logger
from elastic.snapshot.calls import CallCheck, call_key
from elastic.supervision import credential
from elastic.supervision.access import Refusals

__all__ = ["REFUSALS_WRITER", "Caller", "PoolGate", "pool_guarded", "user_credential"]

REFUSALS_WRITER = "pool-refusals"


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
        admitted = sorted(users) if token is not None else []
        self._users = {u: i + 1 for i, u in enumerate(admitted)}  # a user's index among the keys (0: the operator)
        keys = [call_key(user_credential(token, u)) for u in admitted] if token is not None else []
        self._calls = CallCheck(call_key(token) if token is not None else None, *keys)
        key = credential.derive(token, "stream") if token is not None else None
        log = get_logger("elastic.pool.access", pool=pool)
        self.refusals = Refusals(stream, run, key, log, writer=REFUSALS_WRITER)

    @property
    def pool(self) -> str:
        return self._pool

    @property
    def refused(self) -> int:
        """Calls refused (written or not)."""
        return self.refusals.refused

    def check(self, token: Any, user: Any, method: str, *, operator: bool = False, signed_for: str = "") -> Caller:
        """The caller, or ``AccessError``: a fresh call of the Ray method ``signed_for`` (default ``method``) signed
        with the operator's token (with no ``user``), or with ``user``'s credential (``operator``: the operator's
        only)."""
        if self._calls.open:
            return Caller(user=user if isinstance(user, str) else None)
        if user is None:
            why = self._calls.refusal(token, signed_for or method, keys=(0,))
        elif not operator and isinstance(user, str) and user in self._users:
            why = self._calls.refusal(token, signed_for or method, keys=(self._users[user],))
        else:
            why = "not a user admitted to this pool, or an operator's method"
        if why is None:
            return Caller(user=user)
        self.refusals.add(method, why)
        if operator:
            raise AccessError(f"{method[:64]} refused ({why}): only pool {self._pool!r}'s operator may call it")
        raise AccessError(
            f"{method[:64]} refused ({why}): it is signed with neither pool {self._pool!r}'s operator credential "
            "nor that of a user admitted to it (a user passes user= with their own)"
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
            token, user = bound.get("token"), bound.get("user")
            caller = self.gate.check(token, user, method, operator=operator, signed_for=fn.__name__)
            return await fn(self, *args, **{**kwargs, "caller": caller})

        return cast(F, checked)

    return wrap
