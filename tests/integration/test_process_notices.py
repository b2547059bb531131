"""Notices in multi-process mode: a signal to one slice's worker process (as Kubernetes or Slurm send it before they
take a host) is a notice for that slice. The job leaves the slice at a step boundary (nothing recomputed, no failure
counted), the leaving worker leaves its group and exits 0 after the others have re-formed, and once the grace period
is over a new worker starts for the slice (its host stayed) and the job grows back. Bad notices are refused with one
line and the job runs on unharmed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray

from elastic import NoticeError
from elastic.api.job import ElasticJob
from elastic.config import NoticeSources, Processes, Tiers
from elastic.demos.demo import init_state, max_abs_diff
from elastic.demos.pacing import paced_loop
from elastic.demos.processes import ProcessDemoSpec, process_config, reference_params

pytestmark = pytest.mark.integration

N = 60
SIGNAL_AT = 6
GRACE_S = 4.0


def _gone(pid: int) -> bool:
    """The process ended (absent, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def _paced_until_grown(pace_s: float, degraded_s: float, slices: int):
    """Each step at least ``pace_s`` seconds (time for a signal to become a notice), ``degraded_s`` while the job
    runs on fewer than ``slices`` slices (time for the new worker to start), and no pace once it is whole again
    after a leave and a grow (epoch 3 or later: nothing left to wait for)."""
    return lambda run: degraded_s if len(run.slices) < slices else 0.0 if run.epoch >= 3 else pace_s


@pytest.mark.timeout(240)
def test_sigterm_to_a_worker_leaves_its_slice_at_a_step_boundary_and_it_exits_0(ray_local, tmp_path: Path) -> None:
    spec = ProcessDemoSpec(steps=N, num_slices=3, kill_slice=1, snapshot_every=5, job_name="processes-sigterm")
    config = process_config(  # no standby group: a few more processes on 2 cores, and the leave does not need it
        spec,
        notices=NoticeSources(signal="SIGTERM", signal_grace_s=GRACE_S),
        processes=Processes(standby=False),
        # an Orbax save every step: the group the slice leaves has one in flight, which must not hold the leave
        tiers=Tiers(keeper_every=spec.keeper_every, persistent_dir=str(tmp_path / "orbax"), persistent_every=1),
    )
    seen: dict[str, object] = {}

    def on_step(step, metrics, run):
        if step == 2 and "refused" not in seen:
            refused = []
            for slices, deadline_s in ((7, 5.0), (1, -1.0)):  # a slice the job does not hold; a deadline past
                with pytest.raises(NoticeError) as err:
                    job.notice(slices, deadline_s, "bad notice")
                refused.append(str(err.value))
            seen["refused"] = refused
        if step == SIGNAL_AT and "pid" not in seen:
            pid, _ = ray.get(job.group.agent(1).where.remote(), timeout=30)
            seen["pid"], seen["signalled"] = pid, time.time()
            os.kill(pid, signal.SIGTERM)

    job = ElasticJob(config, init_fn=init_state, on_step=on_step)
    with job:
        result = job.run(paced_loop(_paced_until_grown(0.2, 1.0, 3)))  # 1 s a step on 2 slices: the new worker starts
        events = job.group.events()
    r = result.report
    extra = r.to_dict()
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed) == (1, 1, 0, 0), extra
    assert (r.duplicate_steps, r.skipped_steps, r.steps_committed) == (0, 0, N), extra
    assert extra["leaving_exit_codes"] == {1: 0}, extra
    assert extra["survivors_lost"] == 0 and extra["min_slices_seen"] == 2, extra
    assert r.grows == 1 and r.slices_final == 3, extra  # the host stayed: a new worker, past the grace period
    (detail,) = r.notice_details
    assert detail["source"] == "sigterm" and detail["slices"] == [1] and detail["planned"] is True, detail
    assert detail["lead_s"] == pytest.approx(GRACE_S, abs=0.5)
    notice = next(e for e in events if e["kind"] == "notice")
    assert notice["source"] == "sigterm" and "SIGTERM" in notice["reason"], notice
    assert _gone(int(seen["pid"])), "the leaving worker's process lives on"  # type: ignore[call-overload]
    left = next(e for e in extra["timeline"] if e["event"] == "left")
    grown = next(e for e in extra["timeline"] if e["event"] == "grow")
    assert left["t"] < grown["t"], extra["timeline"]
    refused = seen["refused"]
    assert isinstance(refused, list) and "does not hold slice(s) 7" in refused[0] and "passed" in refused[1], refused
    params, _ = reference_params(spec)
    assert max_abs_diff(result.state["params"], params) <= 1e-4
