"""The persistent tier: asynchronous Orbax checkpoints every ``every`` steps, restorable onto any mesh.

Each step directory holds two items: ``state`` (the array pytree, Orbax's ``PyTreeSave``) and ``meta`` (JSON: the
controller's ``meta`` plus the saved layout, used to check a
restore target's structure). The root metadata names the job that owns the directory; a tier never
writes into, or deletes from, a directory owned by another job or holding anything else.

Typed PRNG keys (``jax.random.key``) are saved natively by Orbax 0.12.8 (key data plus the impl); the
layout records the key dtype (``key<fry>``) so a target of another impl is refused, not silently cast.

Orbax's replica-parallel saving (its default off GPU) is turned off: it slices replicated shards with a
jitted ``slice`` per device, which blocked the first ``save`` on every new mesh for seconds, an order of
magnitude longer than without it. The price: one replica of each shard writes it all.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import structlog
from etils import epath
from orbax.checkpoint._src.metadata import array_metadata_store  # pinned: orbax-checkpoint 0.12.8

from .errors import NoSnapshotError, SnapshotError, SnapshotStructureError

__all__ = ["PersistentTier", "PersistentDirectoryError"]

log = structlog.get_logger("snapshot.persistent")

_OWNER_KEY = "snapshot.persistent"
_FORMAT = 1
_TUPLE, _ITEMS = "__tuple__", "__items__"


class PersistentDirectoryError(SnapshotError, ValueError):
    """The directory holds something this tier must not touch (another job's checkpoints, other files)."""


def _forget_orbax_client() -> None:
    """Orbax caches, once per process, a signalling client around jax's distributed client. A process that left its
    ``jax.distributed`` group and joined another (multi-process jobs re-form in place) has a new client; the cached
    one would talk to the old group's service. Pinned: orbax-checkpoint 0.12.8's ``get_signaling_client``."""
    from orbax.checkpoint._src.futures import signaling_client

    signaling_client.get_signaling_client.cache_clear()


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's standard handlers, but ``jax.Array`` saved without replica parallelism (see module doc)."""
    others = [
        (ty, ocp.type_handlers.get_type_handler(ty))
        for ty in ocp.type_handlers.supported_types()
        if ty is not jax.Array
    ]
    arrays = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,  # the store keeps typed keys' impl
        array_metadata_store=array_metadata_store.Store(),
    )
    registry = ocp.type_handlers.create_type_handler_registry(*others, (jax.Array, arrays))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _encode(x: Any, where: str = "meta") -> Any:
    """``x`` as JSON-safe data; tuples and dicts with non-str keys are tagged so they come back as they were."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and not (len(x) == 1 and next(iter(x)) in (_TUPLE, _ITEMS)):
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in x.items()}
        return {_ITEMS: [[_encode(k, where), _encode(v, f"{where}[{k!r}]")] for k, v in x.items()]}
    raise TypeError(
        f"{where} is a {type(x).__name__}: meta may hold only None, bool, int, float, str, list, "
        "tuple and dict (convert it before saving)"
    )


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if isinstance(x, dict):
        if len(x) == 1 and _TUPLE in x:
            return tuple(_decode(v) for v in x[_TUPLE])
        if len(x) == 1 and _ITEMS in x:
            return {_decode(k): _decode(v) for k, v in x[_ITEMS]}
        return {k: _decode(v) for k, v in x.items()}
    return x


def _layout(tree: Any) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of every leaf; keys keep their logical shape and ``key<impl>`` dtype."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, x in leaves:
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        out[jax.tree_util.keystr(path)] = [[int(d) for d in x.shape], str(x.dtype)]
    return out


def _some(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _structure_diff(saved: dict[str, list], target: dict[str, list]) -> list[str]:
    """Readable differences between two layouts; empty when they match."""
    missing = [k for k in saved if k not in target]
    extra = [k for k in target if k not in saved]
    differ = [
        f"{k}: saved {tuple(saved[k][0])} {saved[k][1]}, target {tuple(target[k][0])} {target[k][1]}"
        for k in saved
        if k in target and saved[k] != target[k]
    ]
    return (
        ([f"missing from target: {_some(missing)}"] if missing else [])
        + ([f"not in checkpoint: {_some(extra)}"] if extra else [])
        + ([_some(differ, 3)] if differ else [])
    )


class PersistentTier:
    """Asynchronous Orbax checkpoints of sharded state in ``directory`` (a path or bucket URL).

    ``save`` returns once Orbax's blocking part is done (the device-to-host copy); the write goes on in
    the background. A ``save`` while the previous one is still writing first waits for it (Orbax's
    behaviour), so keep ``every`` long enough for a write to finish. ``keep`` newest steps stay on disk.
    A directory already owned by ``job`` is continued (a resumed job); one owned by another job, or
    holding anything but this tier's checkpoints, raises :class:`PersistentDirectoryError` untouched.
    """

    def __init__(self, directory: str | os.PathLike, *, every: int, keep: int = 2, job: str | None = None) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1 (save every N steps), got {every}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (checkpoints kept on disk), got {keep}")
        self.directory = epath.Path(directory)
        self.every, self.keep, self.job = every, keep, job
        _forget_orbax_client()
        resumed = self._claimable()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
                enable_async_checkpointing=True,
                cleanup_tmp_directories=resumed,  # only ever our own unfinished saves
            ),
            item_handlers={"state": _state_handler(), "meta": ocp.JsonCheckpointHandler()},
            metadata={_OWNER_KEY: {"job": job, "format": _FORMAT}},
        )
        self._saves, self._blocking = 0, 0.0
        self._closed = False
        self._log = log.bind(job=job, directory=str(self.directory))
        self._log.info("persistent_open", resumed=resumed, latest_step=self.latest_step(), every=every, keep=keep)

    def _claimable(self) -> bool:
        """True when the directory holds this job's checkpoints, False when empty or absent; else raise."""
        if not self.directory.exists() or not any(self.directory.iterdir()):
            return False
        reader = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(read_only=True))
        try:
            owner = (reader.metadata().custom_metadata or {}).get(_OWNER_KEY)
        except Exception as err:  # unreadable metadata: not ours to touch
            raise PersistentDirectoryError(
                f"{self.directory} is not empty and its checkpoint metadata cannot be read ({err}): "
                "give this job an empty directory of its own"
            ) from err
        finally:
            reader.close()
        if not isinstance(owner, dict):
            raise PersistentDirectoryError(
                f"{self.directory} is not empty and holds no checkpoints of a PersistentTier: "
                "give this job an empty directory of its own"
            )
        if owner.get("job") != self.job:
            raise PersistentDirectoryError(
                f"{self.directory} holds checkpoints of job {owner.get('job')!r}, not {self.job!r}: "
                "pick another directory, or pass that job's name to resume it"
            )
        return True

    def due(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step (``step % every == 0``)."""
        return step % self.every == 0

    def latest_step(self) -> int | None:
        """The newest step saved (a save of this tier still writing counts: ``wait()`` makes it durable)."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Start an asynchronous save of ``state`` and ``meta`` at ``step``; return once Orbax's blocking
        part is done. Does not consult ``due``. A step at or before the newest saved step is skipped (never
        overwritten): returns False. Raises TypeError if ``meta`` holds what JSON cannot carry."""
        latest = self.latest_step()
        if latest is not None and step <= latest:
            self._log.warning("persistent_save_skipped", step=step, latest_step=latest)
            return False
        record = {"meta": _encode(meta), "layout": _layout(state), "job": self.job, "format": _FORMAT}
        start = time.perf_counter()
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(record)), force=True
        )
        blocked = time.perf_counter() - start
        self._saves += 1
        self._blocking += blocked
        self._log.info("persistent_save_started", step=step, blocking_s=round(blocked, 4))
        return True

    def wait(self) -> None:
        """Block until every started save is durable (committed on disk, old steps pruned)."""
        self._manager.wait_until_finished()

    def load(self, abstract_state: Any, *, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Restore the newest (or the given) step onto the shardings of ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` (or arrays)
        matching the saved state; any mesh works. Waits for running saves first. Returns
        ``(step, state, meta)``. Raises NoSnapshotError (nothing, or not that step, on disk) and
        SnapshotStructureError (paths, shapes or dtypes differ, or a leaf carries no sharding).
        """
        self.wait()
        steps = self._manager.all_steps()
        if step is None and not steps:
            raise NoSnapshotError(f"no checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise NoSnapshotError(f"no checkpoint of step {step} in {self.directory} (steps: {sorted(steps)})")
        step = max(steps) if step is None else step
        start = time.perf_counter()
        record = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        diff = _structure_diff(record["layout"], _layout(abstract_state))
        if diff:
            raise SnapshotStructureError(f"target does not match the checkpoint of step {step}: " + "; ".join(diff))

        def target(path: Any, x: Any) -> jax.ShapeDtypeStruct:
            if getattr(x, "sharding", None) is None:
                raise SnapshotStructureError(
                    f"leaf {jax.tree_util.keystr(path)} of abstract_state has no sharding: "
                    "pass jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
                )
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        abstract = jax.tree_util.tree_map_with_path(target, abstract_state)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        state = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args))
        ).state
        self._log.info("persistent_restored", step=step, seconds=round(time.perf_counter() - start, 3))
        return step, state, _decode(record["meta"])

    def stats(self) -> dict[str, Any]:
        """Counters: saves started, total seconds ``save`` blocked, newest saved step."""
        return {
            "persistent_saves": self._saves,
            "persistent_blocking_seconds": self._blocking,
            "persistent_last_step": self.latest_step(),
        }

    def close(self) -> None:
        """Wait for running saves, then release Orbax's resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self._manager.close()  # waits for running saves

    def __enter__(self) -> PersistentTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
