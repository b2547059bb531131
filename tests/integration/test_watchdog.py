"""Promise 4 for hangs: a step that makes no progress within ``step_timeout_s`` ends in recovery (or a clear
error past the retries) within a bounded time, never a silent stall; a slow but progressing first step does
not trip it."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from elastic import ElasticError, Faults, Run
from elastic.runtime import hangs

from .helpers import ledger_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEP_TIMEOUT_S = 2.0
MARGIN_S = 8.0  # detection to the first step after recovery: probe, restore, one step (2 busy cores)


def _at(job, event: str, **match) -> float:
    """The time (s since the job started) of the first timeline event named ``event`` matching ``match``."""
    for e in job.timeline.events:
        if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
            return e["t"]
    raise AssertionError(f"no {event} {match} in {job.timeline.events}")


def _exactly_once(job, result) -> None:
    n = job.config.num_steps
    np.testing.assert_array_equal(np.asarray(result.state["applied"]), np.ones(n, np.int32))
    np.testing.assert_array_equal(np.asarray(result.state["batch_of"]), np.arange(n, dtype=np.int32))
    assert job.ledger.steps == list(range(n)) and job.ledger.batches == list(range(n))
    r = result.report
    assert (r.duplicate_steps, r.skipped_steps, r.steps_committed) == (0, 0, n)


def _hang_figures(job) -> tuple[float, float]:
    """From the timeline: the hang to the watchdog's failure, and the hang to the first step after recovery."""
    hung = _at(job, "inject_hang")
    failed = _at(job, "failure")
    return failed - hung, _at(job, "first_step") - hung


def test_a_hung_step_with_every_slice_healthy_is_retried_from_the_snapshot(ray_local):
    job, loop = ledger_job(
        "hang-transient", Faults().hang_step(at_step=12), num_steps=25, step_timeout_s=STEP_TIMEOUT_S
    )
    with job:
        result = job.run(loop)
    _exactly_once(job, result)
    r = result.report
    assert r.recoveries == 1 and r.slices_final == 4 and r.min_slices_seen == 4 and r.failures_injected == 1
    failure = next(e for e in job.timeline.events if e["event"] == "failure")
    assert failure["error"].startswith("StepHungError: step 12 made no progress in 2s"), failure
    restored = next(e for e in job.timeline.events if e["event"] == "restored")
    assert restored["step"] == 10 and restored["slices"] == 4  # the same view: a transient retry
    detect_s, recover_s = _hang_figures(job)
    assert STEP_TIMEOUT_S <= detect_s < STEP_TIMEOUT_S + 2.0, job.timeline.events
    assert recover_s < STEP_TIMEOUT_S + MARGIN_S, job.timeline.events
    assert hangs.blocked() == 0  # the hung callback was released: no thread stays blocked


def test_a_step_hung_on_a_wedged_slice_shrinks_without_it(ray_local):
    job, loop = ledger_job(
        "hang-wedged", Faults().hang_step(at_step=12, slice=1), num_steps=25, step_timeout_s=STEP_TIMEOUT_S
    )
    with job:
        result = job.run(loop)
        events = job.group.events()
    _exactly_once(job, result)
    r = result.report
    assert r.recoveries == 1 and r.slices_final == 3 and r.min_slices_seen == 3
    # The probe found slice 1 wedged (its agent still beats) and the client reported it to the supervisor.
    assert any(e["kind"] == "health" and e["slice"] == 1 and "client report" in e["cause"] for e in events)
    detect_s, recover_s = _hang_figures(job)
    assert STEP_TIMEOUT_S <= detect_s < STEP_TIMEOUT_S + 2.0, job.timeline.events
    assert recover_s < STEP_TIMEOUT_S + MARGIN_S, job.timeline.events


def test_a_step_that_hangs_every_time_ends_in_a_clear_error(ray_local):
    job, _ = ledger_job("hang-persistent", max_transient_retries=2, step_timeout_s=1.0)
    hung_at = []

    @jax.jit
    def step_fn(state):
        return {**state, "w": state["w"] + 1}

    def loop(run: Run):
        state = run.state
        step = run.jit(step_fn)
        for i in run.steps:
            if i == 3:  # a collective that deadlocks every time step 3 runs
                hung_at.append(run.start_step)
                hangs.arm()
            state = step(state)
            run.commit(state)
        return state

    t0 = time.monotonic()
    with job, pytest.raises(ElasticError) as info:
        job.run(loop)
    message = str(info.value)
    assert "hung steps persist with every slice healthy after 2 retries" in message
    assert "step 3 made no progress in 1s" in message and "step_timeout_s=1.0" in message
    assert hung_at == [0, 0, 1] and job.report.recoveries == 2
    assert time.monotonic() - t0 < 60.0
    assert hangs.blocked() == 0


def test_a_slow_but_progressing_first_step_is_not_a_hang(ray_local):
    """Compiling the first step takes longer than step_timeout_s (compile time is not counted) and running it
    takes longer too (the first step of a pass gets FIRST_STEP_FACTOR x the time): no failure."""
    job, _ = ledger_job("slow-first-step", num_steps=6, step_timeout_s=1.0)
    slow = {"trace_s": 2.0, "run_s": 1.5}  # each spent once

    def device_work(token):
        time.sleep(slow.pop("run_s", 0.0))  # the first execution's device time: 1.5 x step_timeout_s
        return token

    @jax.jit
    def step_fn(state):
        time.sleep(slow.pop("trace_s", 0.0))  # runs while tracing: compiling takes 2 x step_timeout_s
        token = io_callback(device_work, jax.ShapeDtypeStruct((), jnp.int32), jnp.int32(0))
        return {**state, "w": jax.lax.optimization_barrier((token, state["w"] + 1))[1]}

    committed = []

    def loop(run: Run):
        state = run.state
        step = run.jit(step_fn)
        for i in run.steps:
            t0 = time.monotonic()
            state = step(state)
            run.commit(state)
            committed.append((i, time.monotonic() - t0))
        return state

    with job:
        result = job.run(loop)
    r = result.report
    assert r.recoveries == 0 and r.steps_committed == 6
    assert not [e for e in job.timeline.events if e["event"] == "failure"], job.timeline.events
    # compile + first execution, three times the step timeout, and no hang: the first step is waited for by its own
    # commit or (steps_in_flight=2) by the next one, with the first step's bound either way
    assert committed[0][1] + committed[1][1] > 3.0, committed
    assert [i for i, _ in committed] == list(range(6))


def test_a_loop_that_donates_its_state_stays_within_its_steps_in_flight_and_is_not_hung(ray_local):
    """A loop that donates its state and commits nothing else keeps at most ``steps_in_flight`` steps ahead of its
    devices: the step before's donated state leaves a tiny marker to wait on. Before, nothing was left and the loop
    ran ahead up to the next snapshot (on these CPU devices, 60 steps ahead aborted the process in XLA's collective
    rendezvous), so the window the config promises did not hold. Each wait gets one step's ``step_timeout_s``, and
    no step here is near it: no false alarm."""
    job, _ = ledger_job("run-ahead", num_steps=12, snapshot_every=10, step_timeout_s=2.0)
    dispatched = [0]
    beyond: list[int] = []  # per step, as its result is computed: how many later steps the loop had dispatched

    def seen(k, _):
        beyond.append(dispatched[0] - 1 - int(k))
        return np.int32(0)

    @jax.jit
    def heavy(state, k):  # 0.1-0.25 s of device time on these 2 cores: well under 2 s, even beside other tests
        m = jnp.tile(state["w"], (64,))
        a = jnp.outer(m, m) * 1e-3
        for _ in range(3):
            a = jnp.tanh(a @ a)
        done = io_callback(seen, jax.ShapeDtypeStruct((), jnp.int32), k, a.sum())
        return {**state, "w": state["w"] + 0 * a.sum() + 0 * done}

    def loop(run: Run):
        state = run.state
        step = run.jit(heavy, donate_argnums=0)
        for k in run.steps:
            dispatched[0] += 1
            state = step(state, k)
            run.commit(state)
        return state

    with job:
        result = job.run(loop)
    r = result.report
    assert (r.failures_injected, r.recoveries, r.steps_committed, r.steps_recomputed) == (0, 0, 12, 0)
    assert not [e for e in job.timeline.events if e["event"] == "failure"]
    assert len(beyond) == 12 and max(beyond) <= job.config.in_flight - 1, beyond  # before: up to 8 (to the snapshot)
    assert beyond.count(1) >= 5, beyond  # and the loop did dispatch the next step while one computed
