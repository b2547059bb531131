"""The equivalence reference of one chaos schedule: the target's loop replayed over the device schedule the run
actually had, with nothing else of the library's failure path.

A run whose device count changes cannot match a failure-free run on its first devices bit for bit: a reduction
over 6 devices rounds differently from one over 8, and an optimizer such as adam turns that float noise in
near-zero gradients into steps of the learning rate's size (a BatchNorm model drifts by 1e-2). What the library
promises is that a failure changes nothing *but* the devices: each committed step computed once, on the batch it
would have had, from the state it would have had. So the reference replays the run's own schedule: step ``k``
on the slices that computed the committed step ``k`` (its last execution: a rolled-back one was recomputed), the
state moved between meshes as a live move would, in one pass per mesh through the target's own loop, with no
supervisor, snapshot, restore, fault or retry. The run must match it bit for bit.

:func:`trail_schedule` folds the commits a run made (recomputed ones included) into that schedule;
:func:`replay` runs it. Single-process mode: the replay needs the run's devices in this process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
from jax.sharding import Mesh

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.loop.run import LiveState, Regroup, Run
from elastic.supervision.membership import View

__all__ = ["replay", "trail_schedule"]


def trail_schedule(trail: Sequence[tuple[int, tuple[int, ...]]]) -> dict[int, tuple[int, ...]]:
    """Step -> the slices of its last execution, from every commit ``(step, slices)`` in the order it happened."""
    schedule: dict[int, tuple[int, ...]] = {}
    for step, slices in trail:
        schedule[step] = tuple(sorted(slices))
    return schedule


class _ReplayHost:
    """What :class:`~elastic.loop.run.Run` asks of its host, answered from a fixed schedule: a pass ends where
    the next step's slices differ (as a live move would), and nothing else happens."""

    def __init__(self, config: ElasticConfig, schedule: dict[int, tuple[int, ...]]) -> None:
        self.config, self.num_steps, self.seed = config, config.num_steps, config.seed
        self._schedule = schedule

    def before_step(self, step: int) -> None:
        pass

    def committed(self, run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None:
        pass

    def boundary(self, run: Run, next_step: int) -> Regroup | None:
        want = self._schedule.get(next_step, run.slices)
        if want == run.slices:
            return None
        return Regroup(
            View(epoch=run.epoch + 1, active=frozenset(want)),
            LiveState(state=run.state, next_step=next_step, extras=copy.deepcopy(run.extras)),
        )

    def record_call(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh) -> None:
        pass

    def must_confirm(self, step: int) -> bool:
        return True  # every step confirmed at its commit: the state at a boundary is the last step's


def replay(
    *,
    config: ElasticConfig,
    topology: runtime.Topology,
    schedule: dict[int, tuple[int, ...]],
    loop: Callable[[Run], Any],
    init_fn: Callable[[jax.Array], Any],
    shardings: Callable[[Mesh], Any],
    mesh_fn: runtime.MeshFn | None = None,
) -> Any:
    """The final state of ``loop`` run over ``schedule`` (every step 0..N-1 named) from ``init_fn``'s state."""
    missing = [s for s in range(config.num_steps) if s not in schedule]
    if missing:
        raise ValueError(f"the schedule names no slices for steps {missing[:5]}: only a finished run replays")
    host = _ReplayHost(config, schedule)
    view = View(epoch=1, active=frozenset(schedule[0]))
    state: Any = None
    start, extras = 0, cast(dict[str, Any], {})
    while True:
        mesh = runtime.build_mesh(topology.select(view.active), mesh_fn)
        target = shardings(mesh)
        if state is None:
            state = jax.jit(init_fn, out_shardings=target)(jax.random.key(config.seed))
        else:
            state = runtime.reshard(state, target)
        run = Run(host, view=view, mesh=mesh, state=state, start_step=start, extras=extras)
        try:
            loop(run)
            return run.state
        except Regroup as regroup:
            assert regroup.live is not None
            view, state = regroup.view, regroup.live.state
            start, extras = regroup.live.next_step, regroup.live.extras
