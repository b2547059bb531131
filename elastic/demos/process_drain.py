"""The multi-process drain demo: a slice's worker is given notice, the job leaves it at a step boundary, the
worker process ends with exit code 0, and the slice comes back once the notice's deadline has passed.

The multi-process demo's job (:mod:`elastic.demos.processes`: 4 worker processes, 2 CPU devices each) with each step
paced to ``pace_s`` so that the deadline falls inside the run. At step ``spec.kill_at`` the driver is told
(``job.notice``, from another thread, as a scheduler's callback would) that slice ``spec.kill_slice`` goes within
``deadline_s``: the workers stop at a step boundary, the three others re-form over their own devices with the live
state (what only the leaving worker held copied from it), and the leaving worker leaves its group and ends its
process (``leaving_exit_codes``). At the deadline the slice is killed if its worker still runs (the scheduler
takes it). Past the deadline its host stayed, so a new worker starts there (``Processes.replace_lost``) and the
job grows back onto it. Nothing is recomputed and no failure is counted.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from elastic.api.job import ElasticJob
from elastic.demos.demo import init_state, max_abs_diff
from elastic.demos.drain import BOUND_S, notice_then, notice_times
from elastic.demos.pacing import paced_loop
from elastic.demos.processes import ProcessDemoSpec, process_config, reference_params

__all__ = ["run_process_drain_demo"]


class _Drill:
    """The demo's notice, and the slice's end at the deadline, driven from the driver's ``on_step``."""

    def __init__(self, spec: ProcessDemoSpec, deadline_s: float) -> None:
        self.spec, self.deadline_s = spec, deadline_s
        self.job: Any = None
        self.killed_at_deadline: bool | None = None
        self._noticed = False

    def on_step(self, step: int, metrics: Any, run: Any) -> None:
        if step < self.spec.kill_at or self._noticed:
            return
        self._noticed = True
        notice_then(self.job, self.spec.kill_slice, self.deadline_s, self._deadline)

    def _deadline(self) -> None:
        """The deadline: the slice goes, as the scheduler said; a worker that has not left yet is killed."""
        k = self.spec.kill_slice
        view = ray.get(self.job.group.supervisor.view.remote(), timeout=BOUND_S)
        self.killed_at_deadline = k in view.active
        if self.killed_at_deadline:
            self.job.group.kill_agent(k)


def run_process_drain_demo(
    spec: ProcessDemoSpec, *, deadline_s: float = 30.0, pace_s: float = 0.5, verify: bool = False
) -> dict[str, Any]:
    """Run the demo in worker processes of the connected Ray cluster (and, with ``verify``, its failure-free
    reference); the JSON-ready report."""
    start = time.monotonic()
    drill = _Drill(spec, deadline_s)
    with ElasticJob(process_config(spec), init_fn=init_state, on_step=drill.on_step) as job:
        drill.job = job
        result = job.run(paced_loop(pace_s))
    report = result.report.to_dict()
    report.update(notice_times(report["timeline"]))
    report["job_seconds"] = round(time.monotonic() - start, 2)
    report["killed_at_deadline"] = bool(drill.killed_at_deadline)
    if verify:
        params, final_loss = reference_params(spec)
        report["reference_final_loss"] = final_loss
        report["max_abs_param_diff_vs_reference"] = max_abs_diff(result.state["params"], params)
    return report
