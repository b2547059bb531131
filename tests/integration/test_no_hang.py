"""Promise 4: every fault ends in recovery or a clear error within a bounded time."""

from __future__ import annotations

import time

import pytest
import ray

from elastic import Faults, GiveUpError, Policy
from elastic.control.watcher import ViewWatcher
from elastic.supervision.membership import View

from .helpers import ledger_job, silence

pytestmark = pytest.mark.integration


def _view_change_after(job, fault, bound_s: float) -> tuple[View, float]:
    """Run ``fault``, then wait (bounded) for the supervisor's next view; return it and the time taken."""
    sup = job.group.supervisor
    first = ray.get(sup.view.remote(), timeout=10)
    t0 = time.monotonic()
    fault()
    view = ray.get(sup.wait_for_epoch.remote(first.epoch, bound_s), timeout=bound_s + 10)
    return view, time.monotonic() - t0


def test_dead_agent_is_noticed_at_once(ray_local):
    job, _ = ledger_job("dead-agent")
    with job:
        view, _took = _view_change_after(job, lambda: job.group.kill_agent(2), bound_s=10)
        events = job.group.events()
    assert view.active == frozenset({0, 1, 3}), view
    assert "lost slice(s) 2" in view.reason
    (lost,) = [e for e in events if e["kind"] == "health" and e["slice"] == 2 and not e["healthy"]]
    assert "agent died" in lost["cause"], lost  # the lifeline fired, not a heartbeat timeout


def test_silent_agent_is_dropped_after_heartbeat_timeout(ray_local):
    job, _ = ledger_job("silent-agent")
    with job:
        view, took = _view_change_after(
            job, lambda: ray.get(job.group.agent(3).silence.remote(), timeout=10), bound_s=10
        )
        events = job.group.events()
    assert view.active == frozenset({0, 1, 2}), view
    (lost,) = [e for e in events if e["kind"] == "health" and e["slice"] == 3 and not e["healthy"]]
    assert silence(lost["cause"]) <= 2 * job.config.heartbeat_timeout_s, lost  # as the supervisor counts it
    assert took < 4 * job.config.heartbeat_timeout_s  # and in the test's time, with room for a busy machine


def test_training_recovers_from_silent_agent(ray_local):
    def hold_until_view_changes(step, metrics, run):
        if step == 10:  # let the supervisor's heartbeat timeout happen mid-run (bounded wait on the event)
            ray.get(job.group.supervisor.wait_for_epoch.remote(run.epoch, 15), timeout=30)

    job, loop = ledger_job(
        "silent-train", Faults().silence_agent(2, at_step=4), num_steps=60, on_step=hold_until_view_changes
    )
    with job:
        result = job.run(loop)
    r = result.report
    assert r.slices_final == 3 and r.min_slices_seen == 3 and r.steps_committed == 60
    assert r.duplicate_steps == 0 and r.skipped_steps == 0


def test_too_few_slices_gives_up_with_clear_error(ray_local):
    cfg_policy = Policy(min_slices=4, repair_timeout_s=1.0)
    job, loop = ledger_job("give-up", Faults().kill_slice(0, at_step=3), policy=cfg_policy, recovery_timeout_s=20.0)
    t0 = time.monotonic()
    with job, pytest.raises(GiveUpError) as info:
        job.run(loop)
    assert time.monotonic() - t0 < 20.0
    assert "min_slices=4" in str(info.value) and "repair_timeout_s=1.0" in str(info.value)
    # Nothing saved is lost: the snapshot taken before the failure is intact.
    assert job.latest_snapshot().step == 0


def test_view_wait_is_bounded(ray_local):
    """A wait for a view that never comes ends in RecoveryTimeoutError, not a hang."""
    from elastic.errors import RecoveryTimeoutError

    class NeverChanges:
        class wait_for_epoch:
            @staticmethod
            def remote(after, timeout_s):
                return ray.put(View(epoch=after))

    watcher = ViewWatcher(NeverChanges(), View(epoch=1, active=frozenset({0})), job="t", poll_s=0.05)
    try:
        t0 = time.monotonic()
        with pytest.raises(RecoveryTimeoutError, match="within 0.3s"):
            watcher.wait_for(lambda v: v.epoch > 1, 0.3, what="a new epoch")
        assert time.monotonic() - t0 < 5
    finally:
        watcher.stop()


def test_persistent_slice_loss_errors_on_healthy_slices_end_in_a_clear_error(ray_local):
    import jax

    from elastic import ElasticError

    job, _ = ledger_job("persistent", max_transient_retries=2)
    attempts = []

    def loop(run):
        for step in run.steps:
            if step == 3:
                attempts.append(run.start_step)
                raise jax.errors.JaxRuntimeError("UNAVAILABLE: collective timed out")
            run.commit(run.state)

    with job, pytest.raises(ElasticError, match="persist with every slice healthy after 2 retries"):
        job.run(loop)
    # The first try; a retry from the snapshot at step 0; a retry from the snapshot that the first commit after
    # a restore takes (so every piece regains its copies), at step 1.
    assert attempts == [0, 0, 1]
    assert job.report.recoveries == 2
