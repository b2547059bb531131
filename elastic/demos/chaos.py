"""The chaos target ``elastic chaos`` uses without ``--target``: the demo model (elastic/demo.py) in a
plain optax loop wrapped as docs/getting-started.md shows, sized to run a schedule in a few seconds.

A target is a zero-argument function returning ``ElasticJob``'s keyword arguments plus ``loop``.
"""

from __future__ import annotations

from typing import Any

from elastic.config import ElasticConfig, Policy, Processes, Tiers
from elastic.demos.demo import batch, init_state, train_step
from elastic.loop.run import Run

__all__ = ["demo_target", "process_target"]


def _loop(run: Run) -> Any:
    state = run.state
    step_fn = run.jit(train_step)
    for step in run.steps:
        state, loss = step_fn(state, run.shard_batch(batch(step, 48)))  # 48 rows split over 4, 6 and 8 devices
        run.commit(state, loss=loss)
    return state


def demo_target() -> dict[str, Any]:
    """4 simulated slices of 2 devices, 40 steps, a snapshot every 5 steps, each also in the keepers (so two
    slices lost at once recover), at least 2 slices, a quick heartbeat timeout."""
    config = ElasticConfig(
        simulated=True,
        job_name="chaos-demo",
        num_slices=4,
        devices_per_slice=2,
        num_steps=40,
        snapshot_every=5,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=Policy(min_slices=2, repair_timeout_s=3.0),
        tiers=Tiers(keeper_every=1, keepers=1),
    )
    return {"config": config, "init_fn": init_state, "loop": _loop}


def process_target() -> dict[str, Any]:
    """The same job in multi-process mode (``elastic chaos --mode multi-process``): each slice a worker process,
    whose faults are real (SIGKILL, SIGSTOP)."""
    target = demo_target()
    target["config"] = ElasticConfig(
        simulated=True,
        job_name="chaos-processes",
        num_slices=4,
        devices_per_slice=2,
        num_steps=40,
        snapshot_every=5,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=Policy(min_slices=2, repair_timeout_s=3.0),
        tiers=Tiers(keeper_every=1, keepers=1),
        processes=Processes(settle_timeout_s=5.0),
    )
    return target
