"""The pool demo: two multi-process jobs share a pool of slices by priority (``elastic demo --scenario pool``).

A pool of ``pool_size`` slices of one CPU device each (:mod:`elastic.pool`, started by the demo, which is its
operator). Job ``low`` (priority 0, ``min_slices`` 1) starts on all of them. At its step ``high_at`` job ``high``
(priority 10, ``high_slices`` slices, ``spares=1``) arrives: the pool reclaims slices from ``low`` by notice, ``low``
leaves them at a step boundary (nothing recomputed) and runs on the rest, and ``high`` starts on them. At ``high``'s
step ``kill_at`` one of its workers is SIGKILLed: ``high`` re-forms on the others and reports the slice failed to the
pool, which swaps in one of ``low``'s slices (a hot swap, by notice again); ``high`` grows onto it. The demo then
marks the killed slice returned (as the operator does once its host is repaired: ``elastic pool mark``), and the
pool lends it to ``low``. When ``high`` ends, ``low`` grows back onto every slice.

Both jobs train the demo MLP (:mod:`elastic.demos.demo`) on a global batch of ``BATCH`` rows (it splits over every
slice count from 1 to 5), in the same driver process (a thread each). A step takes at least ``pace_s`` times the
job's full slice count over the slices it runs on: the same global batch over fewer devices takes longer. With
``verify`` each job's final parameters are compared with a plain jax + optax run of the same steps.
"""

from __future__ import annotations

import getpass
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import ray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic.api.job import ElasticJob, JobResult
from elastic.config import ElasticConfig, Policy, Processes, Tiers
from elastic.demos.demo import batch, init_state, max_abs_diff, train_step
from elastic.demos.pacing import Pace, paced_loop
from elastic.errors import ConfigError, ElasticError
from elastic.log import get_logger
from elastic.ops.pool import end_own_pool, own_pool

__all__ = ["BATCH", "PoolDemoSpec", "run_pool_demo", "scaled", "summary"]

BATCH = 60  # splits over 1, 2, 3, 4 and 5 devices
BOUND_S = 180.0  # the longest the demo waits for any one thing
_log = get_logger("elastic.demos.pool")


@dataclass(frozen=True, kw_only=True)
class PoolDemoSpec:
    steps: int = 150  # low's
    high_steps: int = 60
    pool_size: int = 5
    high_slices: int = 3
    high_at: int = 10  # low's step at which high arrives
    kill_at: int = 8  # high's step at which one of its workers is SIGKILLed
    kill_slice: int = 1  # high's number of the slice killed
    pace_s: float = 0.2
    snapshot_every: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pool_size < self.high_slices + 2:
            raise ConfigError(
                f"the pool demo needs at least {self.high_slices + 2} slices (high's {self.high_slices}, and 2 for low "
                f"to give one up for the hot swap); got {self.pool_size}: raise --slices"
            )
        if not 0 <= self.kill_slice < self.high_slices or not 0 < self.kill_at < self.high_steps - 10:
            raise ConfigError(
                f"the pool demo kills one of high's {self.high_slices} slices (0..{self.high_slices - 1}; got "
                f"{self.kill_slice}) at one of its steps 1..{self.high_steps - 11} (got {self.kill_at}), so that it "
                "has steps left to grow back on the spare"
            )


def scaled(pace_s: float, full: int) -> Pace:
    """A step takes at least ``pace_s * full / slices``: the same global batch over fewer devices takes longer."""
    return lambda run: pace_s * full / max(1, len(run.slices))


def _config(spec: PoolDemoSpec, pool: str, name: str) -> ElasticConfig:
    high = name == "high"
    slices = spec.high_slices if high else spec.pool_size
    return ElasticConfig(
        job_name=name,
        simulated=True,
        num_slices=slices,
        devices_per_slice=1,
        num_steps=spec.high_steps if high else spec.steps,
        snapshot_every=spec.snapshot_every,
        seed=spec.seed,
        policy=Policy(min_slices=2 if high else 1, repair_timeout_s=60.0),
        tiers=Tiers(keeper_every=0),  # the survivors' host snapshots are enough here; fewer processes on a laptop
        processes=Processes(standby=False),
        pool=pool,
        priority=10 if high else 0,
        min_slices=2 if high else 1,
        spares=1 if high else 0,
    )


def reference_params(steps: int, devices: int, seed: int = 0) -> Any:
    """The same training without the library: a plain jax + optax loop over this process's first ``devices`` CPU
    devices, the batch split over them."""
    local = jax.devices()
    if len(local) < devices:
        raise ElasticError(f"the reference needs {devices} devices in the driver, it has {len(local)}")
    mesh = Mesh(np.array(local[:devices]), ("d",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    state = jax.jit(init_state, out_shardings=replicated)(jax.random.key(seed))
    step_fn = jax.jit(train_step)
    for step in range(steps):
        state, _ = step_fn(state, jax.device_put(batch(step, BATCH), rows))
    return jax.device_get(state["params"])


def _wait(predicate: Callable[[], Any], what: str, failed: Callable[[], str | None]) -> None:
    """Until ``predicate()`` (bounded: ``ElasticError`` past ``BOUND_S``, or at once when a job failed)."""
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        why = failed()
        if why is not None:
            raise ElasticError(f"pool demo: a job ended while waiting for {what}: {why}")
        if time.monotonic() > deadline:
            raise ElasticError(f"pool demo: {what} did not happen within {BOUND_S:g} s")
        time.sleep(0.05)


class _Job:
    """One of the demo's jobs, run on a thread of its own."""

    def __init__(self, spec: PoolDemoSpec, pool: str, name: str) -> None:
        self.config = _config(spec, pool, name)
        self.steps = 0
        self.job = ElasticJob(self.config, init_fn=init_state, on_step=self._on_step)
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        self._loop = paced_loop(scaled(spec.pace_s, self.config.num_slices), BATCH)
        self.thread = threading.Thread(target=self._run, name=f"pool-demo-{name}", daemon=True)

    def _on_step(self, step: int, metrics: Any, run: Any) -> None:
        self.steps = step + 1

    def _run(self) -> None:
        try:
            with self.job:
                self.result = self.job.run(self._loop)
        except BaseException as err:  # noqa: BLE001 - the demo's driver reports it
            self.error = err
            _log.error("pool_demo_job_failed", job=self.config.job_name, error=str(err)[:4000])

    def active(self) -> int:
        """The slices in the job's current view (0 before it started)."""
        try:
            return len(ray.get(self.job.group.supervisor.view.remote(), timeout=10).active)
        except Exception:  # noqa: BLE001 - not started yet, or closed meanwhile
            return 0

    def failed(self) -> str | None:
        if self.error is not None:
            return f"{self.config.job_name}: {type(self.error).__name__}: {str(self.error).splitlines()[0][:300]}"
        if not self.thread.is_alive() and self.result is None and self.thread.ident is not None:
            return f"{self.config.job_name} ended without a result"
        return None


def run_pool_demo(spec: PoolDemoSpec, *, verify: bool = False) -> dict[str, Any]:
    """Run the demo on the connected Ray cluster; the JSON-ready report (``jobs``: each job's report)."""
    started = time.monotonic()
    name, user = f"demo-{os.getpid()}", getpass.getuser()
    op, credentials = own_pool(name, spec.pool_size, [user])
    saved = {k: os.environ.get(k) for k in ("ELASTIC_POOL_USER", "ELASTIC_POOL_TOKEN")}
    os.environ.update(ELASTIC_POOL_USER=user, ELASTIC_POOL_TOKEN=credentials[user])  # what the jobs read
    marks: list[dict[str, Any]] = []
    low, high = _Job(spec, name, "low"), _Job(spec, name, "high")
    try:
        failed = lambda: low.failed() or high.failed()  # noqa: E731 - one line, used at every wait
        low.thread.start()
        _wait(lambda: low.steps >= spec.high_at and low.active() == spec.pool_size, "low on every slice", failed)
        marks.append(_mark("high_arrives", started, low_step=low.steps))
        high.thread.start()
        _wait(lambda: high.steps >= spec.kill_at, f"high's step {spec.kill_at}", failed)
        pid, _ = ray.get(high.job.group.agent(spec.kill_slice).where.remote(), timeout=30)
        os.kill(pid, signal.SIGKILL)
        marks.append(_mark("high_worker_killed", started, high_step=high.steps, pid=pid))
        _wait(lambda: op.call("status")["failed"], "high to report its slice failed", failed)
        (killed,) = op.call("status")["failed"]
        _wait(lambda: _decided(op, "to high", after=f"slice {killed} failed"), "the spare lent to high", failed)
        op.call("slice_returned", killed)  # its host repaired: the operator says so (the pool lends it at once)
        marks.append(_mark("slice_returned", started, slice=killed))
        high.thread.join(timeout=BOUND_S)
        marks.append(_mark("high_ended", started, low_step=low.steps))
        low.thread.join(timeout=BOUND_S)
        why = failed()
        if why is not None or low.result is None or high.result is None:
            raise ElasticError(f"pool demo: {why or 'a job did not finish in time'}")
        records = op.call("events")
    except BaseException:
        for j in (low, high):  # a failed demo ends its jobs (each saves at a step boundary, then returns)
            j.job.stop("the pool demo failed")
            if j.thread.ident is not None:
                j.thread.join(timeout=60)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        end_own_pool(op, name)
    out: dict[str, Any] = {
        "scenario": "pool",
        "pool": {"name": name, "slices": spec.pool_size, "killed_slice": killed},
        "jobs": {j.config.job_name: _report(j) for j in (low, high)},
        "timeline": _timeline(records, marks, started),
        "wall_seconds": round(time.monotonic() - started, 2),
    }
    if verify:
        for j in (low, high):
            assert j.result is not None
            params = reference_params(j.config.num_steps, j.config.num_slices, spec.seed)
            report = out["jobs"][j.config.job_name]
            report["reference"] = f"plain jax + optax, {j.config.num_slices} CPU devices, no failure, same batches"
            report["max_abs_param_diff_vs_reference"] = max_abs_diff(j.result.state["params"], params)
    return out


def _decided(op: Any, text: str, *, after: str) -> bool:
    """Whether the pool decided something whose reason has ``text``, after a decision whose reason has ``after``."""
    reasons = [r["reason"] for r in op.call("events") if r.get("kind") == "decision"]
    first = next((i for i, r in enumerate(reasons) if after in r), None)
    return first is not None and any(text in r for r in reasons[first:])


def _mark(event: str, started: float, **detail: Any) -> dict[str, Any]:
    return {"t": round(time.monotonic() - started, 2), "wall": time.time(), "event": event, **detail}


def _report(job: _Job) -> dict[str, Any]:
    assert job.result is not None
    out = job.result.report.to_dict()
    out["seconds_below_asked"] = out.get("pool", {}).get("seconds_below_asked")
    return out


def _timeline(records: list[dict[str, Any]], marks: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    """The pool's decisions and the demo's own marks, in order, seconds from the demo's start."""
    wall0 = time.time() - (time.monotonic() - started)
    events = [
        {"t": round(r["wall"] - wall0, 2), "event": "pool", "reason": r["reason"]}
        for r in records
        if r.get("kind") == "decision"
    ]
    events += [{k: v for k, v in m.items() if k != "wall"} for m in marks]
    return sorted(events, key=lambda e: e["t"])


def summary(out: dict[str, Any]) -> list[str]:
    """A few lines of the demo's result, one per job, then the pool's decisions."""
    lines = []
    for name, r in out["jobs"].items():
        diff = r.get("max_abs_param_diff_vs_reference")
        lines.append(
            f"{name}: {r['steps_committed']} steps, slices {r['slices_initial']} -> {r['min_slices_seen']} at least -> "
            f"{r['slices_final']}; notices {r['notices']}, recoveries {r['recoveries']}, steps recomputed "
            f"{r['steps_recomputed']}, below its asked count {r['seconds_below_asked']} s"
            + ("" if diff is None else f", max |param - reference| {diff:.2e}")
        )
    lines += [f"{e['t']:7.2f} s  {e.get('reason') or e['event']}" for e in out["timeline"]]
    return lines
