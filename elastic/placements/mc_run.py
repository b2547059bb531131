"""What the user's loop receives in a multi-controller worker: the same shape as :class:`elastic.Run`.

Every worker process runs the loop SPMD over a mesh of ALL the group's devices (its own two and every peer's):
``run.state`` is the state restored onto that mesh, ``run.steps`` resumes at the restored step, ``run.shard_batch``
places the global batch of a step (data addressed by step: every process builds the same batch and keeps its
own rows), ``run.jit`` compiles for the mesh, and ``run.commit(state, loss=...)`` waits for the step and hands it
to the worker (ledger, snapshot, progress). Step boundaries belong to the iterator: when the driver asked the
group to stop at a step (a slice joins), ``run.steps`` ends the pass there by raising :class:`Boundary`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from elastic.errors import ConfigError
from elastic.api.run import batch_rows
from runtime.mesh import batch_sharding

__all__ = ["Aborted", "Boundary", "McRun"]


class Boundary(BaseException):
    """Ends the loop at a step boundary the driver asked for (a ``BaseException``: ``except Exception`` in the
    user's loop does not swallow it). ``step`` is the next step to run; ``run.state`` is the state before it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the group regroups before step {step}")
        self.step = step


class Aborted(BaseException):
    """Ends an abandoned pass: the driver aborted the group (a member was lost) while this thread was still in it."""


class McRun:
    """One pass of the user's loop in one worker process, over one group."""

    def __init__(self, *, mesh: Mesh, state: Any, start_step: int, num_steps: int, seed: int, epoch: int,
                 on_commit: Callable[[int, Any, dict[str, Any]], None],
                 stop_before: Callable[[int], bool], aborted: Callable[[], bool] = lambda: False) -> None:
        self.mesh = mesh
        self.state = state
        self.start_step = start_step
        self.num_steps = num_steps
        self.epoch = epoch
        self._seed = seed
        self._on_commit = on_commit
        self._stop_before = stop_before
        self._aborted = aborted
        self._pending: int | None = None
        self._started = False

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def steps(self) -> Iterator[int]:
        if self._started:
            raise ConfigError("run.steps may be iterated once per pass of the loop")
        self._started = True
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        for step in range(self.start_step, self.num_steps):
            if self._aborted():
                raise Aborted(f"group {self.epoch} was aborted before step {step}")
            if step > self.start_step and self._stop_before(step):
                raise Boundary(step)
            self._pending = step
            yield step
            if self._pending is not None:
                raise ConfigError(f"step {step} ended without run.commit(state): commit once per step")

    def commit(self, state: Any, **metrics: Any) -> None:
        """Commit the current step's new ``state``: waits for it (a dead peer makes this raise within the
        collective timeout, a ``JaxRuntimeError`` the worker classifies), then records and maybe snapshots it."""
        step = self._pending
        if step is None:
            raise ConfigError("run.commit() must be called once per step, inside `for step in run.steps`")
        jax.block_until_ready((state, metrics))
        self._pending = None
        self.state = state
        self._on_commit(step, state, metrics)

    def jit(self, fn: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
        return jax.jit(fn, **jit_kwargs)

    def shard_batch(self, batch: Any) -> Any:
        """The global host batch of a step (the same in every process) placed on the mesh, its leading
        dimension split over every device of the group; each process supplies only its own devices' rows."""
        rows = batch_rows(batch, what="run.shard_batch got")
        if rows % self.num_devices:
            raise ConfigError(f"a batch of {rows} rows does not split over {self.num_devices} devices: use a "
                              "size that divides every device count the job may run on")
        sharding = batch_sharding(self.mesh)

        def place(leaf: Any) -> jax.Array:
            host = np.asarray(leaf)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree_util.tree_map(place, batch)

    def key(self, step: int) -> jax.Array:
        return jax.random.fold_in(jax.random.key(self._seed), step)
