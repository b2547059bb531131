"""Every use of Ray's private API, in one module.

Ray has no public API for what these do: its internal key-value store (the job's signed records), the
drain table, the GCS actor table, a handle's actor ID, and a GCS client that can drain a node or probe an
address. The names are used here and nowhere else (the one file ruff's private-access rule exempts, in
``pyproject.toml``), so a Ray upgrade that moves one breaks this file and
its tests (``tests/unit/test_ray_internals.py``), not a dozen call sites.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "actor_id",
    "actor_table",
    "draining_nodes",
    "gcs_client",
    "kv_del",
    "kv_exists",
    "kv_get",
    "kv_list",
    "kv_multi_get",
    "kv_put",
]


def kv_put(key: bytes, value: bytes, *, namespace: str | None = None, overwrite: bool = True) -> bool:
    """Store ``value`` under ``key``; True if the key already existed."""
    from ray.experimental.internal_kv import _internal_kv_put

    return bool(_internal_kv_put(key, value, overwrite=overwrite, namespace=namespace))


def kv_get(key: bytes, *, namespace: str | None = None) -> bytes | None:
    """The value under ``key``, or None."""
    from ray.experimental.internal_kv import _internal_kv_get

    value: bytes | None = _internal_kv_get(key, namespace=namespace)
    return value


def kv_exists(key: bytes, *, namespace: str | None = None) -> bool:
    """Whether ``key`` holds a value."""
    from ray.experimental.internal_kv import _internal_kv_exists

    return bool(_internal_kv_exists(key, namespace=namespace))


def kv_list(prefix: bytes, *, namespace: str | None = None) -> list[bytes]:
    """The keys that start with ``prefix``."""
    from ray.experimental.internal_kv import _internal_kv_list

    return list(_internal_kv_list(prefix, namespace=namespace))


def kv_del(key: bytes, *, namespace: str | None = None, del_by_prefix: bool = False) -> int:
    """Delete ``key`` (every key under it with ``del_by_prefix``); the number of keys deleted."""
    from ray.experimental.internal_kv import _internal_kv_del

    return int(_internal_kv_del(key, del_by_prefix=del_by_prefix, namespace=namespace))


def kv_multi_get(keys: list[bytes], *, namespace: str) -> dict[bytes, bytes]:
    """The values of ``keys`` in one round trip (keys without a value are left out)."""
    from ray.experimental import internal_kv

    client: Any = internal_kv.global_gcs_client  # set once this process is connected
    return dict(client.internal_kv_multi_get(keys, namespace.encode()))


def actor_id(handle: Any) -> str:
    """The hex ID of an actor handle (Ray's own, assigned by the GCS at creation)."""
    return str(handle._actor_id.hex())


def draining_nodes() -> dict[str, int]:
    """Ray's drain table: ``{node_id_hex: deadline_ms}`` (0: no deadline)."""
    from ray._private.state import state

    return dict(state.get_draining_nodes() or {})


def actor_table(actor_id: str | None = None) -> Any:
    """One actor's entry in the GCS actor table (``actor_id``), or the raw table of every actor (None)."""
    from ray._private.state import state

    if actor_id is not None:
        return state.actor_table(actor_id=actor_id)
    return state._connect_and_get_accessor().get_actor_table(None, None)  # as ray.util.state reads it


def gcs_client(address: str) -> Any:
    """A client of the GCS at ``address`` (raises if it does not answer or refuses this process)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # not in ray's stubs

    return GcsClient(address=address)
