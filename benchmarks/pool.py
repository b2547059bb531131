"""Three jobs sharing a pool of 8 slices under three allocation policies: a SIMULATION. Prints one JSON object.

    .venv/bin/python benchmarks/pool.py --json [--seed 0] [--duration-s 3600] [--checkpoint-every 100]
        [--mtbf-s 600] [--repair-s 300] [--notice-fraction 0.5] [--notice-lead-s 60] [--static-split 3,3,2]

It drives no jobs and no Ray: an event-driven simulation on a seeded trace, its costs taken from figures measured
by the other benchmarks (the constants below). The allocation of the pool's own policy is the real one: every
event goes to :func:`elastic.pool.policy.decide`, and the simulation carries out the plan it answers.

* Trace (seeded): ``high`` (priority 10, 3 slices, ``spares=1``), ``mid`` (priority 5, 2-4 slices) and ``low``
  (priority 0, 1-8 slices, there from the start to the end) arrive and leave; slices fail at exponential
  inter-arrival times (mean ``--mtbf-s`` over the pool) and come back ``--repair-s`` (0.5-1.5x) later; a share
  ``--notice-fraction`` of the failures come with a notice ``--notice-lead-s`` before (a maintenance event).
* A job's step is a fixed amount of work, ``STEP_S`` on its ``max_slices``: on ``n`` slices it takes
  ``STEP_S * max_slices / n`` seconds (the global batch is fixed).
* ours: :func:`~elastic.pool.policy.decide` allocates; the jobs are elastic. A reclaim is a notice: the lender
  leaves the slice at its next step boundary with nothing recomputed, and re-forms (``HANDOVER_STEPS``); the
  receiver grows at its own next boundary (the same cost). A failure costs the steps since the newest host
  snapshot (every ``SNAPSHOT_EVERY``) and ``RECOVERY_S``; a job with spares gets a slice taken in its place
  (a hot swap). A noticed slice is left at the last boundary before its deadline (or at an earlier re-form) and
  reported to the pool as failed then (``SliceFailed``: the pool has no event for a slice announced to go).
  A suspended job resumes from its host snapshot (``RECOVERY_S``).
* (a) static: the pool split once between the jobs (``--static-split``), each job restart-based on its part.
* (b) evict-and-restart (what GKE's hot swap and Kueue's priority preemption do): a job that arrives takes its
  ``max_slices``, evicting whole lower-priority jobs (lowest first) when the free slices are too few; an evicted
  job restarts from its newest checkpoint (the steps since are lost) on what is left, at least its minimum
  (partial admission); a job with spares that loses a slice restarts on a free slice, or on one of a
  lower-priority job, evicted for it. A running job keeps its size, as Kueue's admitted workloads do.
  ``evict_restart_regrow``, a generous variant: a free slice also grows a running job, by a restart from a
  checkpoint taken at the step boundary (nothing lost).
* Both baselines' jobs restart from a checkpoint (every ``--checkpoint-every`` steps) on a failure (``RESTART_S``);
  a notice lets them checkpoint at the boundary and restart without the slice (nothing lost). Not charged to any
  policy: checkpoints, snapshots, detection, rescheduling.
* ``utilization``: slice-seconds spent on committed steps (the steps of each job's final history) over the
  healthy slice-seconds of the trace; ``goodput`` per job: committed step time over its wall time since arrival
  (its start included); ``slices_counted_twice``: moments at which two jobs ran on one slice, a job on a
  failed slice, or on one not lent to it (0); per job, ``failures_hit`` (losses that cost it steps),
  ``evictions``, ``restarts`` (the baselines') and ``below_min`` (times it stopped below its minimum).
  ``across_seeds``: the same for ``--seeds`` traces from ``--seed`` on.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from elastic.pool import Arrive, JobSpec, Leave, Release, SliceFailed, SliceReturned, decide, new_state  # noqa: E402
from elastic.pool.model import Event as PoolEvent  # noqa: E402

# -- costs, each from a measured figure (docs/benchmarks.md) --------------------------------------------------------
STEP_S = 1.0  # benchmarks/overhead.py: the plain jitted step of 200 MiB of Adam state, 1.02-1.05 s
HANDOVER_STEPS = 1.0  # a slice left (a notice) or joined at a step boundary: the job re-forms in place, ~one step
RECOVERY_S = 0.5  # benchmarks/recovery.py --mode multi-process: re-form after a SIGKILL, 256 MiB, 0.43-0.56 s
RESTART_S = 6.0  # the same benchmark's baseline: every process restarted from Orbax, 256 MiB, 4.68-6.34 s
START_S = RESTART_S  # a job's first start (processes, import, compile), the same under every policy
SNAPSHOT_EVERY = 10  # ElasticConfig.snapshot_every's default: a failure recomputes the steps since the newest

JOBS = (
    JobSpec(name="high", user="alice", priority=10, min_slices=3, max_slices=3, spares=1),
    JobSpec(name="mid", user="bob", priority=5, min_slices=2, max_slices=4),
    JobSpec(name="low", user="carol", priority=0, min_slices=1, max_slices=8),
)


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    t: float
    kind: str  # arrive | leave | notice | fail | return
    job: str = ""  # arrive, leave
    slice: int = -1  # notice, fail, return
    deadline: float = 0.0  # notice: when the slice goes


def make_trace(
    *,
    seed: int,
    duration_s: float,
    size: int,
    mtbf_s: float,
    repair_s: float,
    notice_fraction: float,
    notice_lead_s: float,
) -> list[TraceEvent]:
    """Arrivals and departures of :data:`JOBS`, slice failures (some noticed) and returns, in time order."""
    rng = random.Random(seed)
    mid_at = rng.uniform(0.08, 0.25) * duration_s
    high_at = rng.uniform(0.17, 0.33) * duration_s
    out = [
        TraceEvent(t=0.0, kind="arrive", job="low"),
        TraceEvent(t=mid_at, kind="arrive", job="mid"),
        TraceEvent(t=mid_at + rng.uniform(0.33, 0.5) * duration_s, kind="leave", job="mid"),
        TraceEvent(t=high_at, kind="arrive", job="high"),
        TraceEvent(t=high_at + rng.uniform(0.25, 0.42) * duration_s, kind="leave", job="high"),
    ]
    busy_until = [0.0] * size  # a slice noticed, failed, or under repair is not chosen again until it is back
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= duration_s:
            break
        noticed = rng.random() < notice_fraction and t - notice_lead_s > 0
        start = t - notice_lead_s if noticed else t
        choices = [s for s in range(size) if busy_until[s] <= start]
        back = t + rng.uniform(0.5, 1.5) * repair_s
        if not choices:
            continue
        s = rng.choice(choices)
        busy_until[s] = back
        if noticed:
            out.append(TraceEvent(t=start, kind="notice", slice=s, deadline=t))
        out += [TraceEvent(t=t, kind="fail", slice=s), TraceEvent(t=back, kind="return", slice=s)]
    return sorted((e for e in out if e.t < duration_s), key=lambda e: e.t)


# -- a job as the simulation runs it -------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Job:
    spec: JobSpec
    elastic: bool
    arrived: float | None = None
    left: float | None = None
    mode: str = "off"  # off | wait (no mesh) | pause (re-forming, restarting) | step (a step in flight)
    held: set[int] = field(default_factory=set)  # lent to it (the slices it is leaving included)
    mesh: frozenset[int] = frozenset()  # what its steps run on
    leaving: dict[int, float | None] = field(default_factory=dict)  # slice -> deadline (None: a reclaim)
    token: int = 0
    until: float = 0.0  # the end of its step or pause
    lineage: list[tuple[int, float]] = field(default_factory=list)  # committed steps: (slices, seconds)
    saved: int = 0  # steps kept by the newest snapshot (elastic) or checkpoint
    started: bool = False
    counts: dict[str, int] = field(
        default_factory=lambda: {"failures_hit": 0, "evictions": 0, "restarts": 0, "below_min": 0}
    )

    def step_s(self, n: int) -> float:
        return STEP_S * self.spec.max_slices / n


class Sim:
    """The clock, the jobs' runtime, and the invariants; a policy object decides who holds what."""

    def __init__(self, trace: list[TraceEvent], *, size: int, duration_s: float, elastic: bool, save_every: int):
        self.size, self.duration, self.save_every = size, duration_s, save_every
        self.jobs = {s.name: Job(spec=s, elastic=elastic) for s in JOBS}
        self.down: set[int] = set()
        self.now, self.seq, self.twice = 0.0, 0, 0
        self.heap: list[tuple[float, int, Any]] = []
        for e in trace:
            self._push(e.t, e)
        self.on_left: Callable[[Job, dict[int, float | None]], None] = lambda job, gone: None
        self.audit: Callable[[], None] = lambda: None  # a policy's own check, after each event

    def _push(self, t: float, item: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, item))

    def run(self, policy: Any) -> None:
        while self.heap and self.heap[0][0] < self.duration:
            self.now, _, item = heapq.heappop(self.heap)
            if isinstance(item, TraceEvent):
                if item.kind == "fail":
                    self.down.add(item.slice)
                elif item.kind == "return":
                    self.down.discard(item.slice)
                policy.handle(item)
            else:
                name, token = item
                job = self.jobs[name]
                if token == job.token:
                    self._timer(job)
            self._check()
            self.audit()

    def _check(self) -> None:
        seen: set[int] = set()
        for job in self.jobs.values():
            if job.mesh & seen or job.mesh & self.down or not job.mesh | set(job.leaving) <= job.held:
                self.twice += 1
            seen |= job.mesh

    # -- the runtime ---------------------------------------------------------------------------------------------
    def _after(self, job: Job, seconds: float, mode: str) -> None:
        job.token += 1
        job.mode, job.until = mode, self.now + seconds
        self._push(job.until, (job.spec.name, job.token))

    def _timer(self, job: Job) -> None:
        if job.mode == "step":
            n = len(job.mesh)
            job.lineage.append((n, job.step_s(n)))
            if len(job.lineage) % self.save_every == 0:
                job.saved = len(job.lineage)
        self.boundary(job)

    def boundary(self, job: Job) -> None:
        """A step boundary: leave what is to be left, take in what was lent, and go on."""
        nxt = job.step_s(max(1, len(job.mesh)))
        gone = {s: d for s, d in job.leaving.items() if d is None or d - self.now < nxt or s not in job.mesh}
        if gone or job.held - job.mesh - set(job.leaving):  # it re-forms (or restarts): without the noticed slices
            gone.update(job.leaving)
        for s in gone:
            del job.leaving[s]
            job.held.discard(s)
        if gone:
            self.on_left(job, gone)  # the policy may lend it more at once (a hot swap)
        mesh = frozenset(s for s in job.held if s in job.mesh or s not in job.leaving)
        if len(mesh) < job.spec.min_slices:
            if not job.elastic:
                job.saved = len(job.lineage)  # it checkpoints at the boundary before it stops
            self._stop(job)
        elif mesh != job.mesh:
            job.mesh = mesh
            if job.elastic:
                self._after(job, HANDOVER_STEPS * job.step_s(len(mesh)), "pause")
            else:
                job.saved = len(job.lineage)  # a checkpoint at the boundary, then a restart on the new count
                job.counts["restarts"] += 1
                self._after(job, RESTART_S, "pause")
        else:
            self._after(job, job.step_s(len(mesh)), "step")

    def _stop(self, job: Job) -> None:
        """Below its minimum the job waits; it lets the slices it was told to leave go at once."""
        job.mesh, job.mode = frozenset(), "wait"
        job.token += 1
        job.counts["below_min"] += 1
        gone, job.leaving = job.leaving, {}
        job.held -= set(gone)
        if gone:
            self.on_left(job, gone)

    def maybe_start(self, job: Job) -> None:
        """A waiting job with its minimum lent starts (first), resumes (elastic) or restarts (from a checkpoint)."""
        usable = frozenset(job.held) - set(job.leaving)
        if job.mode != "wait" or len(usable) < job.spec.min_slices:
            return
        job.mesh = usable
        cost = START_S if not job.started else RECOVERY_S if job.elastic else RESTART_S
        job.counts["restarts"] += job.started and not job.elastic
        job.started = True
        self._after(job, cost, "pause")

    def arrive(self, name: str) -> Job:
        job = self.jobs[name]
        job.arrived, job.mode = self.now, "wait"
        return job

    def leave(self, name: str) -> Job:
        job = self.jobs[name]
        job.left, job.mode, job.mesh, job.held, job.leaving = self.now, "off", frozenset(), set(), {}
        job.token += 1
        return job

    def lose(self, job: Job, *, evicted: bool) -> None:
        """The step in flight and the steps since the newest snapshot or checkpoint are lost."""
        del job.lineage[job.saved :]
        job.counts["evictions" if evicted else "failures_hit"] += 1

    def fail(self, s: int) -> Job | None:
        """Slice ``s`` is gone: its job (if any) recovers on the rest, or waits below its minimum."""
        job = next((j for j in self.jobs.values() if s in j.held), None)
        if job is None:
            return None
        job.held.discard(s)
        job.leaving.pop(s, None)
        if s not in job.mesh:
            return job
        self.lose(job, evicted=False)
        job.mesh = job.mesh - {s}
        if len(job.mesh) < job.spec.min_slices:
            self._stop(job)
        else:
            job.counts["restarts"] += not job.elastic
            cost = RECOVERY_S if job.elastic else RESTART_S
            self._after(job, max(cost, job.until - self.now if job.mode == "pause" else 0.0), "pause")
        return job

    def evict(self, job: Job) -> None:
        self.lose(job, evicted=True)
        job.mesh, job.held, job.leaving, job.mode = frozenset(), set(), {}, "wait"
        job.token += 1

    def report(self, trace: list[TraceEvent]) -> dict[str, Any]:
        down_since: dict[int, float] = {}
        lost = 0.0
        for e in trace:
            if e.kind == "fail":
                down_since[e.slice] = e.t
            elif e.kind == "return" and e.slice in down_since:
                lost += e.t - down_since.pop(e.slice)
        lost += sum(self.duration - t for t in down_since.values())
        available = self.size * self.duration - lost
        jobs: dict[str, dict[str, Any]] = {}
        for name, job in self.jobs.items():
            wall = (job.left if job.left is not None else self.duration) - (job.arrived or 0.0)
            step_time = sum(d for _, d in job.lineage)
            jobs[name] = {
                "goodput": round(step_time / wall, 4) if wall > 0 else None,
                "committed_steps": len(job.lineage),
                "wall_seconds": round(wall, 1),
                "slice_seconds_committed": round(sum(n * d for n, d in job.lineage), 1),
                **job.counts,
            }
        used = sum(j["slice_seconds_committed"] for j in jobs.values())
        return {
            "utilization": round(used / available, 4),
            "slice_seconds_available": round(available, 1),
            "jobs": jobs,
            "slices_counted_twice": self.twice,
        }


# -- the three policies ----------------------------------------------------------------------------------------------
class Ours:
    """:func:`elastic.pool.policy.decide` allocates; its plans are carried out on elastic jobs."""

    def __init__(self, sim: Sim):
        self.sim, self.state = sim, new_state(sim.size)
        self.decisions, self.mismatches, self.busy = 0, 0, False
        self.queue: list[PoolEvent] = []
        self.noticed: set[int] = set()  # announced to go, still in use by their holder
        sim.on_left, sim.audit = self.left, self.audit

    def submit(self, *events: PoolEvent) -> None:
        self.queue += events
        if self.busy:
            return
        self.busy = True
        while self.queue:
            plan = decide(self.state, self.queue.pop(0))
            self.state = plan.state
            self.decisions += 1
            for r in plan.reclaims:  # a notice: left at the holder's next step boundary (at once if it waits)
                job = self.sim.jobs[r.job]
                mine = frozenset(r.slices & job.held)  # the rest it has left already: their events are queued
                if job.mode == "wait" and mine:
                    job.held -= mine
                    for s in mine:
                        job.leaving.pop(s, None)
                    self.left(job, dict.fromkeys(mine))
                elif job.mode != "wait":
                    job.leaving.update({s: None for s in mine})
            for name, slices in plan.cancels.items():
                job = self.sim.jobs[name]
                for s in slices:
                    if s in job.leaving and job.leaving[s] is None and s not in self.noticed:
                        del job.leaving[s]
            for name, slices in plan.grants.items():
                self.sim.jobs[name].held |= slices
                self.sim.maybe_start(self.sim.jobs[name])
        self.busy = False

    def audit(self) -> None:
        """After each event: the simulation's leases are the pool's."""
        self.mismatches += any(j.held != set(self.state.holding(n)) for n, j in self.sim.jobs.items())

    def left(self, job: Job, gone: dict[int, float | None]) -> None:
        noticed = set(gone) & self.noticed
        self.noticed -= noticed
        rest = frozenset(gone) - noticed
        # the pool has no event for a slice announced to go: the one it has for a slice gone
        events: list[PoolEvent] = [SliceFailed(slice=s) for s in sorted(noticed)]
        self.submit(*events, *([Release(job=job.spec.name, slices=rest)] if rest else []))

    def handle(self, e: TraceEvent) -> None:
        if e.kind == "arrive":
            self.submit(Arrive(spec=self.sim.arrive(e.job).spec))
        elif e.kind == "leave":
            self.sim.leave(e.job)
            self.submit(Leave(job=e.job))
        elif e.kind == "notice":
            holder = self.state.held.get(e.slice)
            job = self.sim.jobs[holder] if holder else None
            if job is not None and e.slice in job.mesh and job.mode in ("step", "pause"):
                self.noticed.add(e.slice)
                if job.leaving.get(e.slice, 0) is not None:  # a reclaim already leaves it at the next boundary
                    job.leaving[e.slice] = e.deadline
            else:
                if job is not None:
                    job.held.discard(e.slice)
                    job.leaving.pop(e.slice, None)
                self.submit(SliceFailed(slice=e.slice))
        elif e.kind == "fail":
            self.noticed.discard(e.slice)
            self.sim.fail(e.slice)
            if e.slice not in self.state.failed:
                self.submit(SliceFailed(slice=e.slice))
        elif e.kind == "return":
            self.submit(SliceReturned(slice=e.slice))


class Static:
    """(a) The pool split once; each job runs on the healthy slices of its part."""

    def __init__(self, sim: Sim, split: dict[str, int]):
        self.sim, self.out = sim, set[int]()
        firsts = [sum(split[s.name] for s in JOBS[:i]) for i in range(len(JOBS))]
        self.part = {s.name: set(range(f, f + split[s.name])) for s, f in zip(JOBS, firsts, strict=True)}

    def handle(self, e: TraceEvent) -> None:
        if e.kind == "arrive":
            job = self.sim.arrive(e.job)
            job.held = self.part[job.spec.name] - self.out
            self.sim.maybe_start(job)
        elif e.kind == "leave":
            self.sim.leave(e.job)
        elif e.kind in ("notice", "fail"):
            self.out.add(e.slice)
            holder = next((j for j in self.sim.jobs.values() if e.slice in j.held), None)
            if e.kind == "fail":
                self.sim.fail(e.slice)
            elif holder is not None and e.slice in holder.mesh and holder.mode in ("step", "pause"):
                holder.leaving[e.slice] = e.deadline
            elif holder is not None:
                holder.held.discard(e.slice)
        elif e.kind == "return":
            self.out.discard(e.slice)
            name = next(n for n, p in self.part.items() if e.slice in p)
            job = self.sim.jobs[name]
            if job.mode != "off":
                _lend(self.sim, job, {e.slice})


def _lend(sim: Sim, job: Job, slices: set[int]) -> None:
    """More slices for a restart-based job: they join a restart in progress, else the job restarts onto them at its
    next step boundary (a checkpoint there: nothing lost), or it starts once it has its minimum."""
    job.held |= slices
    if job.mode == "pause":
        job.mesh = job.mesh | slices
    elif job.mode == "wait":
        sim.maybe_start(job)


class Evict:
    """(b) Evict-and-restart: priority preemption of whole jobs, each restarting from its newest checkpoint."""

    def __init__(self, sim: Sim, *, regrow: bool):
        self.sim, self.regrow = sim, regrow
        self.out: set[int] = set()  # noticed or down
        self.lost: dict[int, str] = {}  # a slice down -> the job it was taken from (counted against its spares)
        sim.on_left = self.left

    def free(self) -> list[int]:
        taken = set().union(*(j.held for j in self.sim.jobs.values()))
        return [s for s in range(self.sim.size) if s not in taken and s not in self.out]

    def ranked(self) -> list[Job]:
        present = [j for j in self.sim.jobs.values() if j.mode != "off"]
        return sorted(present, key=lambda j: (-j.spec.priority, j.arrived))

    def make_room(self, job: Job, need: int) -> None:
        for victim in reversed(self.ranked()):
            if len(self.free()) >= need:
                return
            if victim.spec.priority < job.spec.priority and victim.held:
                self.sim.evict(victim)

    def admit(self) -> None:
        for job in self.ranked():
            free = self.free()
            if job.mode == "wait" and len(job.held) + len(free) >= job.spec.min_slices:
                _lend(self.sim, job, set(free[: job.spec.max_slices - len(job.held)]))
            elif self.regrow and job.mode in ("step", "pause") and free and len(job.held) < job.spec.max_slices:
                _lend(self.sim, job, set(free[: job.spec.max_slices - len(job.held)]))

    def swap(self, job: Job, s: int) -> None:
        """A hot swap: a job with spares replaces a lost slice, evicting a lower-priority job when none is free."""
        self.lost[s] = job.spec.name
        if sum(1 for j in self.lost.values() if j == job.spec.name) > job.spec.spares:
            return
        self.make_room(job, 1)
        free = self.free()
        if free:
            _lend(self.sim, job, {free[0]})

    def left(self, job: Job, gone: dict[int, float | None]) -> None:
        for s, deadline in gone.items():
            if deadline is not None and job.spec.spares:
                self.swap(job, s)
        self.admit()

    def handle(self, e: TraceEvent) -> None:
        if e.kind == "arrive":
            job = self.sim.arrive(e.job)
            self.make_room(job, job.spec.max_slices)
        elif e.kind == "leave":
            self.sim.leave(e.job)
        elif e.kind in ("notice", "fail"):
            self.out.add(e.slice)
            holder = next((j for j in self.sim.jobs.values() if e.slice in j.held), None)
            if (
                holder is not None
                and e.kind == "notice"
                and e.slice in holder.mesh
                and holder.mode in ("step", "pause")
            ):
                holder.leaving[e.slice] = e.deadline
            elif holder is not None:
                if e.kind == "fail":
                    self.sim.fail(e.slice)
                else:
                    holder.held.discard(e.slice)
                if holder.spec.spares:
                    self.swap(holder, e.slice)
        elif e.kind == "return":
            self.out.discard(e.slice)
            self.lost.pop(e.slice, None)
        self.admit()


# -- the run -----------------------------------------------------------------------------------------------------------
def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """The trace, replayed against the three policies: one JSON-ready dict."""
    trace = make_trace(
        seed=args.seed,
        duration_s=args.duration_s,
        size=args.slices,
        mtbf_s=args.mtbf_s,
        repair_s=args.repair_s,
        notice_fraction=args.notice_fraction,
        notice_lead_s=args.notice_lead_s,
    )
    split = dict(zip((s.name for s in JOBS), (int(x) for x in args.static_split.split(",")), strict=True))
    if sum(split.values()) != args.slices:
        raise SystemExit(f"--static-split must add up to --slices={args.slices}; got {args.static_split}")
    results = {}
    for name, elastic, make in (
        ("ours", True, lambda sim: Ours(sim)),
        ("static", False, lambda sim: Static(sim, split)),
        ("evict_restart", False, lambda sim: Evict(sim, regrow=False)),
        ("evict_restart_regrow", False, lambda sim: Evict(sim, regrow=True)),
    ):
        save_every = SNAPSHOT_EVERY if elastic else args.checkpoint_every
        sim = Sim(trace, size=args.slices, duration_s=args.duration_s, elastic=elastic, save_every=save_every)
        policy = make(sim)
        sim.run(policy)
        results[name] = sim.report(trace)
        if isinstance(policy, Ours):
            results[name].update(decisions=policy.decisions, pool_mirror_mismatches=policy.mismatches)
    ours, static, evict = results["ours"], results["static"], results["evict_restart"]
    top, bottom = JOBS[0].name, JOBS[-1].name

    def ratio(other: str) -> float:
        steps = ours["jobs"][bottom]["committed_steps"]
        return round(steps / max(1, results[other]["jobs"][bottom]["committed_steps"]), 3)

    return {
        "drives": "simulation",
        "costs": {
            "step_s_at_max_slices": STEP_S,
            "handover_steps": HANDOVER_STEPS,
            "recovery_s": RECOVERY_S,
            "restart_s": RESTART_S,
            "start_s": START_S,
            "snapshot_every": SNAPSHOT_EVERY,
            "checkpoint_every": args.checkpoint_every,
        },
        "trace": {
            "seed": args.seed,
            "slices": args.slices,
            "duration_s": args.duration_s,
            "jobs": {s.name: {k: v for k, v in vars(s).items() if k != "name"} for s in JOBS},
            "static_split": split,
            "failures": sum(e.kind == "fail" for e in trace),
            "noticed": sum(e.kind == "notice" for e in trace),
            "events": [[round(e.t, 1), e.kind, e.job or e.slice] for e in trace],
        },
        "policies": results,
        f"{bottom}_steps_ours_over": {name: ratio(name) for name in results if name != "ours"},
        "checks": {
            "ours.utilization>=0.9": ours["utilization"] >= 0.9,
            "ours.utilization>static": ours["utilization"] > static["utilization"],
            "ours.utilization>evict_restart": ours["utilization"] > evict["utilization"],
            "ours.utilization>evict_restart_regrow": ours["utilization"]
            > results["evict_restart_regrow"]["utilization"],
            f"ours.{top}.goodput>=0.97": ours["jobs"][top]["goodput"] >= 0.97,
            f"ours.{bottom}.committed_steps>=1.5x_evict_restart": ratio("evict_restart") >= 1.5,
            "slices_counted_twice==0": all(r["slices_counted_twice"] == 0 for r in results.values()),
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON object only (the default output anyway)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=8, help="also sum up this many traces, from --seed on")
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--mtbf-s", type=float, default=600.0, help="mean seconds between slice losses in the pool")
    p.add_argument("--repair-s", type=float, default=300.0, help="mean seconds until a lost slice is back")
    p.add_argument("--notice-fraction", type=float, default=0.5, help="the share of losses announced ahead")
    p.add_argument("--notice-lead-s", type=float, default=60.0)
    p.add_argument("--checkpoint-every", type=int, default=100, help="the baselines' checkpoint interval, in steps")
    p.add_argument("--static-split", default="3,3,2", help="(a)'s slices for high,mid,low")
    return p.parse_args(argv)


def across_seeds(args: argparse.Namespace) -> dict[str, Any]:
    """The figures the checks read, over ``--seeds`` traces from ``--seed`` on: min, median, max, and how many
    traces met each check."""
    runs = [simulate(argparse.Namespace(**{**vars(args), "seed": args.seed + i})) for i in range(args.seeds)]
    top, bottom = JOBS[0].name, JOBS[-1].name
    figures: dict[str, list[float]] = {
        **{f"{p}.utilization": [r["policies"][p]["utilization"] for r in runs] for p in runs[0]["policies"]},
        f"ours.{top}.goodput": [r["policies"]["ours"]["jobs"][top]["goodput"] for r in runs],
        **{
            f"{bottom}_steps_ours_over.{p}": [r[f"{bottom}_steps_ours_over"][p] for r in runs]
            for p in runs[0][f"{bottom}_steps_ours_over"]
        },
    }
    return {
        "seeds": [args.seed + i for i in range(args.seeds)],
        "min_median_max": {k: [min(v), round(statistics.median(v), 4), max(v)] for k, v in figures.items()},
        "checks_met": {k: sum(r["checks"][k] for r in runs) for k in runs[0]["checks"]},
    }


def main() -> None:
    args = parse_args()
    out = simulate(args)
    if args.seeds > 1:
        out["across_seeds"] = across_seeds(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
