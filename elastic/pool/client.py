"""Starting a pool and finding it again, never by its name alone (:mod:`elastic.supervision.identity`).

:func:`start_pool` creates the pool's actor under a name that must be free, starts its event stream, and records the
actor's ID signed under the operator's identity key, and once more for each user admitted, under a key derived from
that user's credential: a user finds the pool (:func:`find_pool`) through their own record, which no other user can
write. The handle returned carries the caller's credential (and user name) on every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import ray

from elastic.errors import ConfigError
from elastic.pool.access import user_credential
from elastic.pool.actor import NAMESPACE, Pool, actor_name, stream_name
from elastic.pool.model import new_state
from elastic.snapshot.calls import call_key, sign
from elastic.supervision import credential, events, identity

__all__ = ["PoolHandle", "find_pool", "start_pool"]


class PoolHandle:
    """A pool actor's handle whose calls carry a token signed once with ``token`` (and ``user``, for a user's
    credential; :mod:`elastic.snapshot.calls`); ``handle`` is the plain one. Pickles with the call key only."""

    def __init__(self, handle: Any, token: str | None, user: str | None = None, *, key: str | None = None) -> None:
        self.handle, self._user = handle, user
        self._key = key if key is not None else call_key(cast(str, token))

    def call(self, method: str, *args: Any, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        """``method``'s answer (the pool's own error raised as itself, not wrapped by Ray)."""
        if self._user is not None:
            kwargs["user"] = self._user
        ref = getattr(self.handle, method).remote(*args, token=sign(self._key, method), **kwargs)
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayTaskError as err:
            cause = err.cause
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None
            raise

    def __reduce__(self) -> tuple[Any, tuple[Any, None, str | None, str]]:
        return (_rebuild, (self.handle, None, self._user, self._key))


def _rebuild(handle: Any, token: None, user: str | None, key: str) -> PoolHandle:
    return PoolHandle(handle, token, user, key=key)


def _user_record(pool: str, user: str) -> str:
    return f"{actor_name(pool)}@{user}"


def start_pool(
    name: str,
    slices: int,
    token: str,
    *,
    quotas: Mapping[str, int] | None = None,
    users: Iterable[str] = (),
) -> PoolHandle:
    """Start pool ``name`` of ``slices`` slices, its operator's credential ``token``; ``users`` (and every user with
    a quota) are admitted. ``ConfigError`` for a bad size or quota; :class:`~elastic.supervision.identity.SquatError`
    when an actor holds the name already."""
    quotas = dict(quotas or {})
    new_state(slices, quotas)  # the size and quotas checked before anything is started
    admitted = sorted({*users, *quotas})
    job, actor = stream_name(name), actor_name(name)
    identity.require_free(job, actor, NAMESPACE)
    run = events.new_run(job, key=credential.derive(token, "stream"))
    try:
        handle = Pool.options(  # type: ignore[attr-defined]  # a ray actor class
            name=actor, namespace=NAMESPACE, lifetime="detached"
        ).remote(name, slices, quotas, admitted, run, token)
    except ValueError as err:
        raise identity.SquatError(f"refused: the name {actor!r} was taken meanwhile: nothing was sent to it") from err
    identity.JobActors(job, NAMESPACE, token).record(actor, handle)
    for user in admitted:
        key = credential.derive(user_credential(token, user), "identity")
        identity.record(job, _user_record(name, user), handle, key)
    pool = PoolHandle(handle, token)
    pool.call("status", timeout_s=60.0)  # started, its log replayed
    return pool


def find_pool(name: str, token: str, *, user: str | None = None) -> PoolHandle:
    """The pool ``name`` as its operator (``user`` None) or ``user`` finds it: its actor's ID checked against the
    caller's signed record before any call. ``ConfigError`` when it is not running;
    :class:`~elastic.supervision.identity.SquatError` when the actor under its name is not the recorded one."""
    job, actor = stream_name(name), actor_name(name)
    if user is None:
        handle = identity.JobActors(job, NAMESPACE, token).find(actor)
    else:
        held = identity.holder(actor, NAMESPACE)
        handle = None
        if held is not None:
            key = credential.derive(token, "identity")
            if identity.recorded(job, _user_record(name, user), key) != held:
                raise identity.SquatError(
                    f"refused: actor {actor!r} (ID {held}) is not recorded as pool {name!r} for user {user!r} under "
                    "this credential: it was not called (is the credential this user's, and were they admitted?)"
                )
            handle = ray.get_actor(actor, namespace=NAMESPACE)
            if identity.actor_id(handle) != held:
                raise identity.SquatError(f"refused: actor {actor!r} was replaced meanwhile: it was not called")
    if handle is None:
        raise ConfigError(f"pool {name!r} is not running on this cluster (no actor {actor!r} in {NAMESPACE})")
    return PoolHandle(handle, token, user)
