"""Fault injection for drills and tests: carries out a :class:`~elastic.chaos.faults.Faults` plan.

The controller knows nothing of faults: an injector is one of its before-step hooks. A killed slice's
agent actor dies for real and its simulated devices fail, so detection and recovery run exactly as for
a real failure; ``kill_client`` is a real SIGKILL of this process.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

import runtime
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.chaos.faults import Fault, Faults
from elastic.log import get_logger
from snapshot import Snapshotter

if TYPE_CHECKING:
    from elastic.api.job import ElasticJob

__all__ = ["FaultInjector", "snapshotter_of"]


class FaultInjector:
    """Fires each fault once, when the loop reaches its step (a recomputed step does not fire it again)."""

    def __init__(self, faults: Faults, *, topology: runtime.Topology, simulated: bool,
                 group: Callable[[], ActorGroup], accounting: Accounting, job: str) -> None:
        self._faults = faults
        self._topology = topology
        self._simulated = simulated
        self._group = group
        self._acct = accounting
        self._fired: set[Fault] = set()
        self._log = get_logger("elastic.chaos.faults", job=job)

    @classmethod
    def for_job(cls, faults: Faults, job: ElasticJob) -> FaultInjector:
        return cls(faults, topology=job.topology, simulated=job.config.simulated, group=lambda: job.group,
                   accounting=job._acct, job=job.config.job_name)  # noqa: SLF001 - the job's own accounting

    def __call__(self, step: int) -> None:
        for fault in self._faults.faults:
            if fault.at_step == step and fault not in self._fired:
                self._fired.add(fault)
                self._inject(fault)

    def fire(self, fault: Fault) -> None:
        """Inject ``fault`` now, whatever its step (the chaos runner's seams: mid-step, after a restore...)."""
        self._fired.add(fault)
        self._inject(fault)

    def _inject(self, fault: Fault) -> None:
        self._log.warning("fault_injected", kind=fault.kind, slice=fault.slice, step=fault.at_step)
        self._acct.timeline.add(f"inject_{fault.kind}", step=fault.at_step, slice=fault.slice)
        if fault.kind == "kill_client":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "transient":
            self._acct.report.failures_injected += 1
            raise jax.errors.JaxRuntimeError(f"UNAVAILABLE: injected transient failure at step {fault.at_step}")
        if fault.kind == "hang":  # the step's next compiled call never completes until the watchdog aborts it
            self._acct.report.failures_injected += 1
            runtime.hangs.arm(None if fault.slice is None else self._topology.slice(fault.slice))
            return
        assert fault.slice is not None
        slice_ = self._topology.slice(fault.slice)
        group = self._group()
        if fault.kind == "kill":
            self._acct.report.failures_injected += 1
            group.kill_agent(fault.slice)
            if self._simulated:
                runtime.simulated.kill_slice(slice_)
        elif fault.kind == "silence":
            self._acct.report.failures_injected += 1
            group.agent(fault.slice).silence.remote()
        elif fault.kind == "revive":
            if self._simulated:
                runtime.simulated.revive_slice(slice_)
            group.spawn_agent(fault.slice)


def snapshotter_of(job: ElasticJob) -> Snapshotter:
    """The in-memory snapshot tier of an ``ElasticJob`` (a testing seam: corrupt a copy, read its stats)."""
    return job._tiers._snapshots  # noqa: SLF001 - a testing seam, as snapshot.testing is
