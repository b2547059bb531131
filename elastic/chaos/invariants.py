"""The promises of DESIGN.md, checked on one run: ``check(run, reference) -> Verdict``.

A :class:`RunRecord` is what a run left: its ledger (the lineage of committed steps and batches), every
commit in the order it happened (recomputed ones included), the report's restores, its outcome and
final state (leaves by path, on the host), the newest snapshot at its end, the notices it was given and what the
report says each cost. ``check`` states each promise
as pass, fail or n/a, with the evidence. Pure: numpy only, so a test can feed it any record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["ATOL", "NOTICE_ROOM_S", "PromiseResult", "RunRecord", "Verdict", "check"]

ATOL = 1e-5  # equivalence when the device count changed (tests/integration/test_equivalence.py); else bit for bit
NOTICE_ROOM_S = 2.0  # a notice at least this far ahead leaves room for a step boundary: the job leaves, live
Outcome = Literal["finished", "gave_up", "supervisor_lost", "error", "crashed", "hang"]
Status = Literal["pass", "fail", "n/a"]


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    num_steps: int
    snapshot_every: int
    keeper_every: int = 0  # every R-th snapshot reaches the keepers (0: no keeper tier)
    persistent_every: int | None = None
    outcome: Outcome = "finished"
    expect: Literal["finish", "give_up", "supervisor_lost"] = "finish"
    error: str | None = None
    steps: tuple[int, ...] = ()  # the ledger: committed steps in the lineage of the final state
    batches: tuple[int, ...] = ()  # the batch each of those consumed
    executed: tuple[int, ...] = ()  # every commit, in the order it happened (recomputed ones included)
    recomputed: int = 0  # commits the ledger dropped on rollbacks (the report's steps_recomputed)
    restores: tuple[Mapping[str, Any], ...] = ()  # the report's restores: step, tier, generation
    slices_initial: int = 0
    min_slices_seen: int = 0
    state: Mapping[str, np.ndarray] | None = None  # final state, leaves by path
    latest_snapshot_step: int | None = None
    snapshots_dropped: int | None = None  # requested, neither taken, coalesced, failed nor abandoned
    seconds: float = 0.0
    bound_s: float = math.inf
    replay_state: Mapping[str, np.ndarray] | None = None  # the run's own device schedule replayed (chaos.replay)
    replay_note: str | None = None  # how the replay was made, or why there is none
    # the notices given (elastic.chaos.notices): reason, slices, seconds, step, at, deadline (wall clock), refused
    # (why, or None), could_leave (the supervisor's view as it was taken let the job leave the slice; None: unknown),
    # killed_at (wall clock: when the chaos runner killed the noticed slice during the run, or None)
    notices: tuple[Mapping[str, Any], ...] = ()
    notice_details: tuple[Mapping[str, Any], ...] = ()  # the report's, per notice acted on (matched by its reason)


@dataclass(frozen=True, kw_only=True)
class PromiseResult:
    promise: str
    status: Status
    detail: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def to_dict(self) -> dict[str, Any]:
        return {"promise": self.promise, "status": self.status, "detail": self.detail, "evidence": self.evidence}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    promises: tuple[PromiseResult, ...]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.promises)

    @property
    def failed(self) -> tuple[PromiseResult, ...]:
        return tuple(p for p in self.promises if not p.ok)

    def __getitem__(self, promise: str) -> PromiseResult:
        return next(p for p in self.promises if p.promise == promise)


def _result(promise: str, problems: list[str], ok_detail: str, evidence: dict[str, Any]) -> PromiseResult:
    return PromiseResult(
        promise=promise,
        status="fail" if problems else "pass",
        detail="; ".join(problems) if problems else ok_detail,
        evidence=evidence,
    )


def equivalence(run: RunRecord, reference: RunRecord | None, *, atol: float = ATOL) -> PromiseResult:
    """Promise 1: the final state of a finished run equals, bit for bit, the replay of its own device schedule
    (``run.replay_state``: the failure-free computation on the devices the run had); without a replay, the
    failure-free reference's, bit for bit when the device count never changed, else within ``atol``."""
    if run.outcome == "finished" and run.state is not None and run.replay_state is not None:
        replayed = RunRecord(num_steps=run.num_steps, snapshot_every=run.snapshot_every, state=run.replay_state)
        return _compare(
            run,
            replayed,
            exact=True,
            atol=atol,
            mode=f"bit for bit against a replay of the run's device schedule ({run.replay_note})",
        )
    if run.outcome != "finished" or reference is None or run.state is None or reference.state is None:
        return PromiseResult(promise="equivalence", status="n/a", detail="no finished run and reference to compare")
    exact = run.min_slices_seen == run.slices_initial
    mode = "bit for bit, the device count never changed" if exact else f"within {atol}, the device count changed"
    if run.replay_note and not exact:
        mode += f" (no replay: {run.replay_note})"
    return _compare(run, reference, exact=exact, atol=atol, mode=mode)


def _compare(run: RunRecord, reference: RunRecord, *, exact: bool, atol: float, mode: str) -> PromiseResult:
    assert run.state is not None and reference.state is not None
    problems, worst, differing = [], 0.0, []
    if set(run.state) != set(reference.state):
        problems.append(f"state leaves differ: {sorted(set(run.state) ^ set(reference.state))[:5]}")
    for path in sorted(set(run.state) & set(reference.state)):
        a, b = np.asarray(run.state[path]), np.asarray(reference.state[path])
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{path}: {a.dtype}{list(a.shape)} vs reference {b.dtype}{list(b.shape)}")
            continue
        if exact or not np.issubdtype(a.dtype, np.inexact):
            same = a.tobytes() == b.tobytes()
            diff = 0.0 if same else float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        else:
            diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
            same = diff <= atol
        worst = max(worst, diff)
        if not same:
            differing.append(path)
    if differing:
        problems.append(
            f"final state differs from the reference at {differing[:5]}: max abs diff {worst:.3g} (wanted: {mode})"
        )
    return _result(
        "equivalence",
        problems,
        f"final state matches the reference {mode}",
        {
            "mode": ("replay" if "replay of" in mode else "bitwise") if exact else "atol",
            "atol": None if exact else atol,
            "max_abs_diff": worst,
            "leaves": len(run.state),
            "leaves_differing": differing[:10],
        },
    )


def exactly_once(run: RunRecord, reference: RunRecord | None = None) -> PromiseResult:
    """Promise 2: the lineage's steps are 0..N-1 (a prefix of them if the run did not finish) with no gap and
    no repeat, and each consumed the batch the failure-free run consumed (default: the batch numbered as the step)."""
    steps, batches = list(run.steps), list(run.batches)
    n = run.num_steps if run.outcome == "finished" else len(steps)
    expected = list(reference.batches) if reference is not None and reference.batches else list(range(run.num_steps))
    repeats = sorted({s for s in steps if steps.count(s) > 1})
    gaps = sorted(set(range(n)) - set(steps))
    problems = []
    if repeats:
        problems.append(f"steps committed more than once in the lineage: {repeats[:10]}")
    if gaps:
        problems.append(f"steps never committed: {gaps[:10]}")
    if not repeats and not gaps and steps != list(range(n)):
        problems.append(f"steps out of order: {steps[:20]}")
    if batches != expected[: len(batches)] or len(batches) != len(steps):
        wrong = [i for i, (a, b) in enumerate(zip(batches, expected, strict=False)) if a != b]
        problems.append(
            f"batches consumed differ from the failure-free run's at positions {wrong[:10]} "
            f"({len(batches)} batches for {len(steps)} steps)"
        )
    span = "0..N-1" if run.outcome == "finished" else f"a prefix 0..{n - 1} (run {run.outcome})"
    return _result(
        "exactly_once",
        problems,
        f"steps and batches are {span}, no gap, no repeat",
        {
            "committed": len(steps),
            "num_steps": run.num_steps,
            "repeats": repeats[:10],
            "gaps": gaps[:10],
            "executed": len(run.executed),
        },
    )


def _bound(run: RunRecord, tier: str) -> int:
    if tier == "keeper":  # every R-th snapshot, pushed in the background: one push may be in flight
        return run.snapshot_every * (max(run.keeper_every, 1) + 1)
    if tier == "persistent":
        return (run.persistent_every or run.num_steps) + run.snapshot_every
    return run.snapshot_every


def bounded_loss(run: RunRecord) -> PromiseResult:
    """Promise 3: each rollback redoes at most the steps since the snapshot it restored (``snapshot_every``
    for the in-memory tier), and the rollbacks add up to what the report counts as recomputed."""
    rollbacks, problems = [], []
    for prev, step in zip(run.executed, run.executed[1:], strict=False):
        if step <= prev:
            tiers = [r.get("tier", "memory") for r in run.restores if r.get("step") == step] or ["memory"]
            bound = max(_bound(run, t) for t in tiers)
            lost = prev + 1 - step
            rollbacks.append({"from": prev + 1, "to": step, "lost": lost, "tier": tiers[-1], "bound": bound})
            if lost > bound:
                problems.append(
                    f"a rollback from step {prev + 1} to {step} redid {lost} steps, more than {bound} "
                    f"(tier {tiers[-1]}, snapshot_every={run.snapshot_every})"
                )
    total = sum(r["lost"] for r in rollbacks)
    if total != run.recomputed:
        problems.append(
            f"commits redone ({total}) differ from the steps the ledger counts as recomputed ({run.recomputed})"
        )
    return _result(
        "bounded_loss",
        problems,
        f"{len(rollbacks)} rollback(s), at most {max((r['lost'] for r in rollbacks), default=0)} step(s) "
        "redone each, within the snapshot interval",
        {"rollbacks": rollbacks, "recomputed": run.recomputed, "restores": len(run.restores)},
    )


def no_hang(run: RunRecord) -> PromiseResult:
    """Promise 4: the run ended (finished or a clear error) within its bound."""
    problems = []
    if run.outcome == "hang":
        problems.append(f"the run did not end within {run.bound_s:.0f} s")
    elif run.seconds > run.bound_s:
        problems.append(f"the run took {run.seconds:.1f} s, past its bound of {run.bound_s:.0f} s")
    return _result(
        "no_hang",
        problems,
        f"ended ({run.outcome}) in {run.seconds:.1f} s of at most {run.bound_s:.0f} s",
        {"seconds": round(run.seconds, 3), "bound_s": run.bound_s, "outcome": run.outcome, "error": run.error},
    )


_EXPECTED = {"finish": "finish", "give_up": "give up", "supervisor_lost": "end with SupervisorLostError"}


def outcome(run: RunRecord) -> PromiseResult:
    """Promises 4 and 5: every fault ends in recovery, or in a clear error where the faults leave no way on:
    ``GiveUpError`` (fewer than ``min_slices`` slices), ``SupervisorLostError`` (the supervisor gone for good)."""
    wanted = {"finish": "finished", "give_up": "gave_up", "supervisor_lost": "supervisor_lost"}[run.expect]
    said = {
        "finished": "finished",
        "gave_up": "gave up",
        "supervisor_lost": "ended with SupervisorLostError",
        "error": "ended in an error",
        "crashed": "crashed",
    }
    problems = (
        []
        if run.outcome in (wanted, "hang")
        else [
            f"expected the run to {_EXPECTED[run.expect]}, it {said[run.outcome]}"
            + (f": {run.error}" if run.error else "")
        ]
    )
    return _result(
        "outcome",
        problems,
        f"{run.outcome}, as expected",
        {"expect": run.expect, "outcome": run.outcome, "error": run.error},
    )


def nothing_lost(run: RunRecord) -> PromiseResult:
    """Promise 5: nothing saved is lost or overwritten: a finished run's newest snapshot holds its last step,
    every snapshot asked for is accounted for, and the newest snapshot is no older than any restore point
    (after a give-up: no older than the snapshot boundary before the last one reached; the last one's copy
    may still have been in flight when the slices died, so a run that gave up before its second boundary
    need hold no snapshot at all)."""
    latest, problems = run.latest_snapshot_step, []
    restored = max((int(r.get("step", 0)) for r in run.restores), default=0)
    reached = max(run.executed, default=-1) + 1
    before_last = reached // run.snapshot_every - 1  # the boundary before the last one reached, if any
    floor = max(0, before_last * run.snapshot_every)
    if run.outcome == "hang":
        return PromiseResult(promise="nothing_lost", status="n/a", detail="the run did not end")
    if latest is None:
        if run.outcome == "finished" or run.restores or before_last >= 0:
            problems.append("no snapshot at the end of the run")
    elif run.outcome == "finished" and latest != run.num_steps:
        problems.append(f"the newest snapshot holds step {latest}, not the last step {run.num_steps}")
    elif latest < max(restored, 0 if run.outcome == "finished" else floor):
        problems.append(
            f"the newest snapshot holds step {latest}, older than the restore point {restored} or the "
            f"snapshot boundary {floor}"
        )
    if run.snapshots_dropped:
        problems.append(f"{run.snapshots_dropped} snapshot(s) dropped without being counted")
    return _result(
        "nothing_lost",
        problems,
        f"the newest snapshot holds step {latest}; none dropped uncounted"
        if latest is not None
        else "no snapshot held: the run ended before its second snapshot boundary; none dropped uncounted",
        {
            "latest_snapshot_step": latest,
            "restore_points_max": restored,
            "floor": floor,
            "snapshots_dropped": run.snapshots_dropped,
        },
    )


def _unjudged(notice: Mapping[str, Any], detail: Mapping[str, Any] | None) -> str | None:
    """Why ``notice`` is outside the zero-recompute promise, or None."""
    killed = notice.get("killed_at")
    if notice.get("refused"):
        return f"refused: {notice['refused']}"
    if notice["seconds"] < NOTICE_ROOM_S:
        return f"{notice['seconds']} s ahead, under {NOTICE_ROOM_S} s"
    if killed is not None and killed < notice["deadline"]:
        return f"its slice killed {notice['deadline'] - killed:.2f} s before the deadline"
    if detail is None and not (killed is not None and notice.get("could_leave")):
        return "not acted on (the run ended first, or the slice was kept at min_slices)"
    return None


def notices_recompute_nothing(run: RunRecord) -> PromiseResult:
    """A notice taken at least ``NOTICE_ROOM_S`` ahead of its deadline, whose slice was not killed before the deadline,
    costs no recomputed step: the job left the slice at a step boundary, its live state moved (the report's
    ``notice_details``). One the job never acted on breaks it too when the job could spare the slice and the slice
    was killed at its deadline while the run went on; otherwise (the run ended first, the slice kept at
    ``min_slices``) it is listed, not judged. Any notice, judged or not, breaks no other promise: no step lost or
    repeated (``exactly_once``), no hang (``no_hang``)."""
    if not run.notices:
        return PromiseResult(promise="notices_recompute_nothing", status="n/a", detail="no notice given")
    details = {d.get("reason"): d for d in run.notice_details}
    judged, skipped, problems = [], [], []
    for n in run.notices:
        detail = details.get(n["reason"])
        why = _unjudged(n, detail)
        if why is not None:
            skipped.append({"reason": n["reason"], "why": why})
            continue
        if detail is None:
            judged.append({"reason": n["reason"], "steps_recomputed": None, "planned": None})
            problems.append(
                f"{n['reason']} ({n['seconds']} s ahead): the job could spare slice(s) {n['slices']} but never ran "
                "without them; they were killed at the deadline while the run went on (the notice was ignored)"
            )
            continue
        judged.append({"reason": n["reason"], **{k: detail.get(k) for k in ("steps_recomputed", "planned", "lead_s")}})
        if detail.get("steps_recomputed"):
            problems.append(
                f"{n['reason']} ({n['seconds']} s ahead, its slice alive to the deadline) cost "
                f"{detail['steps_recomputed']} recomputed step(s); the job should have left the slice at a step "
                f"boundary (planned: {detail.get('planned')})"
            )
    if not judged:
        return PromiseResult(
            promise="notices_recompute_nothing",
            status="n/a",
            detail=f"{len(run.notices)} notice(s), none with room whose slice lived to its deadline",
            evidence={"skipped": skipped},
        )
    return _result(
        "notices_recompute_nothing",
        problems,
        f"{len(judged)} notice(s) with room left their slice(s) with nothing recomputed",
        {"judged": judged, "skipped": skipped},
    )


def check(run: RunRecord, reference: RunRecord | None = None, *, atol: float = ATOL) -> Verdict:
    """Every promise of DESIGN.md on ``run``; ``reference``: the failure-free run of the same target and seed."""
    return Verdict(
        promises=(
            equivalence(run, reference, atol=atol),
            exactly_once(run, reference),
            bounded_loss(run),
            no_hang(run),
            outcome(run),
            nothing_lost(run),
            notices_recompute_nothing(run),
        )
    )
