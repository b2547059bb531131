"""The multi-process demo: 4 slices as 4 worker processes (2 CPU devices each), one SIGKILLed mid-run.

The demo MLP of :mod:`elastic.demos.demo` (adam, ``batch(step, 48)``: 48 rows split over 8 or 6 devices) runs SPMD in
every worker. At ``kill_at`` the driver SIGKILLs one worker's process; the three survivors' next collective
fails within the collective timeout, they re-form the ``jax.distributed`` group in place (same processes) over
6 devices and resume from their host snapshots. Then a new process is started for the lost slice and joins at
a step boundary (by ``revive_at``), and the job ends on 4 workers again. With ``verify`` the final
parameters are compared with a reference: the same model and batches trained by a plain jax + optax loop
(no library) in the driver process over its 8 CPU devices, every step.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic.config import Policy
from elastic.demos.demo import batch, init_state, max_abs_diff, train_step
from elastic.placements.mc_driver import McConfig, McDriver
from elastic.placements.mc_run import McRun

__all__ = ["McDemoSpec", "ProcessFaults", "init_state", "loop", "reference_params", "run_mc_demo", "train_step"]

BATCH = 48  # splits over 8 and 6 devices


@dataclass(frozen=True, kw_only=True)
class McDemoSpec:
    steps: int = 40
    num_slices: int = 4
    devices_per_slice: int = 2
    kill_slice: int = 1
    kill_at: int = 13
    revive_at: int | None = 27
    snapshot_every: int = 5
    seed: int = 0


def loop(run: McRun) -> Any:
    """The user's loop, as in single-controller mode; it runs in every worker process."""
    state = run.state
    step_fn = run.jit(train_step)
    for step in run.steps:
        state, loss = step_fn(state, run.shard_batch(batch(step, BATCH)))
        run.commit(state, loss=loss)
    return state


class ProcessFaults:
    """A driver hook: SIGKILL slice ``kill_slice``'s process once the group reaches ``kill_at`` (or send it
    ``sig``: SIGSTOP hangs it), and start a new process for that slice right after, which joins the survivors at
    a step boundary once it is up, by ``revive_at`` at the latest."""

    def __init__(self, *, kill_slice: int, kill_at: int, revive_at: int | None, sig: int = signal.SIGKILL) -> None:
        self.kill_slice, self.kill_at, self.revive_at, self.sig = kill_slice, kill_at, revive_at, sig
        self.killed = self.revived = False

    def __call__(self, driver: McDriver, step: int) -> None:
        if not self.killed and step >= self.kill_at:
            self.killed = True
            driver.kill_worker(self.kill_slice, self.sig)
            if self.revive_at is not None:  # the host comes back at once; its new process takes seconds to start
                self.revived = True
                driver.add_slice(self.kill_slice, join_by=self.revive_at)


def reference_params(spec: McDemoSpec, devices: int | None = None) -> tuple[Any, float]:
    """The same training without the library: one process, a plain jax + optax loop over this process's first
    ``devices`` CPU devices (default: all of the job's), batch split over them, every step."""
    count = devices or spec.num_slices * spec.devices_per_slice
    local = jax.devices()
    if len(local) < count:
        raise RuntimeError(f"the reference needs {count} devices in the driver, it has {len(local)}")
    mesh = Mesh(np.array(local[:count]), ("d",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    state = jax.jit(init_state, out_shardings=replicated)(jax.random.key(spec.seed))
    step_fn = jax.jit(train_step)
    loss = None
    for step in range(spec.steps):
        state, loss = step_fn(state, jax.device_put(batch(step, BATCH), rows))
    return jax.device_get(state["params"]), float(loss)


def run_mc_demo(spec: McDemoSpec, *, verify: bool = False) -> dict[str, Any]:
    """Run the demo in worker processes of the connected Ray cluster; the JSON-ready report."""
    revive_at = spec.revive_at if spec.revive_at is not None and spec.revive_at < spec.steps else None
    config = McConfig(num_steps=spec.steps, num_slices=spec.num_slices, devices_per_slice=spec.devices_per_slice,
                      snapshot_every=spec.snapshot_every, seed=spec.seed, replace_lost=revive_at is not None,
                      policy=Policy(min_slices=max(1, spec.num_slices // 2), repair_timeout_s=60.0))
    faults = ProcessFaults(kill_slice=spec.kill_slice, kill_at=spec.kill_at, revive_at=revive_at)
    start = time.monotonic()
    with McDriver(config, init_fn=init_state, loop=loop, hooks=(faults,)) as driver:
        out = driver.run()
    report = out["report"]
    report["job_seconds"] = round(time.monotonic() - start, 2)
    if verify:
        params, final_loss = reference_params(spec)
        report["reference"] = (f"plain jax + optax in the driver process, {spec.num_slices * spec.devices_per_slice} "
                               "CPU devices, no failure, same batches")
        report["reference_final_loss"] = final_loss
        report["max_abs_param_diff_vs_reference"] = max_abs_diff(out["params"]["params"], params)
    return report
