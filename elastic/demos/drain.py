"""The drain demo: a slice is given notice, the job leaves it at a step boundary, the slice goes at its deadline and
comes back later.

At step ``notice_at`` the job is told (``job.notice``, from another thread, as a scheduler's callback would) that
slice ``spec.kill_slice`` goes within ``deadline_s``; the job moves its live state onto the rest at the next step
boundary and trains on without it. At the deadline the slice is killed (its devices and its agent); at step
``spec.revive_at`` (once it is gone) it comes back and the job grows onto it. Nothing is recomputed and no failure is
counted. The summary adds ``notice_to_n_minus_1_s`` (from the notice to the live state on the other slices),
``notice_to_first_step_on_n_minus_1_s`` (to the first step committed there, which adds the compile for the smaller
mesh) and ``step_s`` (the median step time), so that the first can be read against the last.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from elastic import runtime
from elastic.demos.demo import DemoSpec, make_trainer, max_abs_diff

__all__ = ["notice_then", "notice_times", "run_drain_demo"]

BOUND_S = 60.0  # the longest the demo waits for any one event it caused


def notice_then(job: Any, slice_index: int, deadline_s: float, at_deadline: Callable[[], None]) -> None:
    """Give ``job`` the demo's notice for ``slice_index`` from another thread (as a scheduler's callback would),
    bounded by ``BOUND_S``, and call ``at_deadline`` from a timer when its deadline comes."""
    box: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: box.update(n=job.notice(slice_index, deadline_s, "drain demo")))
    caller.start()
    caller.join(BOUND_S)
    if "n" not in box:
        raise TimeoutError(f"the notice for slice {slice_index} was not taken within {BOUND_S}s")
    timer = threading.Timer(max(box["n"].deadline - time.time(), 0.0), at_deadline)
    timer.daemon = True
    timer.start()


class _Drill:
    """The demo's notice, the slice's death at the deadline and its return, driven from the loop's ``on_step``."""

    def __init__(self, spec: DemoSpec, deadline_s: float, notice_at: int, bar: Any) -> None:
        self.spec, self.deadline_s, self.notice_at, self.bar = spec, deadline_s, notice_at, bar
        self.job: Any = None
        self.stamps: list[float] = []
        self.gone = threading.Event()
        self.killed_at: float | None = None
        self._noticed = False
        self._revived = False

    def on_step(self, step: int, metrics: Any, run: Any) -> None:
        self.bar.on_step(step, metrics, run)
        self.stamps.append(time.monotonic())
        if step == self.notice_at and not self._noticed:
            self._noticed = True
            notice_then(self.job, self.spec.kill_slice, self.deadline_s, self._kill)
        if step == self.spec.revive_at and not self._revived:
            self._revived = True
            if not self.gone.wait(self.deadline_s + BOUND_S):
                raise TimeoutError("the drained slice was not killed at its deadline")
            self._revive()

    def _kill(self) -> None:
        """The deadline: the slice goes (its devices and its agent), as the scheduler said it would."""
        k = self.spec.kill_slice
        runtime.simulated.kill_slice(self.job.topology.slice(k))
        self.job.group.kill_agent(k)
        self.killed_at = time.time()
        self.gone.set()

    def _revive(self) -> None:
        k = self.spec.kill_slice
        runtime.simulated.revive_slice(self.job.topology.slice(k))
        self.job.group.spawn_agent(k)
        supervisor = self.job.group.supervisor
        until = time.monotonic() + BOUND_S
        view = ray.get(supervisor.view.remote(), timeout=BOUND_S)
        while k not in view.active and time.monotonic() < until:
            view = ray.get(supervisor.wait_for_epoch.remote(view.epoch, 2.0), timeout=BOUND_S)

    def step_s(self) -> float:
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return statistics.median(gaps) if gaps else 0.0


def notice_times(timeline: list[dict[str, Any]]) -> dict[str, float | None]:
    """From the timeline: seconds from the notice to the live state on N-1 slices (``left``), and to the first step
    committed there (``running_on_rest``: it adds the compile for the smaller mesh)."""
    left = next((e for e in timeline if e["event"] == "left"), None)
    first = next((e for e in timeline if e["event"] == "running_on_rest"), None)
    if left is None or first is None:
        return {"notice_to_n_minus_1_s": None, "notice_to_first_step_on_n_minus_1_s": None}
    given = first["t"] - first["running_on_rest_s"]  # the notice, on the timeline's clock
    return {
        "notice_to_n_minus_1_s": round(left["t"] - given, 3),
        "notice_to_first_step_on_n_minus_1_s": first["running_on_rest_s"],
    }


def run_drain_demo(
    spec: DemoSpec, *, deadline_s: float = 30.0, verify: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Run the drain demo (and, with ``verify``, its failure-free reference); the JSON-ready summary. The notice is
    given at step ``spec.kill_at``."""
    from elastic.ops.progress import Progress  # rich is only needed here

    with Progress(spec.steps, enabled=progress, stream=sys.stderr) as bar:
        drill = _Drill(spec, deadline_s, spec.kill_at, bar)
        trainer = make_trainer(spec, job_name="demo", faults=None, on_step=drill.on_step)
        drill.job = trainer.job
        result = trainer.fit()
    out = result.report.to_dict()
    out.update(notice_times(out["timeline"]))
    out["step_s"] = round(drill.step_s(), 4)
    out["killed_at_deadline"] = drill.killed_at is not None
    if verify:
        with Progress(spec.steps, enabled=progress, stream=sys.stderr, label="reference") as bar:
            reference = make_trainer(spec, job_name="demo-reference", faults=None, on_step=bar.on_step).fit()
        out["reference_final_loss"] = reference.report.final_loss
        out["max_abs_param_diff_vs_reference"] = max_abs_diff(result.state["params"], reference.state["params"])
    return out
