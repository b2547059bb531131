"""The pool's policy: a pure function from its state and one event to a :class:`~elastic.pool.model.Plan`.

:func:`decide` folds the event into the state, works out how many slices each job should hold (:func:`targets`),
and answers the difference: free slices lent now, reclaim notices to the jobs holding more than they should, and
earlier notices withdrawn when they are no longer needed. No clock, no Ray.

How many slices each job should hold, jobs taken by priority (higher first), then arrival:

1. *Minimums.* Each job gets its ``min_slices`` if that many healthy slices are left and its user's quota allows,
   else none: it waits (or, if it ran before, it is suspended: its slices are reclaimed for the higher job).
   A job whose minimum does not fit does not keep a lower job from its own (smaller) minimum.
2. *Claims.* Each running job is topped up to its *claim*: what it asks, less the failed slices it lost beyond its
   ``spares``. Slices held by lower-priority jobs above their minimum are taken for it (a notice each): a
   job that starts or grows takes them, and so does a job replacing a failed slice with a spare (a hot swap).
3. *Keep, fill.* Beyond its claim a job gets only what no lower-priority job holds (up to what that one asks):
   free slices go to the jobs below what they ask by priority (give back), and nobody's slice is taken for it.

A reclaimed slice stays its holder's until the holder releases it (:class:`~elastic.pool.model.Release`, at a step
boundary); then it is free, and the next decision lends it to the job it was taken for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from elastic.errors import ConfigError
from elastic.pool.model import (
    Arrive,
    Entry,
    Event,
    JobStatus,
    Leave,
    Plan,
    PoolState,
    Reclaim,
    Release,
    Resize,
    SliceFailed,
    SliceReturned,
)

__all__ = ["apply", "decide", "order", "status_of", "targets"]


def order(state: PoolState) -> list[str]:
    """The jobs by priority (higher first), then arrival (earlier first)."""
    return sorted(state.jobs, key=lambda n: (-state.jobs[n].spec.priority, state.jobs[n].arrival))


def _job(state: PoolState, name: str) -> Entry:
    if name not in state.jobs:
        raise ConfigError(f"job {name!r} is not in the pool")
    return state.jobs[name]


def _slice(state: PoolState, s: object) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < state.size:
        raise ConfigError(f"the pool's slices are 0..{state.size - 1}; got {s!r}")
    return s


def apply(state: PoolState, event: Event) -> tuple[PoolState, str]:
    """The state after ``event`` (before any lending), and what happened in words. ``ConfigError`` for an event
    the pool refuses (a job it does not know, a slice it does not lend, a minimum it can never meet)."""
    jobs, held, reclaiming, failed = dict(state.jobs), dict(state.held), dict(state.reclaiming), dict(state.failed)
    if isinstance(event, Arrive):
        spec = event.spec
        if spec.name in jobs:
            raise ConfigError(f"a job named {spec.name!r} is in the pool already: leave it first, or use another name")
        if spec.min_slices > state.size:
            raise ConfigError(
                f"job {spec.name!r} asks min_slices={spec.min_slices} but the pool has {state.size} slices: it could "
                "never run; lower min_slices"
            )
        quota = state.quotas.get(spec.user)
        if quota is not None and spec.min_slices > quota:
            raise ConfigError(
                f"job {spec.name!r} asks min_slices={spec.min_slices} but user {spec.user!r}'s quota is {quota} "
                "slices: it could never run; lower min_slices or raise the quota"
            )
        want = spec.max_slices if event.want is None else event.want
        if isinstance(want, bool) or not isinstance(want, int) or want < 1:
            raise ConfigError(f"a job asks for at least 1 slice; got want={want!r}")
        jobs[spec.name] = Entry(spec=spec, arrival=state.arrivals, want=want)
        what = f"job {spec.name} (user {spec.user}, priority {spec.priority}) arrived asking {jobs[spec.name].asked}"
        return replace(state, jobs=jobs, arrivals=state.arrivals + 1), what
    if isinstance(event, Leave):
        _job(state, event.job)
        del jobs[event.job]
        mine = [s for s, j in held.items() if j == event.job]
        for s in mine:
            del held[s]
            reclaiming.pop(s, None)
        failed = {s: (None if j == event.job else j) for s, j in failed.items()}
        what = f"job {event.job} left, giving back {len(mine)} slice(s)"
    elif isinstance(event, Release):
        _job(state, event.job)
        for s in sorted(event.slices):
            if held.get(_slice(state, s)) != event.job:
                raise ConfigError(f"job {event.job!r} does not hold slice {s}: nothing released")
        for s in event.slices:
            del held[s]
            reclaiming.pop(s, None)
        what = f"job {event.job} released slice(s) {_list(event.slices)}"
    elif isinstance(event, Resize):
        entry = _job(state, event.job)
        if isinstance(event.want, bool) or not isinstance(event.want, int) or event.want < 1:
            raise ConfigError(f"a job asks for at least 1 slice; got want={event.want!r}")
        jobs[event.job] = replace(entry, want=event.want)
        what = f"job {event.job} asks {jobs[event.job].asked}"
    elif isinstance(event, SliceFailed):
        s = _slice(state, event.slice)
        if s in failed:
            return state, f"slice {s} failed (known already)"
        holder = held.pop(s, None)
        reclaiming.pop(s, None)
        failed[s] = holder
        what = f"slice {s} failed" + (f" (held by {holder})" if holder else "")
    elif isinstance(event, SliceReturned):
        s = _slice(state, event.slice)
        if s not in failed:
            return state, f"slice {s} returned (it had not failed)"
        del failed[s]
        what = f"slice {s} returned"
    else:  # pragma: no cover - Event is closed
        raise ConfigError(f"not a pool event: {event!r}")
    return replace(state, jobs=jobs, held=held, reclaiming=reclaiming, failed=failed), what


def targets(state: PoolState) -> dict[str, int]:
    """How many slices each job should hold (the rules of this module's docstring)."""
    ranked = order(state)
    remaining = state.size - len(state.failed)
    used: dict[str, int] = {}
    target = {n: 0 for n in ranked}

    def room(name: str) -> int:
        user = state.jobs[name].spec.user
        quota = state.quotas.get(user)
        return remaining if quota is None else min(remaining, quota - used.get(user, 0))

    def give(name: str, upto: int, *, spare: int = 0) -> None:
        nonlocal remaining
        add = max(0, min(upto - target[name], room(name), remaining - spare))
        target[name] += add
        remaining -= add
        user = state.jobs[name].spec.user
        used[user] = used.get(user, 0) + add

    for n in ranked:  # 1. minimums
        if state.jobs[n].spec.min_slices <= room(n):
            give(n, state.jobs[n].spec.min_slices)
    running = [n for n in ranked if target[n] > 0]
    for i, n in enumerate(running):
        e = state.jobs[n]
        give(n, max(e.spec.min_slices, e.asked - max(0, state.lost(n) - e.spec.spares)))  # 2. its claim
        kept = sum(max(0, min(len(state.holding(m)), state.jobs[m].asked) - target[m]) for m in running[i + 1 :])
        give(n, e.asked, spare=kept)  # 3, 4. the rest of what it asks, from slices no lower job keeps
    return target


def decide(state: PoolState, event: Event) -> Plan:
    """Fold ``event`` into ``state`` and answer what to lend, what to reclaim, and why (``ConfigError``, with the
    state unchanged, for an event the pool refuses)."""
    state, what = apply(state, event)
    target = targets(state)
    ranked = order(state)
    held, reclaiming = dict(state.held), dict(state.reclaiming)
    cancels: dict[str, frozenset[int]] = {}
    taken: dict[str, list[int]] = {}
    for n in reversed(ranked):  # notices to jobs above their target, lowest priority first
        mine = sorted(state.holding(n))
        pending = [s for s in mine if s in reclaiming]
        excess = len(mine) - target[n]
        if excess > len(pending):
            fresh = [s for s in reversed(mine) if s not in reclaiming][: excess - len(pending)]
            taken[n] = sorted(fresh)
            for s in fresh:
                reclaiming[s] = None
        elif len(pending) > max(0, excess):
            withdrawn = pending[: len(pending) - max(0, excess)]
            cancels[n] = frozenset(withdrawn)
            for s in withdrawn:
                del reclaiming[s]
    grants: dict[str, frozenset[int]] = {}
    free = state.free()
    for n in ranked:  # free slices to the jobs below their target, highest priority first
        need = target[n] - len(state.holding(n))
        if need > 0 and free:
            grants[n], free = frozenset(free[:need]), free[need:]
            held.update({s: n for s in grants[n]})
    # Each slice being reclaimed goes to the highest-priority job still short (None: back to the pool).
    short = {n: target[n] - sum(1 for j in held.values() if j == n) for n in ranked}
    for s in sorted(reclaiming):
        wanted = next((n for n in ranked if short[n] > 0), None)
        reclaiming[s] = wanted
        if wanted is not None:
            short[wanted] -= 1
    jobs = {
        n: replace(e, ran=True) if sum(1 for j in held.values() if j == n) >= e.spec.min_slices else e
        for n, e in state.jobs.items()
    }
    new = replace(state, jobs=jobs, held=held, reclaiming=reclaiming)
    reclaims = tuple(_notices(new, taken))
    status = {n: status_of(new, n, target) for n in ranked}
    actions = [f"lend {_list(s)} to {n}" for n, s in grants.items()]
    actions += [
        f"reclaim {_list(r.slices)} from {r.job}" + (f" for {r.for_job}" if r.for_job else "") for r in reclaims
    ]
    actions += [f"withdraw the notice for {_list(s)} of {n}" for n, s in cancels.items()]
    return Plan(
        state=new,
        grants=grants,
        reclaims=reclaims,
        cancels=cancels,
        status=status,
        reason=what + ("; " + "; ".join(actions) if actions else ""),
    )


def _notices(state: PoolState, taken: Mapping[str, list[int]]) -> list[Reclaim]:
    out = []
    for job, slices in taken.items():
        by_asker: dict[str | None, list[int]] = {}
        for s in slices:
            by_asker.setdefault(state.reclaiming[s], []).append(s)
        for asker, group in by_asker.items():
            out.append(Reclaim(job=job, slices=frozenset(group), for_job=asker, reason=_why(state, job, asker)))
    return out


def _why(state: PoolState, job: str, asker: str | None) -> str:
    if asker is None:
        return f"the pool takes back what {job} holds above its share"
    e = state.jobs[asker]
    if 0 < state.lost(asker) <= e.spec.spares:
        return f"hot swap: {asker} (priority {e.spec.priority}) replaces a failed slice with a spare"
    return f"{asker} (priority {e.spec.priority}) needs it; {job} has priority {state.jobs[job].spec.priority}"


def status_of(state: PoolState, name: str, target: Mapping[str, int] | None = None) -> JobStatus:
    """Job ``name``'s status in ``state`` (``target``: :func:`targets` of it, computed when not given)."""
    target = targets(state) if target is None else target
    e = state.jobs[name]
    have = len(state.holding(name))
    want, low = e.asked, e.spec.min_slices
    coming = sorted(s for s, j in state.reclaiming.items() if j == name)
    if target[name] < low:
        state_ = "suspended" if e.ran else "waiting"
        reason = f"needs min_slices={low}; " + _shortfall(state, name, target)
        if have:
            reason += f"; its {have} slice(s) are being reclaimed"
    elif have >= low:
        state_, reason = "running", f"on {have} of {want} asked"
        if have > target[name]:
            reason += f"; {have - target[name]} of them being reclaimed"
        if target[name] < want:
            reason += "; " + _shortfall(state, name, target)
        elif coming:
            reason += f"; slices {_list(coming)} being reclaimed for it"
    else:
        state_ = "waiting"
        reason = f"needs {low}, holds {have}; slices {_list(coming)} being reclaimed for it"
    return JobStatus(state=state_, held=have, target=target[name], asked=want, reason=reason)


def _shortfall(state: PoolState, name: str, target: Mapping[str, int]) -> str:
    e = state.jobs[name]
    healthy = state.size - len(state.failed)
    quota = state.quotas.get(e.spec.user)
    others = sum(target[n] for n, x in state.jobs.items() if x.spec.user == e.spec.user and n != name)
    if quota is not None and target[name] + others >= quota:
        return f"user {e.spec.user}'s quota of {quota} slices is in use ({others} by their other jobs)"
    if e.asked > healthy and sum(target.values()) == target[name]:
        return f"asks {e.asked} but the pool has {healthy} healthy slices of {state.size}"
    lost = state.lost(name)
    if lost > e.spec.spares and target[name] < e.asked:
        return f"{lost} of its slices failed and it has {e.spec.spares} spares: it waits for free slices"
    return "the other healthy slices go to jobs of higher priority (or earlier arrival) and to other jobs' minimums"


def _list(slices: Iterable[int]) -> str:
    return ",".join(str(s) for s in sorted(slices)) or "none"
