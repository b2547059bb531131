"""Notices: warned that a slice will go, the job leaves it at a step boundary and loses nothing (single-process)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray

from elastic import Faults, NoticeError, runtime

from .helpers import ledger_job, max_abs_diff

pytestmark = pytest.mark.integration

N = 32


def exactly_once(state, n: int = N) -> None:
    np.testing.assert_array_equal(np.asarray(state["applied"]), np.ones(n, np.int32))
    np.testing.assert_array_equal(np.asarray(state["batch_of"]), np.arange(n, dtype=np.int32))


def failure_free(name: str):
    job, loop = ledger_job(name, num_steps=N)
    with job:
        return job.run(loop).state


def test_a_notice_leaves_the_slice_at_a_step_boundary_and_recomputes_nothing(ray_local):
    """A notice for slice 1 as step 8 is committed: the job leaves it at the next boundary (live state moved, no
    failure, nothing recomputed); slice 1 dies later, out of the job, and comes back: the job grows onto it."""
    given: dict[str, int] = {}

    def on_step(step, metrics, run):
        if step == 8:
            given["step"] = step
            given["epoch"] = run.epoch
            # from another thread, as a scheduler's callback would (joined: the notice is in before the next step)
            caller = threading.Thread(target=job.notice, args=(1, 120.0, "host maintenance"))
            caller.start()
            caller.join()

    faults = Faults().kill_slice(1, at_step=16).revive_slice(1, at_step=22)
    job, loop = ledger_job("notice-leave", faults, on_step=on_step, num_steps=N)
    with job:
        result = job.run(loop)
        records = ray.get(job.group.supervisor.events.remote(), timeout=30)
    exactly_once(result.state)
    assert job.ledger.steps == list(range(N)) and job.ledger.batches == list(range(N))
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed) == (1, 1, 0, 0), r
    assert (r.duplicate_steps, r.skipped_steps, r.steps_committed) == (0, 0, N)
    assert r.grows == 1 and r.min_slices_seen == 3 and r.slices_final == 4
    assert not r.restores, r.restores  # left live, never restored from a snapshot
    (detail,) = r.notice_details
    assert detail["source"] == "api" and detail["slices"] == [1] and detail["planned"] is True
    assert detail["steps_recomputed"] == 0 and detail["lead_s"] == pytest.approx(120.0, abs=0.01)
    assert 0 < detail["running_on_rest_s"] < 60, detail
    left = next(e for e in job.timeline.events if e["event"] == "left")
    assert given["step"] < left["step"] <= given["step"] + job.config.in_flight + 1, (given, left)
    assert left["leaving"] == [1] and left["slices"] == 3
    # the stream: the notice, then a view leaving slice 1 (not a failure), later a grow onto its new agent
    kinds = [(e["kind"], e.get("decision")) for e in records if e["kind"] in ("notice", "view")]
    at = kinds.index(("notice", None))
    assert kinds[at + 1] == ("view", "Leave") and ("view", "Grow") in kinds[at + 2 :], kinds
    leave = next(e for e in records if e.get("decision") == "Leave")
    assert leave["leaving"] == [1] and leave["active"] == [0, 2, 3] and "leaving" in leave["reason"]
    assert not [e for e in records if e["kind"] == "health" and e["slice"] == 1 and "client" in e["cause"]]
    # the same parameters as a run in which nothing happened
    assert max_abs_diff(result.state, failure_free("notice-leave-ref")) < 1e-4


def test_a_notice_it_cannot_take_is_refused_in_one_line_and_the_job_goes_on(ray_local):
    refusals: list[str] = []

    def on_step(step, metrics, run):
        if step == 5:
            for slices, deadline_s in ((7, 30.0), (1, -1.0), (1, 0.0), ([], 30.0)):
                try:
                    job.notice(slices, deadline_s=deadline_s, reason="test")
                except NoticeError as err:
                    refusals.append(str(err))

    job, loop = ledger_job("notice-refused", on_step=on_step, num_steps=16)
    with job:
        result = job.run(loop)
        records = ray.get(job.group.supervisor.events.remote(), timeout=30)
    assert len(refusals) == 4, refusals
    assert all(len(r.splitlines()) == 1 and "notice" in r for r in refusals), refusals
    assert "does not hold slice(s) 7" in refusals[0] and "deadline has passed" in refusals[1], refusals
    exactly_once(result.state, 16)
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed, r.slices_final) == (0, 0, 0, 0, 4)
    refused = [e for e in records if e["kind"] == "notice_refused"]
    assert len(refused) == 1 and refused[0]["slices"] == [7], refused  # the others never left this process
    assert not [e for e in records if e["kind"] == "view" and e["decision"] != "Grow"]


def test_a_slice_that_dies_before_the_boundary_takes_the_failure_path(ray_local):
    """The notice comes, but slice 1 dies before the job could leave it: the failure path takes over, losing no
    more than a failure loses, and every step is still committed exactly once."""

    fired: list[int] = []

    def on_step(step, metrics, run):
        if step == 8 and not fired:  # once: step 8 is committed again after the restore
            fired.append(step)
            job.notice(1, deadline_s=60.0, reason="preemption")
            runtime.simulated.kill_slice(job.topology.slice(1))  # gone before the step boundary
            job.group.kill_agent(1)

    job, loop = ledger_job("notice-early-death", on_step=on_step, num_steps=N)
    with job:
        result = job.run(loop)
    exactly_once(result.state)
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.slices_final) == (1, 0, 1, 3), r
    assert r.steps_recomputed <= 4 and r.restores, r  # no more than the snapshot interval (5) less the step done
    (detail,) = r.notice_details
    assert detail["planned"] is False and detail["steps_recomputed"] == r.steps_recomputed, detail


def test_a_restarted_supervisor_still_knows_the_slice_is_leaving(ray_local):
    """The notice is in the stream: a supervisor restarted after it rebuilds the slice as leaving, and does not take
    it back when its (still living) agent registers again."""
    fired: list[int] = []

    def on_step(step, metrics, run):
        if step == 6 and not fired:
            fired.append(step)
            job.notice(2, deadline_s=300.0, reason="pool reclaims it")

    job, loop = ledger_job("notice-restart", Faults().restart_supervisor(at_step=12), on_step=on_step, num_steps=24)
    with job:
        result = job.run(loop)
        usage = ray.get(job.group.supervisor.usage.remote(), timeout=30)
        view = ray.get(job.group.supervisor.view.remote(), timeout=30)
    exactly_once(result.state, 24)
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed, r.slices_final) == (1, 1, 0, 0, 3), r
    assert usage["leaving"] == [2] and usage["notices"] == 1, usage
    assert 2 not in view.active and view.leaving == frozenset({2}), view


def test_a_boundary_past_the_deadline_takes_the_failure_path_and_loses_nothing(ray_local):
    """The deadline passes before the job reaches a step boundary: it never waits past it; the slice counts as gone,
    and the failure path restores the boundary's snapshot onto the rest (nothing recomputed)."""
    fired: list[float] = []

    def on_step(step, metrics, run):
        if step == 8 and not fired:
            notice = job.notice(1, deadline_s=0.2, reason="spot reclaim")
            fired.append(notice.deadline)
            while time.time() <= notice.deadline:  # the step in flight outlasts the deadline
                time.sleep(0.01)

    job, loop = ledger_job("notice-late", on_step=on_step, num_steps=N)
    with job:
        result = job.run(loop)
    exactly_once(result.state)
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed, r.slices_final) == (1, 0, 1, 0, 3), r
    (detail,) = r.notice_details
    assert detail["planned"] is False and detail["steps_recomputed"] == 0, detail
    failure = next(e for e in job.timeline.events if e["event"] == "failure")
    assert "deadline" in failure["error"] and "slice(s) 1" in failure["error"], failure
    (restore,) = r.restores
    assert restore["step"] > 8, restore  # the boundary's own snapshot
