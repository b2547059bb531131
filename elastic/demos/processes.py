"""The multi-process demo: 4 slices as 4 worker processes (2 CPU devices each), one SIGKILLed mid-run.

The same :class:`~elastic.ElasticJob` and loop as single-process mode, with ``ElasticConfig(processes=...)``: the
demo MLP (adam, ``batch(step, 48)``: 48 rows split over 8 or 6 devices) runs SPMD in every worker. At ``kill_at``
slice ``kill_slice``'s worker SIGKILLs itself (a real process death); the supervisor sees its agent die, the three
survivors' next collective fails, they re-form the ``jax.distributed`` group in place (same processes) over 6
devices and restore from their host snapshots (their own shards and the buddy copies of the lost one). A new
process for the lost slice is started at once (``Processes.replace_lost``) and joins at a step boundary, by
``revive_at`` at the latest, and the job ends on 4 workers again. With ``verify`` the final parameters are
compared with a reference: the same model and batches trained by a plain jax + optax loop (no library) in the
driver process over its CPU devices, every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic.api.job import ElasticJob
from elastic.chaos.faults import Faults
from elastic.config import ElasticConfig, Policy, Processes, Tiers
from elastic.demos.demo import batch, init_state, max_abs_diff, train_step
from elastic.loop.run import Run

__all__ = ["BATCH", "ProcessDemoSpec", "loop", "process_config", "reference_params", "run_process_demo"]

BATCH = 48  # splits over 8 and 6 devices


@dataclass(frozen=True, kw_only=True)
class ProcessDemoSpec:
    steps: int = 40
    num_slices: int = 4
    devices_per_slice: int = 2
    kill_slice: int = 1
    kill_at: int = 13
    revive_at: int | None = 27
    snapshot_every: int = 5
    keeper_every: int = 2
    seed: int = 0
    job_name: str = "demo-processes"


def loop(run: Run) -> Any:
    """The user's loop, as in single-process mode; it runs in every worker process."""
    state = run.state
    step_fn = run.jit(train_step, donate_argnums=0)
    for step in run.steps:
        state, loss = step_fn(state, run.shard_batch(batch(step, BATCH)))
        run.commit(state, loss=loss)
    return state


def process_config(spec: ProcessDemoSpec, **overrides: Any) -> ElasticConfig:
    base: dict[str, Any] = dict(
        job_name=spec.job_name,
        simulated=True,
        num_slices=spec.num_slices,
        devices_per_slice=spec.devices_per_slice,
        num_steps=spec.steps,
        snapshot_every=spec.snapshot_every,
        seed=spec.seed,
        policy=Policy(min_slices=max(1, spec.num_slices // 2), repair_timeout_s=60.0),
        tiers=Tiers(keeper_every=spec.keeper_every),
        processes=Processes(),
    )
    base.update(overrides)
    return ElasticConfig(**base)


def faults_of(spec: ProcessDemoSpec) -> Faults:
    faults = Faults().kill_slice(spec.kill_slice, at_step=spec.kill_at)
    if spec.revive_at is not None and spec.revive_at < spec.steps - 1:
        faults.revive_slice(spec.kill_slice, at_step=spec.revive_at)
    return faults


def reference_params(spec: ProcessDemoSpec, devices: int | None = None) -> tuple[Any, float]:
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
    assert loss is not None, "spec.steps must be positive"
    return jax.device_get(state["params"]), float(loss)


def run_process_demo(
    spec: ProcessDemoSpec, *, verify: bool = False, config: ElasticConfig | None = None, faults: Faults | None = None
) -> dict[str, Any]:
    """Run the demo in worker processes of the connected Ray cluster; the JSON-ready report."""
    start = time.monotonic()
    job = ElasticJob(config or process_config(spec), init_fn=init_state, faults=faults or faults_of(spec))
    with job:
        result = job.run(loop)
    report = result.report.to_dict()
    report["job_seconds"] = round(time.monotonic() - start, 2)
    if verify:
        params, final_loss = reference_params(spec)
        report["reference"] = (
            f"plain jax + optax in the driver process, {spec.num_slices * spec.devices_per_slice} "
            "CPU devices, no failure, same batches"
        )
        report["reference_final_loss"] = final_loss
        report["max_abs_param_diff_vs_reference"] = max_abs_diff(result.state["params"], params)
    return report
