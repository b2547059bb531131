"""Which actors are the job's: never a name alone.

Anyone holding the cluster token can create a detached actor under a name the job expects (``supervisor``,
``keeper-0``) before the job does, or after its actor died. A handle to such an actor is not the job's, and a
call on it hands the actor the credential and makes Ray unpickle its reply in the caller (code of the squatter's
choosing). So the job never adopts an actor by its name:

- its client creates each actor under a name that must be free (Ray refuses a taken name), keeps the handle, and
  writes a record of the actor's ID to Ray's GCS key-value store, signed under the job's *identity* key
  (:func:`~elastic.supervision.credential.derive` ``"identity"``) that only holders of the job's token have;
- a successor client or an operator's command finds an actor again through that record: :func:`find` reads
  which actor holds the name from Ray's actor table (plain protobuf fields: no method of the actor is called,
  nothing of it is unpickled) and asks Ray for a handle only when its ID is the one the job recorded;
- an actor under an expected name that the job did not record is a *squatter*: :class:`SquatError` (one line,
  naming it), and the squatter is never called.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import ray

from elastic.errors import AccessError
from elastic.supervision import ray_internals as kv

__all__ = [
    "NAMESPACE",
    "JobActors",
    "SquatError",
    "actor_id",
    "find",
    "forget",
    "holder",
    "record",
    "recorded",
    "require_free",
]

NAMESPACE = "elastic-actors"


class SquatError(AccessError):
    """An actor that the job did not create holds one of the job's actor names; it was not called."""


def actor_id(handle: Any) -> str:
    """The hex ID of an actor handle (Ray's own, assigned by the GCS at creation)."""
    return kv.actor_id(handle)


def _key(job: str, name: str) -> bytes:
    return f"{job}/{name}".encode()


def _mac(job: str, name: str, ident: str, key: str) -> str:
    return hmac.new(key.encode(), f"{job}\0{name}\0{ident}".encode(), hashlib.sha256).hexdigest()


def record(job: str, name: str, handle: Any, key: str) -> None:
    """Record that the job created the actor ``handle`` under ``name`` (signed under ``key``)."""
    ident = actor_id(handle)
    value = {"name": name, "actor_id": ident, "mac": _mac(job, name, ident, key)}
    kv.kv_put(_key(job, name), json.dumps(value).encode(), namespace=NAMESPACE)


def recorded(job: str, name: str, key: str | None) -> str | None:
    """The actor ID the job recorded for ``name``, if a record verifies under ``key``; else None (plain JSON)."""
    if key is None:
        return None
    raw = kv.kv_get(_key(job, name), namespace=NAMESPACE)
    try:
        value: Any = json.loads(raw) if raw else {}
        ident, mac = value["actor_id"], value["mac"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(ident, str) or not isinstance(mac, str):
        return None
    return ident if hmac.compare_digest(mac.encode(), _mac(job, name, ident, key).encode()) else None


def forget(job: str) -> None:
    """Delete the job's records (its actors are gone)."""
    kv.kv_del(_key(job, ""), del_by_prefix=True, namespace=NAMESPACE)


def holder(name: str, namespace: str) -> str | None:
    """The ID of the actor (not dead) holding ``name`` in ``namespace``, read from Ray's actor table."""
    from ray.core.generated import gcs_pb2

    table: Any = gcs_pb2.ActorTableData  # type: ignore[attr-defined]  # generated protobuf: no stubs
    dead = table.ActorState.Value("DEAD")
    for raw in kv.actor_table():
        data = table.FromString(raw)
        if data.name == name and data.ray_namespace == namespace and data.state != dead:
            return data.actor_id.hex()
    return None


def require_free(job: str, name: str, namespace: str) -> None:
    """:class:`SquatError` if an actor holds ``name`` already (before the job creates its own there)."""
    squatter = holder(name, namespace)
    if squatter is not None:
        raise _squat(job, name, namespace, squatter)


def find(job: str, name: str, namespace: str, key: str | None) -> Any | None:
    """A handle to the job's actor ``name``, or None if no actor holds the name. :class:`SquatError` if the actor
    holding it is not the one the job recorded (under ``key``); that actor is not called."""
    held = holder(name, namespace)
    if held is None:
        return None
    if recorded(job, name, key) != held:
        raise _squat(job, name, namespace, held)
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:  # died meanwhile
        return None
    if actor_id(handle) != held:  # replaced between the two reads: judged again by the caller
        raise _squat(job, name, namespace, actor_id(handle))
    return handle


def _squat(job: str, name: str, namespace: str, ident: str) -> SquatError:
    return SquatError(
        f"refused: actor {name!r} in namespace {namespace!r} (ID {ident}) was not created by job {job!r} under "
        "this credential (a squatter's, or another job's of the same name): it was not called, nothing was sent "
        "to it; run with the job's credential, or remove that actor, or use another job_name"
    )


class JobActors:
    """Job ``job``'s actors in ``namespace`` as a holder of its credential ``token`` finds and records them."""

    def __init__(self, job: str, namespace: str, token: str | None) -> None:
        from elastic.supervision.credential import derive

        self.job, self.namespace = job, namespace
        self._key = derive(token, "identity") if token is not None else None

    def find(self, name: str) -> Any | None:
        """:func:`find` under this credential."""
        return find(self.job, name, self.namespace, self._key)

    def record(self, name: str, handle: Any) -> None:
        """:func:`record` under this credential (nothing without one)."""
        if self._key is not None:
            record(self.job, name, handle, self._key)

    def is_mine(self, name: str) -> bool | None:
        """Whether the actor holding ``name`` is the job's (None: nobody holds it). Nothing of it is called."""
        held = holder(name, self.namespace)
        return None if held is None else recorded(self.job, name, self._key) == held
