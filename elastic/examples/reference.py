"""The examples' ``--verify``: the same training without the library, on the same devices at the same steps.

``Placements`` is an ``on_step`` callback: it records, for each committed step of the final lineage, the
slices the step ran on (a step recomputed after a restore overwrites its entry). ``run_reference`` then
trains from the same seed in a plain loop: the state is initialised on the mesh of step 0, moved with
``jax.device_put`` onto the mesh of each step whose slices differ from the previous step's, and advanced by
``step_fn(state, step, mesh)``, the example's own step without any of ``elastic``. Moving and restoring
are exact copies, so the elastic run and the reference agree bit for bit when the step is deterministic.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

import runtime
from elastic.api.job import ElasticJob
from elastic.api.run import Run

__all__ = ["Placements", "run_reference"]


class Placements:
    """``on_step`` callback: ``slices[step]`` is what the committed step ran on."""

    def __init__(self) -> None:
        self.slices: dict[int, tuple[int, ...]] = {}

    def __call__(self, step: int, metrics: dict[str, Any], run: Run) -> None:
        self.slices[step] = run.slices

    def moves(self) -> int:
        """How many times the slice set changed along the lineage."""
        steps = sorted(self.slices)
        return sum(self.slices[a] != self.slices[b] for a, b in zip(steps, steps[1:]))


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
            mesh = runtime.build_mesh(topology.select(frozenset(slices)), job._mesh_fn)  # noqa: SLF001
            shardings = job._shardings(mesh)  # noqa: SLF001 - the job's own, so the reference places alike
            if state is None:
                state = jax.jit(job._init_fn, out_shardings=shardings)(jax.random.key(job.config.seed))  # noqa: SLF001
            else:
                state = jax.device_put(state, shardings)
            current = slices
        state = step_fn(state, step, mesh)
    return jax.block_until_ready(state)
