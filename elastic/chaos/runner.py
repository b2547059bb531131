"""Run a target under seeded chaos schedules and check every promise on each run.

A *target* is a zero-argument function returning the keyword arguments of ``ElasticJob`` (``config``,
``init_fn``, optionally ``shardings_fn`` and ``mesh_fn``) plus ``loop``. ``ChaosRunner(target, ...).run()``
runs a failure-free reference once, then each schedule of :mod:`elastic.chaos.catalogue` with its faults, each in
a thread bounded by ``timeout_s`` (a run past it is a hang, reported, not a frozen command), and checks
:mod:`elastic.chaos.invariants` on each. Every run uses the Ray this process is connected to (or one embedded
cluster started here for all of them).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from elastic import runtime
from elastic.api.job import ElasticJob
from elastic.chaos.catalogue import HANG_STEP_TIMEOUT_S, JobShape, Schedule, applicable, schedule
from elastic.chaos.injector import snapshotter_of
from elastic.chaos.invariants import RunRecord, check
from elastic.chaos.notices import NoticeGiver, aim_for, view_of
from elastic.chaos.replay import replay, trail_schedule
from elastic.chaos.report import ChaosResult, ScheduleResult
from elastic.chaos.seams import Seams
from elastic.config import ElasticConfig
from elastic.control.cluster import connect
from elastic.control.teardown import cleanup
from elastic.errors import ConfigError, ElasticError, GiveUpError, SupervisorLostError
from elastic.log import get_logger
from elastic.snapshot import NoSnapshotError

__all__ = ["ChaosRunner", "Target", "load_target"]

REPAIR_S = 5.0  # chaos caps policy.repair_timeout_s so that a schedule that must give up does so quickly
GRACE_S = 30.0  # after a hang, how long the stuck run gets to unwind once its actors are killed
TargetSpec = str | Callable[[], Mapping[str, Any]] | None


@dataclass(frozen=True, kw_only=True)
class Target:
    config: ElasticConfig
    init_fn: Callable[[jax.Array], Any]
    loop: Callable[..., Any]
    shardings_fn: Callable[..., Any] | None = None
    mesh_fn: Callable[..., Any] | None = None


def load_target(spec: TargetSpec) -> tuple[Target, str]:
    """The target named ``module:function`` (or the function itself; None: the demo model), and its name."""
    if spec is None:
        spec = "elastic.demos.chaos:demo_target"
    if isinstance(spec, str):
        module, _, name = spec.partition(":")
        if not module or not name:
            raise ConfigError(f"--target must be module:function, got {spec!r}")
        if "" not in sys.path:
            sys.path.insert(0, "")  # a module in the current directory, as `python -m` finds it
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"cannot load the chaos target {spec!r}: {err}") from err
        label = spec
    else:
        fn, label = spec, f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', spec)}"
    if not callable(fn):
        raise ConfigError(f"the chaos target {label} must be a function returning ElasticJob's arguments and loop")
    try:
        kwargs = dict(fn())
    except Exception as err:
        raise ConfigError(
            f"the chaos target {label}() failed: {type(err).__name__}: {err}; it takes no arguments "
            "and returns a dict of config, init_fn, loop (optionally shardings_fn, mesh_fn)"
        ) from err
    unknown = sorted(set(kwargs) - {"config", "init_fn", "loop", "shardings_fn", "mesh_fn"})
    missing = sorted({"config", "init_fn", "loop"} - set(kwargs))
    if unknown or missing:
        raise ConfigError(
            f"the chaos target {label} returned keys {sorted(kwargs)}: it needs config, init_fn and "
            f"loop (optionally shardings_fn, mesh_fn){'; unknown: ' + str(unknown) if unknown else ''}"
        )
    target = Target(**kwargs)
    if not isinstance(target.config, ElasticConfig) or not target.config.simulated:
        raise ConfigError(
            f"the chaos target {label} must give an elastic.ElasticConfig with simulated=True: chaos "
            "kills simulated slices (in multi-process mode: worker processes on forced CPU devices)"
        )
    return target, label


def _host_leaves(state: Any) -> dict[str, np.ndarray]:
    def host(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return {jax.tree_util.keystr(p): host(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}


def _snapshot_end(job: ElasticJob) -> dict[str, Any]:
    """The newest snapshot's step at the end of a run, and the snapshots dropped uncounted (multi-process mode:
    as the workers reported them at the end of their last pass)."""
    if job.config.processes is not None:  # the group's newest snapshot: the oldest of its workers' newest
        extra = job.report.extra
        latest = extra.get("snapshot_latest_step")
        if latest is None and job.config.tiers.keeper_every:  # the workers gone (a give-up): what the keepers hold
            keepers = job.handles.keepers()
            whole = keepers.whole_steps(timeout=10.0) if keepers is not None else {}
            latest = max(whole, default=None)
        return {"latest": latest, "dropped": extra.get("snapshots_dropped")}
    snaps = snapshotter_of(job.handles)
    try:
        latest = job.latest_snapshot().step if len(snaps) else None
    except NoSnapshotError:
        latest = None
    return {"latest": latest, "dropped": snaps.stats()["snapshots_dropped"]}


def _describe(schedule: dict[int, tuple[int, ...]]) -> str:
    """``steps 0-12 on slices 0,1,2,3; 13-39 on 0,2,3``."""
    parts, start, last = [], None, None
    for step in sorted(schedule):
        if schedule[step] != last:
            if last is not None:
                parts.append(f"{start}-{step - 1} on slices {','.join(map(str, last))}")
            start, last = step, schedule[step]
    if last is not None:
        parts.append(f"{start}-{max(schedule)} on slices {','.join(map(str, last))}")
    return "; ".join(parts)


class ChaosRunner:
    def __init__(
        self,
        target: TargetSpec = None,
        *,
        seed: int = 0,
        steps: int | None = None,
        timeout_s: float = 120.0,
        scenarios: Sequence[str] | None = None,
    ) -> None:
        self._target, self.label = load_target(target)
        self.seed, self.timeout_s, self.scenarios = seed, timeout_s, scenarios
        cfg = self._target.config
        policy = replace(cfg.policy, repair_timeout_s=min(cfg.policy.repair_timeout_s, REPAIR_S))
        self.config = replace(cfg, policy=policy) if not steps else replace(cfg, policy=policy, num_steps=steps)
        self.overrides: dict[str, Any] = {}
        if steps and steps != cfg.num_steps:
            self.overrides["num_steps"] = steps
        if policy.repair_timeout_s != cfg.policy.repair_timeout_s:
            self.overrides["policy.repair_timeout_s"] = policy.repair_timeout_s
        self.shape = JobShape.of(self.config)
        applicable(self.shape, scenarios)  # unknown names, or none that fits, fail before anything starts
        named = target is not None and "<" not in self.label  # a module-level function replays by its name
        self._replay = (
            f"elastic chaos --seed {seed}"
            + (f" --target {self.label}" if named else "")
            + (f" --steps {steps}" if steps else "")
            + (f" --scenarios {','.join(scenarios)}" if scenarios else "")
        )
        if cfg.tiers.persistent_dir is not None:
            self._scratch = tempfile.mkdtemp(prefix="elastic-chaos-")
            self.overrides["tiers.persistent_dir"] = f"{self._scratch}/<job_name>"
        self._reference: RunRecord | None = None
        self._stuck = False
        self._log = get_logger("elastic.chaos.catalogue", target=self.label)

    def run(
        self,
        count: int,
        *,
        indices: Sequence[int] | None = None,
        progress: Callable[[ScheduleResult], None] | None = None,
    ) -> ChaosResult:
        """Run schedules ``0..count-1`` of the seed (or only ``indices``), after the reference."""
        connect()
        plans = [schedule(self.seed, i, self.shape, self.scenarios) for i in (indices or range(count))]
        reference = self.reference()
        results: list[ScheduleResult] = []
        for plan in plans:
            if self._stuck:  # a hung run still holds the devices: what would follow could not be trusted
                break
            results.append(self.run_schedule(plan))
            if progress is not None:
                progress(results[-1])
        return ChaosResult(
            seed=self.seed,
            target=self.label,
            results=tuple(results),
            reference=reference,
            reference_verdict=check(reference),
            not_run=len(plans) - len(results),
            config_overrides=dict(self.overrides),
            replay=self._replay,
        )

    def reference(self) -> RunRecord:
        """The failure-free run of the same target and seed (run once, then cached)."""
        if self._reference is None:
            record, _ = self._execute(f"{self.config.job_name}-chaos-ref", None)
            if record.outcome != "finished":
                raise ElasticError(
                    f"the failure-free reference run of {self.label} did not finish ({record.outcome}): {record.error}"
                )
            self._reference = record
        return self._reference

    def run_schedule(self, plan: Schedule) -> ScheduleResult:
        record, injected = self._execute(f"{self.config.job_name}-chaos{plan.seed}-{plan.index}", plan)
        result = ScheduleResult(
            schedule=plan,
            record=record,
            injected=injected,
            verdict=check(record, self.reference()),
            replay=f"{self._replay} --index {plan.index}",
        )
        self._log.info(
            "chaos_schedule",
            seed=plan.seed,
            index=plan.index,
            scenario=plan.scenario,
            outcome=record.outcome,
            injected=injected,
            seconds=record.seconds,
            broken=[p.promise for p in result.verdict.failed],
        )
        return result

    # -- one bounded run -------------------------------------------------------------------------------
    def _replayed(
        self, job: ElasticJob, cfg: ElasticConfig, trail: list[tuple[int, tuple[int, ...]]]
    ) -> tuple[dict[str, np.ndarray] | None, str]:
        """The schedule's equivalence reference: the target's loop replayed over the run's own device schedule
        (:mod:`elastic.chaos.replay`); None and why when it cannot be."""
        schedule = trail_schedule(trail)
        if not trail:
            return None, "no commit recorded"
        t = self._target
        runtime.simulated.reset()  # the run's killed slices: the replay runs on their devices as the run did
        try:
            state = replay(
                config=cfg,
                topology=job.topology,
                schedule=schedule,
                loop=t.loop,
                init_fn=t.init_fn,
                shardings=job.shardings,
                mesh_fn=t.mesh_fn,
            )
            return _host_leaves(state), (f"replayed over the run's device schedule: {_describe(schedule)}")
        except Exception as err:  # noqa: BLE001 - no replay: the tolerance against the reference applies
            return None, f"the replay failed: {type(err).__name__}: {str(err)[:200]}"

    def _execute(self, job_name: str, plan: Schedule | None) -> tuple[RunRecord, int]:
        """Run the target as job ``job_name`` with ``plan``'s faults; its record and the faults injected."""
        cfg = replace(self.config, job_name=job_name)
        if cfg.tiers.persistent_dir is not None:  # a persistent tier refuses another job's directory: one per run
            cfg = replace(cfg, tiers=replace(cfg.tiers, persistent_dir=os.path.join(self._scratch, job_name)))
        if plan is not None and plan.hangs:  # only the step watchdog ends a hung step: on, and short
            cfg = replace(cfg, step_timeout_s=min(cfg.step_timeout_s or HANG_STEP_TIMEOUT_S, HANG_STEP_TIMEOUT_S))
            if cfg.step_timeout_s != self.config.step_timeout_s:
                self.overrides["step_timeout_s"] = cfg.step_timeout_s  # said once a hang schedule ran
        t = self._target
        executed: list[int] = []  # multi-process mode: every commit in order, as the driver accounts it
        trail: list[tuple[int, tuple[int, ...]]] = []  # single-process mode: every commit and the slices it ran on
        multi = cfg.processes is not None
        notices: NoticeGiver | None = None  # the schedule's notices (both modes), once the job exists

        def on_step(step: int, metrics: Any, run: Any) -> None:
            if multi:
                executed.append(step)
                if notices is not None:  # multi-process mode: the driver gives them as the group commits their step
                    notices.reached(step)
            else:
                trail.append((step, run.slices))

        job = ElasticJob(
            cfg,
            init_fn=t.init_fn,
            shardings_fn=t.shardings_fn,
            mesh_fn=t.mesh_fn,
            faults=plan.plan() if plan is not None else None,
            on_step=on_step,
        )
        if plan is not None and plan.notices():
            notices = NoticeGiver(plan, job, aim_for(job), view_of(job))
        seams = Seams(plan, job, notices) if plan is not None and not multi else None  # multi: the plan, the notices
        if seams is not None:
            job.during_prepare.append(seams.during)
        loop = seams.loop(t.loop) if seams is not None else t.loop
        box: dict[str, Any] = {"outcome": "hang", "error": None}

        def work() -> None:
            try:
                with job:
                    try:
                        box["state"] = _host_leaves(job.run(loop).state)
                        box["outcome"] = "finished"
                    except GiveUpError as err:
                        box.update(outcome="gave_up", error=str(err))
                    except SupervisorLostError as err:
                        box.update(outcome="supervisor_lost", error=str(err))
                    finally:
                        box.update(_snapshot_end(job))
            except ElasticError as err:
                box.update(outcome="error", error=f"{type(err).__name__}: {err}")
            except Exception as err:  # noqa: BLE001 - reported as a violation, with what was raised
                box.update(outcome="crashed", error=f"{type(err).__name__}: {err}"[:2000])

        t0 = time.monotonic()
        worker = threading.Thread(target=work, name=f"chaos-{job_name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        seconds = time.monotonic() - t0
        if notices is not None:
            notices.close()  # no kill of this run's strikes once it has ended (or is a hang, to be unwound)
        if worker.is_alive():
            self._log.error("chaos_hang", job=job_name, bound_s=self.timeout_s)
            cleanup(job_name)  # its waits are bounded: with its actors gone it should unwind
            runtime.simulated.reset()
            worker.join(GRACE_S)
            self._stuck = worker.is_alive()
            then = (
                "it did not unwind"
                if self._stuck
                else f"then, its actors killed: {box['outcome']} {box['error'] or ''}"
            )
            box.update(outcome="hang", error=f"did not end within {self.timeout_s} s ({then.strip()})", state=None)
        ledger, report = job.ledger, job.report
        replayed, replay_note = None, "multi-process mode: the workers' devices are not in this process"
        if not multi and plan is not None and box["outcome"] == "finished":
            replayed, replay_note = self._replayed(job, cfg, trail)
        record = RunRecord(
            num_steps=cfg.num_steps,
            snapshot_every=cfg.snapshot_every,
            keeper_every=cfg.tiers.keeper_every,
            persistent_every=cfg.tiers.persistent_every if cfg.tiers.persistent_dir else None,
            outcome=box["outcome"],
            expect=plan.expect if plan is not None else "finish",
            error=box["error"],
            steps=tuple(ledger.steps),
            batches=tuple(ledger.batches),
            executed=tuple(executed if multi else (s for s, _ in trail)),  # every confirmed commit, in order
            recomputed=ledger.recomputed,
            restores=tuple(report.restores),
            slices_initial=report.slices_initial,
            min_slices_seen=report.min_slices_seen,
            state=box.get("state"),
            latest_snapshot_step=box.get("latest"),
            snapshots_dropped=box.get("dropped"),
            seconds=round(seconds, 3),
            replay_state=replayed,
            replay_note=replay_note,
            bound_s=self.timeout_s,
            notices=tuple(dict(n) for n in notices.given) if notices is not None else (),
            notice_details=tuple(dict(d) for d in report.notice_details),
        )
        return record, sum(e["event"].startswith("inject_") for e in job.timeline.events)
