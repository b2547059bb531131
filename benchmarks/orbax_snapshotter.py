"""Measure Orbax's Pathways ``Snapshotter`` (orbax-checkpoint 0.12.x) the way a user runs it.

What is measured
----------------
``orbax.checkpoint.experimental.v1.training.pathways.Snapshotter`` (source:
``orbax/checkpoint/experimental/v1/_src/training/pathways/snapshotter.py``) is used as its docstring
and Orbax's own ``snapshotter_benchmark.py`` use it::

    snap = Snapshotter(replica_axis_index=0)  # index of the replica axis in the state's mesh
    snap.save(step, state)  # returns None; may skip (see below)
    snap.join()  # wait for queued copies
    snap.latest.step  # step of the one snapshot it keeps
    restored = snap.load(abstract_state)  # tree of jax.ShapeDtypeStruct with shardings

What the source says it does, and how each figure is taken:

* ``save`` calls ``jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))`` for every array
  leaf, splits the result per replica with ``pathwaysutils``' ``split_by_mesh_axis`` (aliasing, no
  second copy), and queues it (``queue.Queue(maxsize=1)``); a daemon thread waits for the copies and
  then replaces the single ``_latest_snapshot``. ``orbax_blocking_seconds`` is the median wall time
  (``time.perf_counter``) of the ``save`` call itself over all ``steps`` calls; since skipped calls
  return in microseconds, ``orbax_blocking_seconds_accepted`` gives the median over the calls that
  really started a snapshot. By default (``block_steps=True``) each step output is made ready before
  its save, so the figure is the save's own cost, not the step's, and the copy has the whole next
  step to finish; ``block_steps=False`` runs the loop free (no ``block_until_ready`` between step and
  save), as many training loops are written, which can make Orbax skip more saves.
* A save is skipped, not queued, when the queue is full: ``save`` returns ``None`` either way and only
  logs ``logging.warning("Snapshotter busy. Skipping snapshot for step %d", step)`` on the root logger;
  a failed copy is logged with ``logging.exception("Failed to snapshot state at step %d: %s", ...)``.
  ``orbax_dropped`` counts those log records (a handler on the root logger for the duration of the
  run). As a cross-check, ``orbax_latest_step`` (``snap.latest.step`` after ``join``) must equal the
  last step that was not skipped, and ``orbax_newest_saved`` says whether it is the newest step.
* Only one generation is kept (``_latest_snapshot`` is one ``(replica_trees, step)`` tuple), holding
  every replica. While copies are in flight up to two more generations exist (one in the worker, one
  in the queue); they are not counted. ``orbax_held_bytes`` is read after ``join`` from the arrays it
  holds (``snap._latest_snapshot``, private: there is no public accessor): the sum of ``nbytes`` of the
  addressable shards of every ``pinned_host`` array in all replica trees, counting each
  ``(device, unsafe_buffer_pointer())`` once. A replicated leaf is held once per device (replicas x
  local devices copies); a leaf sharded over ``local`` once per replica.
* ``load`` is called once, onto the state's own shardings, with the default
  ``reset_snapshot_state=True``. ``concatenate_by_mesh_axis`` always donates its inputs, so after a
  load the held snapshot's buffers are gone unless it is reset (the reset re-snapshots the restored
  state synchronously inside ``load``). With ``reset_snapshot_state=False`` a second ``load``
  segfaults the process (exit 139, jax 0.10.2 on CPU; even ``is_deleted()`` on the held arrays
  does), so this module loads once, with the reset. ``orbax_load_matches`` compares the restored tree with the state
  that was saved at
  ``orbax_latest_step`` (when that state is still alive, i.e. ``step_fn`` did not donate it).

Workarounds needed to run it on CPU (jax 0.10.2, orbax-checkpoint 0.12.8)
------------------------------------------------------------------------
* ``Snapshotter.__init__`` imports ``pathwaysutils.experimental.{split,concatenate}_by_mesh_axis``
  (the ``pathwaysutils`` package on PyPI, not a dependency of orbax-checkpoint): the ``bench`` extra
  installs it (``orbax_pathwaysutils`` gives its version). Nothing in jax or orbax is patched.
* No Pathways backend is needed: on CPU ``pinned_host`` is ordinary RAM, so the copy speeds say
  nothing about a TPU/GPU host link, but what blocks, what is held and what is dropped are Orbax's
  own behaviour.
* The ``Snapshotter`` worker thread never exits and keeps its last snapshot alive. After measuring,
  this module clears ``snap._latest_snapshot`` (private) so that the host memory is given back to
  the caller's process.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
python benchmarks/orbax_snapshotter.py [--steps 8] [--mib 64] [--free-running]`` (prints one JSON
object).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

_SKIP_MSG = "Snapshotter busy. Skipping snapshot for step %d"
_FAIL_MSG = "Failed to snapshot state at step %d: %s"


@contextlib.contextmanager
def _pathwaysutils_available():
    """Yield the version of pathwaysutils (Snapshotter imports it; ``pip install -e ".[bench]"``)."""
    try:
        importlib.import_module("pathwaysutils.experimental.split_by_mesh_axis")
        importlib.import_module("pathwaysutils.experimental.concatenate_by_mesh_axis")
    except ImportError as err:
        raise SystemExit(f"Orbax's Snapshotter needs pathwaysutils: pip install -e '.[bench]' ({err})") from err
    yield f"pathwaysutils {getattr(sys.modules['pathwaysutils'], '__version__', '?')}"


class _SnapshotterLog(logging.Handler):
    """Collects the root-logger records by which Snapshotter reports skipped and failed saves."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.skipped: list[int] = []
        self.failed: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == _SKIP_MSG and record.args:
            self.skipped.append(int(record.args[0]))
        elif record.msg == _FAIL_MSG and record.args:
            self.failed.append(int(record.args[0]))


@contextlib.contextmanager
def _capture_root_log():
    root = logging.getLogger()
    handler = _SnapshotterLog()
    old_level = root.level
    if root.getEffectiveLevel() > logging.WARNING:
        root.setLevel(logging.WARNING)  # Snapshotter logs with logging.warning: do not let it be filtered out
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def _held_pinned_bytes(tree: Any) -> tuple[int, int]:
    """(bytes, buffers) of distinct pinned_host shard buffers reachable from `tree`."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        if getattr(x.sharding, "memory_kind", None) != "pinned_host":
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        for shard in x.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += shard.data.nbytes
    return total, len(seen)


def _logical_bytes(state: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


def _trees_equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if not np.array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))):
            return False
    return True


def measure_orbax_snapshotter(state, step_fn, *, steps: int, block_steps: bool = True) -> dict:
    """Run `steps` steps (state = step_fn(state), then Snapshotter.save(step, state)) and report.

    With block_steps=True (default) each step output is made ready before its save, so the save's
    blocking is its own cost alone (the way benchmarks/snapshot.py times our snapshots). With
    block_steps=False the loop is a free-running training loop: the step is dispatched and its
    (possibly not yet computed) output saved at once; the save may then return before the copy has
    even started, and the worker's wait then covers the step too, so more saves can be skipped.

    Returns a dict with:
      orbax_blocking_seconds: median seconds the caller is held per save call (all `steps` calls,
        skipped ones included; they return at once);
      orbax_blocking_seconds_accepted: the same over the saves that started a snapshot;
      orbax_first_save_seconds, orbax_max_save_seconds;
      orbax_held_bytes: bytes of distinct pinned_host shard buffers in the one snapshot it keeps,
        after join (all replicas, each device's copy); orbax_held_buffers; orbax_state_bytes (the
        state's logical size); orbax_held_ratio (held / state);
      orbax_dropped: saves that produced no snapshot (skipped as busy or failed, from its log);
        orbax_dropped_steps; orbax_failed;
      orbax_latest_step, orbax_newest_saved, orbax_join_seconds;
      orbax_saves: `steps`; orbax_replicas;
      orbax_load_seconds: one load onto the state's shardings (None if it failed, with
        orbax_load_error); orbax_load_matches; orbax_held_bytes_after_load;
      orbax_step_seconds: median time of the step_fn call (dispatch only unless block_steps);
      orbax_loop_seconds: wall time of the whole loop (steps and saves, before join);
      orbax_block_steps; orbax_pathwaysutils; orbax_version.
    """
    import orbax.checkpoint as ocp_root
    from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter

    if steps < 1:
        raise ValueError("steps must be >= 1")
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    if not leaves or not isinstance(leaves[0].sharding, jax.sharding.NamedSharding):
        raise ValueError("state needs jax arrays with a NamedSharding")
    mesh = leaves[0].sharding.mesh
    replica_axis_index = 0
    n_replicas = mesh.axis_sizes[replica_axis_index]

    with _pathwaysutils_available() as pathwaysutils_desc:
        snap = Snapshotter(replica_axis_index=replica_axis_index)

    save_times: list[float] = []
    step_times: list[float] = []
    accepted_times: list[float] = []
    last_accepted: tuple[int, Any] | None = None  # (step, state) of the newest save that was not skipped
    result: dict[str, Any] = {}
    try:
        with _capture_root_log() as log:
            loop_t0 = time.perf_counter()
            for step in range(steps):
                t0 = time.perf_counter()
                state = step_fn(state)
                if block_steps:
                    jax.block_until_ready(state)
                step_times.append(time.perf_counter() - t0)

                n_skipped = len(log.skipped)
                t0 = time.perf_counter()
                snap.save(step, state)
                dt = time.perf_counter() - t0
                save_times.append(dt)
                if len(log.skipped) == n_skipped:
                    accepted_times.append(dt)
                    last_accepted = (step, state)
            loop_s = time.perf_counter() - loop_t0
            t0 = time.perf_counter()
            snap.join()
            join_s = time.perf_counter() - t0
            skipped, failed = sorted(log.skipped), sorted(log.failed)

        latest = snap.latest
        latest_step = None if latest is None else int(latest.step)
        with snap._lock:  # noqa: SLF001  (no public accessor for what it holds)
            held = snap._latest_snapshot  # noqa: SLF001
        held_bytes, held_buffers = _held_pinned_bytes(held[0] if held else None)
        state_bytes = _logical_bytes(state)
        dropped_steps = sorted(set(skipped) | set(failed))
        result.update(
            orbax_blocking_seconds=statistics.median(save_times),
            orbax_blocking_seconds_accepted=statistics.median(accepted_times) if accepted_times else None,
            orbax_first_save_seconds=save_times[0],
            orbax_max_save_seconds=max(save_times),
            orbax_held_bytes=held_bytes,
            orbax_held_buffers=held_buffers,
            orbax_state_bytes=state_bytes,
            orbax_held_ratio=held_bytes / state_bytes if state_bytes else None,
            orbax_dropped=len(dropped_steps),
            orbax_dropped_steps=dropped_steps,
            orbax_failed=len(failed),
            orbax_latest_step=latest_step,
            orbax_newest_saved=latest_step == steps - 1,
            orbax_join_seconds=join_s,
            orbax_saves=steps,
            orbax_replicas=n_replicas,
            orbax_step_seconds=statistics.median(step_times),
            orbax_loop_seconds=loop_s,
            orbax_block_steps=block_steps,
            orbax_pathwaysutils=pathwaysutils_desc,
            orbax_version=getattr(ocp_root, "__version__", "?"),
        )
        if last_accepted is not None and not failed and latest_step != last_accepted[0]:
            result["orbax_log_mismatch"] = f"last accepted step {last_accepted[0]} but latest is {latest_step}"
        del held

        # One load only (a second load without reset crashed the process in the run).
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            state,
        )
        result.update(orbax_load_seconds=None, orbax_load_matches=None, orbax_held_bytes_after_load=None)
        if latest_step is not None:
            try:
                t0 = time.perf_counter()
                restored = snap.load(abstract)
                jax.block_until_ready(restored)
                result["orbax_load_seconds"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001  (report, do not hide, a failing load)
                result["orbax_load_error"] = f"{type(e).__name__}: {e}"
            else:
                if last_accepted is not None and last_accepted[0] == latest_step:
                    ref = last_accepted[1]
                    if not any(x.is_deleted() for x in jax.tree.leaves(ref) if isinstance(x, jax.Array)):
                        result["orbax_load_matches"] = _trees_equal(restored, ref)
                with snap._lock:  # noqa: SLF001
                    held = snap._latest_snapshot  # noqa: SLF001
                result["orbax_held_bytes_after_load"] = _held_pinned_bytes(held[0] if held else None)[0]
                del restored, held
    finally:
        # Its daemon thread never exits and would keep the snapshot alive for the process's life.
        with contextlib.suppress(Exception):
            snap.join()
        with snap._lock:  # noqa: SLF001
            snap._latest_snapshot = None  # noqa: SLF001
        last_accepted = None
    return result


def _main() -> None:
    import argparse
    import json

    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(
            f"need 8 devices, got {len(devices)}: run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu"
        )
    mesh = Mesh(np.array(devices).reshape(4, 2), ("replica", "local"))
    replicated = NamedSharding(mesh, PartitionSpec())
    parser = argparse.ArgumentParser(description="Measure Orbax's Pathways Snapshotter on a replicated state.")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mib", type=int, default=64, help="state size in MiB")
    parser.add_argument(
        "--free-running", action="store_true", help="do not make each step ready before its save (block_steps=False)"
    )
    args = parser.parse_args()
    rows = args.mib * 256  # float32 rows of 1024 elements: 256 rows per MiB
    # Two leaves of 1/2 and 1/4 of the state plus one of the rest (64 MiB: 32 + 16 + 16 MiB).
    shapes = {"w1": (rows // 2, 1024), "w2": (rows // 4, 1024), "w3": (rows - rows // 2 - rows // 4, 1024)}
    state = {k: jax.device_put(jnp.full(s, 0.5, jnp.float32), replicated) for k, s in shapes.items()}
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 0.001, s))
    result = measure_orbax_snapshotter(state, step_fn, steps=args.steps, block_steps=not args.free_running)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    _main()
