"""The examples' ``--verify``: the same training without the library, on the same devices at the same steps.

``Placements`` is an ``on_step`` callback: it records, for each committed step of the final lineage, the
slices the step ran on (a step recomputed after a restore overwrites its entry). ``run_reference`` then
trains from the same seed in a plain loop: the state is initialised on the mesh of step 0, moved with
``jax.device_put`` onto the mesh of each step whose slices differ from the previous step's, and advanced by
``step_fn(state, step, mesh)``, the example's own step without any of ``elastic``. Moving and restoring
are exact copies, so the elastic run and the reference agree bit for bit when the step is deterministic.

In multi-process mode the steps ran in worker processes whose collectives (gloo) sum in another order than one
process's devices do, and a float that differs in its last bit can grow (adam normalises a near-zero gradient
to a step of the learning rate's size). So the reference replays the same schedule in the same kind of
processes: for each stretch of steps on one set of slices, that many plain processes (Ray actors set up like the
workers, kept from one stretch to the next) join a new ``jax.distributed`` group, receive the state from this
process, run the example's step, and hand the state back; nothing of ``elastic`` runs in them but the helper that
joins the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from elastic import runtime
from elastic.api.job import ElasticJob
from elastic.loop.run import Run

__all__ = ["Placements", "ReferenceProcess", "run_reference", "run_reference_processes"]


class Placements:
    """``on_step`` callback: ``slices[step]`` is what the committed step ran on."""

    def __init__(self) -> None:
        self.slices: dict[int, tuple[int, ...]] = {}

    def __call__(self, step: int, metrics: dict[str, Any], run: Run) -> None:
        self.slices[step] = run.slices

    def moves(self) -> int:
        """How many times the slice set changed along the lineage."""
        steps = sorted(self.slices)
        return sum(self.slices[a] != self.slices[b] for a, b in zip(steps, steps[1:], strict=False))


def run_reference(job: ElasticJob, placements: Placements, step_fn: Callable[[Any, int, Mesh], Any]) -> Any:
    """Train ``job``'s model without the library over ``placements`` (every step 0..num_steps-1 must be in it);
    the final state. Uses the job's own mesh layout, shardings, init function and seed, and its topology; in
    multi-process mode the devices are the workers', so the same slices of this process's devices stand in."""
    steps = range(job.config.num_steps)
    missing = [s for s in steps if s not in placements.slices]
    if missing:
        raise ValueError(f"placements lack steps {missing[:5]}...: record them with on_step=Placements()")
    topology = job.topology
    if job.config.processes is not None:
        topology = runtime.simulated_topology(job.config.num_slices, job.config.devices_per_slice)
    state, current = None, None
    for step in steps:
        slices = placements.slices[step]
        if slices != current:
            mesh = runtime.build_mesh(topology.select(frozenset(slices)), job.mesh_fn)
            shardings = job.shardings(mesh)
            if state is None:
                state = jax.jit(job.init_fn, out_shardings=shardings)(jax.random.key(job.config.seed))
            else:
                state = jax.device_put(state, shardings)
            current = slices
        state = step_fn(state, step, mesh)
    return jax.block_until_ready(state)


class ReferenceProcess:
    """One plain process of the multi-process reference (a Ray actor, set up like a worker)."""

    def __init__(self, env: dict[str, str]) -> None:
        from elastic.runtime import distributed

        distributed.setup_process(env)

    def run(
        self,
        address: str,
        size: int,
        index: int,
        host_state: Any,
        abstract: Any,
        shardings_fn: Any,
        mesh_fn: Any,
        steps: list[int],
        step_fn: Callable[[Any, int, Mesh], Any],
    ) -> Any:
        from jax.experimental import multihost_utils

        from elastic.runtime import distributed

        distributed.reform(address, size, index)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = runtime.build_mesh(
            [runtime.Slice(index=p, devices=tuple(d for d in devices if d.process_index == p)) for p in range(size)],
            mesh_fn,
        )
        from elastic.loop.shardings import state_shardings

        shardings = state_shardings(abstract, shardings_fn, mesh)
        state = jax.tree_util.tree_map(lambda x, s: _place(x, s), host_state, shardings)
        for step in steps:
            state = step_fn(state, step, mesh)
        out = jax.tree_util.tree_map(lambda x: _host(x, multihost_utils), state)
        del state
        distributed.leave()
        return out


def _place(x: Any, sharding: Any) -> Any:
    if isinstance(x, _Key):
        return jax.random.wrap_key_data(jax.device_put(x.data, sharding), impl=x.impl)
    return jax.device_put(x, sharding)


class _Key:
    """A typed PRNG key on the host: its key data and impl."""

    def __init__(self, data: Any, impl: str) -> None:
        self.data, self.impl = data, impl


def _host(x: Any, multihost_utils: Any) -> Any:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return _Key(multihost_utils.process_allgather(jax.random.key_data(x), tiled=True), str(jax.random.key_impl(x)))
    return multihost_utils.process_allgather(x, tiled=True)


def run_reference_processes(job: ElasticJob, placements: Placements, step_fn: Callable[[Any, int, Mesh], Any]) -> Any:
    """:func:`run_reference` for a multi-process job: each stretch of steps on one slice set runs in that many plain
    processes joined by ``jax.distributed`` (a new group per stretch, in processes kept across stretches); the final
    state on the host (typed keys wrapped back)."""
    import ray

    from elastic.control.cluster import connect
    from elastic.runtime import distributed

    connect()
    steps = range(job.config.num_steps)
    missing = [s for s in steps if s not in placements.slices]
    if missing:
        raise ValueError(f"placements lack steps {missing[:5]}...: record them with on_step=Placements()")
    stretches: list[tuple[tuple[int, ...], list[int]]] = []
    for step in steps:
        if not stretches or stretches[-1][0] != placements.slices[step]:
            stretches.append((placements.slices[step], []))
        stretches[-1][1].append(step)
    cfg = job.config
    env = distributed.collective_env(
        cfg.devices_per_slice, collective_timeout_s=cfg.processes.collective_timeout_s if cfg.processes else 5
    )
    remote: Any = ray.remote(ReferenceProcess).options(num_cpus=0, max_restarts=0)
    init = jax.jit(job.init_fn)(jax.random.key(cfg.seed))
    abstract = jax.eval_shape(job.init_fn, jax.random.key(cfg.seed))
    host = jax.tree_util.tree_map(
        lambda x: (
            _Key(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x)))
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else np.asarray(x)
        ),
        init,
    )
    # One process per slice position, kept across stretches: each stretch's group is re-formed in them (as the
    # workers re-form in place), so a stretch costs a group, not a process start and jax import per slice.
    pool = [remote.remote(env) for _ in range(max(len(slices) for slices, _ in stretches))]
    try:
        for slices, stretch in stretches:
            service = distributed.CoordinationService(len(slices), host=ray.util.get_node_ip_address())
            try:
                outs = ray.get(
                    [
                        a.run.remote(
                            service.address,
                            len(slices),
                            i,
                            host,
                            abstract,
                            job.shardings_fn,
                            job.mesh_fn,
                            stretch,
                            step_fn,
                        )
                        for i, a in enumerate(pool[: len(slices)])
                    ],
                    timeout=600,
                )
            finally:
                service.stop()
            host = outs[0]
    finally:
        for actor in pool:
            ray.kill(actor, no_restart=True)
    return jax.tree_util.tree_map(
        lambda x: jax.random.wrap_key_data(x.data, impl=x.impl) if isinstance(x, _Key) else x,
        host,
        is_leaf=lambda x: isinstance(x, _Key),
    )
