"""The demo's loop with a pace: each step takes at least as long as a function of the run says.

Demos and tests that act on a job while it trains (a signal, a drain, a pool's reclaim, a node going down) need
steps long enough for the action to land between two of them, and slower steps while the job runs short of slices,
so that a new worker can start before the run ends. ``pace(run)`` gives the least seconds of the step about to end
(``run.slices``, ``run.epoch``: what the pace may depend on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Pace", "degraded", "paced_loop"]

Pace = Callable[[Any], float]  # (run) -> the least seconds of a step


def paced_loop(pace: Pace | float, rows: int | None = None) -> Callable[[Any], Any]:
    """The demo's loop (the demo MLP with adam, ``rows`` rows a step; None: the multi-process demo's batch), each
    step taking at least ``pace(run)`` seconds (a number: that many, always)."""
    from elastic.demos.demo import batch, train_step
    from elastic.demos.processes import BATCH

    least: Pace = pace if callable(pace) else (lambda run: float(pace))
    size = BATCH if rows is None else rows

    def loop(run: Any) -> Any:
        state = run.state
        step_fn = run.jit(train_step, donate_argnums=0)
        for step in run.steps:
            started = time.monotonic()
            state, loss = step_fn(state, run.shard_batch(batch(step, size)))
            run.commit(state, loss=loss)
            time.sleep(max(0.0, least(run) - (time.monotonic() - started)))
        return state

    return loop


def degraded(pace_s: float, degraded_s: float, slices: int) -> Pace:
    """``pace_s`` a step, or ``degraded_s`` while the job runs on fewer than ``slices`` slices."""
    return lambda run: degraded_s if len(run.slices) < slices else pace_s
