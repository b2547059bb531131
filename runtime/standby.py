"""Standby executables: the step compiled ahead, in the background, for the meshes a job may move to.

``record(fn, args, mesh)`` notes how a jitted function is called on the current mesh (shapes,
dtypes, and each argument's ``PartitionSpec``). ``prepare(meshes)`` then compiles every recorded
function for each candidate mesh on a background thread, with the same specs on that mesh
(``jit(...).lower(abstract args).compile()``). JAX keeps those executables in its compilation cache,
so the first call on the new mesh after a recovery does not compile. A signature that does not fit a
candidate mesh (a batch that does not split over its devices) is skipped and counted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

__all__ = ["Signature", "StandbyCompiler", "mesh_key", "portable", "rebuild"]


def mesh_key(mesh: Mesh | AbstractMesh) -> tuple[Any, ...]:
    """What identifies a mesh for an executable: its axes and its devices in order."""
    return tuple(mesh.axis_names), tuple(mesh.devices.shape), tuple(d.id for d in mesh.devices.flat)


@dataclass(frozen=True)
class Signature:
    """How a function was called, relative to its mesh: per leaf (shape, dtype, spec or None, weak_type)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], Any, Any, bool], ...]

    @classmethod
    def of(cls, args: tuple[Any, ...], mesh: Mesh) -> Signature | None:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        out = []
        for x in leaves:
            if isinstance(x, jax.Array):
                s = x.sharding
                if not (isinstance(s, NamedSharding) and mesh_key(s.mesh) == mesh_key(mesh)):
                    return None  # placed elsewhere: not something a mesh change translates
                out.append((tuple(x.shape), x.dtype, s.spec, bool(getattr(x, "weak_type", False))))
            elif isinstance(x, (bool, int, float)):
                aval = jax.typeof(x)
                out.append(((), aval.dtype, None, bool(getattr(aval, "weak_type", True))))  # type: ignore[arg-type]
            else:
                return None
        return cls(treedef, tuple(out))

    def abstract(self, mesh: Mesh) -> tuple[Any, ...]:
        """The same call on ``mesh`` as abstract arguments (raises ``ValueError`` if a leaf does not split)."""
        leaves = []
        for shape, dtype, spec, weak in self.leaves:
            sharding = NamedSharding(mesh, spec) if spec is not None else None
            if sharding is not None:
                sharding.shard_shape(shape)  # ValueError when it does not divide
            leaves.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def portable(fn: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """A ``jax.jit`` function as (the Python function it wraps, the jit options that shape its executable), to send
    to another process and :func:`rebuild` there (a jitted function does not survive pickling whole). None when it
    carries explicit shardings (they name a mesh of this process) or is not a ``jax.jit`` function."""
    info = getattr(fn, "_jit_info", None)
    wrapped = getattr(fn, "__wrapped__", None)
    if info is None or wrapped is None or getattr(info, "user_specified_in_shardings", False):
        return None
    unspecified = all(type(s).__name__ == "UnspecifiedValue" for s in tuple(info.out_shardings_leaves or ()))
    if not unspecified or info.backend is not None or info.device is not None:
        return None
    return wrapped, {
        "donate_argnums": tuple(info.donate_argnums),
        "static_argnums": tuple(info.static_argnums),
        "keep_unused": bool(info.keep_unused),
        "inline": bool(info.inline),
    }


def rebuild(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """The ``jax.jit`` function :func:`portable` took apart."""
    return jax.jit(fn, **options)


@dataclass
class StandbyStats:
    compiled: int = 0
    skipped: int = 0
    failed: int = 0
    seconds: float = 0.0
    meshes: set[tuple[Any, ...]] = field(default_factory=set)


class StandbyCompiler:
    """Compiles recorded functions for candidate meshes on one background thread, at most
    ``max_meshes`` meshes per ``prepare`` (bounding compile time and executable memory)."""

    def __init__(self, *, max_meshes: int = 8) -> None:
        self.max_meshes = max_meshes
        self._calls: dict[tuple[int, Signature], tuple[Callable[..., Any], Signature]] = {}
        self._done: set[tuple[int, Signature, tuple[Any, ...]]] = set()
        self._skipped: set[tuple[int, Signature, tuple[Any, ...]]] = set()
        self._warmers: list[Callable[[], None]] = []
        self._queue: queue.Queue[tuple[Mesh, ...] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self.stats = StandbyStats()
        self._thread = threading.Thread(target=self._work, name="standby-compiler", daemon=True)
        self._thread.start()

    def record(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh) -> None:
        """Note a call of ``fn`` (a ``jax.jit`` function) with ``args`` on ``mesh``."""
        if not hasattr(fn, "lower"):
            return
        try:
            sig = Signature.of(args, mesh)
        except Exception:  # noqa: BLE001 - an optimisation must never fail a step
            sig = None
        if sig is None:
            self.stats.skipped += 1
            return
        with self._lock:
            self._calls.setdefault((id(fn), sig), (fn, sig))
            self._done.add((id(fn), sig, mesh_key(mesh)))  # it just ran there

    def warm(self, fn: Callable[[], None]) -> None:
        """Also run ``fn`` on the next ``prepare`` (e.g. compile the health probe)."""
        self._warmers.append(fn)

    def prepare(self, meshes: Sequence[Mesh]) -> None:
        """Compile every recorded function for ``meshes`` (the first ``max_meshes``) in the background."""
        self._idle.clear()
        self._queue.put(tuple(meshes[: self.max_meshes]))

    def ready(self, mesh: Mesh) -> bool:
        """Every recorded function has an executable for ``mesh``."""
        key = mesh_key(mesh)
        with self._lock:
            return bool(self._calls) and all((i, sig, key) in self._done for (i, sig) in self._calls)

    def wait(self, timeout: float) -> bool:
        """Wait until no compile is queued or running; False when ``timeout`` passed first."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the compile thread (waits for the compile in progress, 30 s at most)."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while True:
            meshes = self._queue.get()
            if meshes is None:
                return
            warmers, self._warmers = self._warmers, []
            for warm in warmers:
                try:
                    warm()
                except Exception:  # noqa: BLE001 - a warm-up is an optimisation only
                    pass
            with self._lock:
                calls = list(self._calls.values())
            for mesh in meshes:
                for fn, sig in calls:
                    self._compile(fn, sig, mesh)
            if self._queue.empty():
                self._idle.set()

    def _compile(self, fn: Callable[..., Any], sig: Signature, mesh: Mesh) -> None:
        key = (id(fn), sig, mesh_key(mesh))
        with self._lock:
            if key in self._done or key in self._skipped:
                return
        try:
            abstract = sig.abstract(mesh)
        except ValueError:
            self.stats.skipped += 1
            with self._lock:
                self._skipped.add(key)  # it does not fit that mesh as called: a recovery there compiles
            return
        t0 = time.perf_counter()
        try:
            fn.lower(*abstract).compile()  # type: ignore[attr-defined]  # fn is a jax.jit function
        except Exception:  # noqa: BLE001 - a standby that cannot compile leaves recovery to compile
            self.stats.failed += 1
            return
        self.stats.seconds += time.perf_counter() - t0
        self.stats.compiled += 1
        self.stats.meshes.add(mesh_key(mesh))
        with self._lock:
            self._done.add(key)
