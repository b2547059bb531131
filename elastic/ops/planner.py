"""The snapshot interval that maximises goodput, by formula and by a seeded simulation (numpy and math only).

Model (the same for the formula and the simulation): failures strike the job as a Poisson process of mean
``M`` = per-chip MTBF / chips seconds. Training runs in segments of ``tau`` seconds of work (a whole number
of steps) followed by a snapshot that blocks it for ``C`` seconds; a segment counts once its snapshot has
completed. A failure, in work, in a snapshot or in a restart, loses everything since the last completed
snapshot and costs a restart of ``R`` seconds (a failure during a restart starts it again).

* Goodput (renewal theory, exact for this model; Daly 2006):
  ``G(tau) = tau / (M * exp(R/M) * (exp((tau + C)/M) - 1))``.
* First-order model: ``G1(tau) = 1 - C/tau - (tau/2 + R)/M`` (clipped at 0).
* Optimum: ``G`` is maximal where ``1 - tau/M = exp(-(tau + C)/M)``, i.e. ``tau* = M (1 + W0(-exp(-1 - C/M)))``,
  solved by bisection; Young: ``sqrt(2 C M)``; Daly's higher order: ``sqrt(2 C M) (1 + sqrt(C/(2M))/3 +
  C/(18 M)) - C`` (``M`` when ``C >= 2M``). The interval is the whole step count next to ``tau*`` with
  the higher ``G`` (``G`` is log-concave in ``tau``, so that is the best whole step count).
* Simulation: exponential gaps between failures; in a gap of ``g`` seconds after a failure the job
  completes ``floor(max(g - R, 0) / (tau + C))`` segments (no restart before the first gap);
  goodput = work / wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic.errors import ConfigError

__all__ = [
    "Candidate",
    "Plan",
    "PlanInputs",
    "daly_interval",
    "expected_goodput",
    "first_order_goodput",
    "failure_gaps",
    "optimal_interval",
    "plan",
    "simulated_goodput",
    "young_interval",
]

MAX_FAILURES = 10_000_000  # a horizon past this many failures would not fit in memory comfortably
CANDIDATE_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


def _number(name: str, value: object, unit: str, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of {unit}, got {value!r} of type {type(value).__name__}")
    low_ok = value >= 0 if zero_ok else value > 0
    if not (low_ok and value < math.inf):  # also false for nan
        what = "0 or more" if zero_ok else "positive"
        raise ConfigError(f"{name} must be {what} and finite ({unit}), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What the operator knows: ``chips`` failing independently, each with a mean time between failures of
    ``mtbf_hours_per_chip``; a step of ``step_seconds``; a snapshot that blocks training ``snapshot_seconds``
    (``benchmarks/snapshot.py`` measures it); ``restart_seconds`` from a failure to training again, without
    recomputation (``benchmarks/recovery.py`` measures it)."""

    chips: int
    mtbf_hours_per_chip: float
    step_seconds: float = 1.0
    snapshot_seconds: float = 0.5
    restart_seconds: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.chips, bool) or not isinstance(self.chips, int) or self.chips < 1:
            raise ConfigError(f"chips must be an int of at least 1 (slices x chips per slice), got {self.chips!r}")
        _number("mtbf_hours_per_chip", self.mtbf_hours_per_chip, "hours")
        _number("step_seconds", self.step_seconds, "seconds")
        _number("snapshot_seconds", self.snapshot_seconds, "seconds")
        _number("restart_seconds", self.restart_seconds, "seconds", zero_ok=True)

    @property
    def job_mtbf_seconds(self) -> float:
        """``M``: the job fails when any chip does, so its MTBF is the chip's divided by the chips."""
        return self.mtbf_hours_per_chip * 3600.0 / self.chips


def young_interval(snapshot_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)`` seconds of work between snapshots."""
    return math.sqrt(2.0 * snapshot_s * mtbf_s)


def daly_interval(snapshot_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: ``sqrt(2CM) (1 + sqrt(C/2M)/3 + C/18M) - C`` for ``C < 2M``, else ``M``."""
    if snapshot_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = snapshot_s / (2.0 * mtbf_s)
    return young_interval(snapshot_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - snapshot_s


def optimal_interval(snapshot_s: float, mtbf_s: float) -> float:
    """The ``tau`` maximising :func:`expected_goodput`: ``u = tau/M`` in (0, 1) solves
    ``(1 - u) exp(u) = exp(-C/M)`` (the left side falls from 1 to 0 there), by bisection."""
    target = math.exp(-snapshot_s / mtbf_s)
    low, high = 0.0, 1.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if (1.0 - mid) * math.exp(mid) > target:
            low = mid
        else:
            high = mid
        if high - low <= 1e-15:
            break
    return (low + high) / 2.0 * mtbf_s


def expected_goodput(tau_s: float, snapshot_s: float, restart_s: float, mtbf_s: float) -> float:
    """Exact for the module's model: ``tau / (M exp(R/M) (exp((tau + C)/M) - 1))``."""
    try:
        return tau_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau_s + snapshot_s) / mtbf_s))
    except OverflowError:
        return 0.0


def first_order_goodput(tau_s: float, snapshot_s: float, restart_s: float, mtbf_s: float) -> float:
    """``1 - C/tau - (tau/2 + R)/M``, clipped at 0: good while ``tau + C + R`` is small against ``M``."""
    return max(0.0, 1.0 - snapshot_s / tau_s - (tau_s / 2.0 + restart_s) / mtbf_s)


def failure_gaps(
    mtbf_s: float, *, seed: int, horizon_failures: int | None = None, horizon_hours: float | None = None
) -> np.ndarray:
    """Seconds between successive failures (exponential, mean ``mtbf_s``) over the horizon: ``horizon_failures``
    gaps, each ended by a failure, or gaps filling ``horizon_hours`` exactly (the last one cut at the end)."""
    if (horizon_failures is None) == (horizon_hours is None):
        raise ConfigError("give exactly one horizon: horizon_failures or horizon_hours")
    rng = np.random.default_rng(seed)
    if horizon_failures is not None:
        if (
            isinstance(horizon_failures, bool)
            or not isinstance(horizon_failures, int)
            or not 1 <= horizon_failures <= MAX_FAILURES
        ):
            raise ConfigError(f"horizon_failures must be an int in 1..{MAX_FAILURES:,}, got {horizon_failures!r}")
        return rng.exponential(mtbf_s, horizon_failures)
    _number("horizon_hours", horizon_hours, "hours")
    assert horizon_hours is not None  # exactly one horizon, checked above
    horizon_s = horizon_hours * 3600.0
    expected = horizon_s / mtbf_s
    if expected > MAX_FAILURES:
        raise ConfigError(
            f"horizon_hours={horizon_hours} means ~{expected:,.0f} failures at a job MTBF of "
            f"{mtbf_s:.4g} s; give at most ~{MAX_FAILURES * mtbf_s / 3600:.4g} hours"
        )
    draw = int(expected + 10.0 * math.sqrt(expected) + 10)  # enough almost always; topped up otherwise
    gaps = rng.exponential(mtbf_s, draw)
    while gaps.sum() < horizon_s:
        gaps = np.concatenate([gaps, rng.exponential(mtbf_s, draw)])
    ends = np.cumsum(gaps)
    last = int(np.searchsorted(ends, horizon_s))  # the first gap that reaches the horizon
    gaps = gaps[: last + 1].copy()
    gaps[last] = horizon_s - (ends[last - 1] if last else 0.0)
    return gaps


def simulated_goodput(gaps: np.ndarray, tau_s: float, snapshot_s: float, restart_s: float) -> float:
    """Work / wall time over ``gaps`` (from :func:`failure_gaps`): each gap but the first starts with a
    restart, then completes whole segments of ``tau + C``; a failure loses the segment it interrupts."""
    restart = np.full(gaps.shape, float(restart_s))
    restart[0] = 0.0
    segments = np.floor(np.maximum(gaps - restart, 0.0) / (tau_s + snapshot_s))
    return float(segments.sum() * tau_s / gaps.sum())


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One snapshot interval and its goodput three ways."""

    steps: int
    seconds: float
    expected_goodput: float
    first_order_goodput: float
    simulated_goodput: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "expected_goodput": self.expected_goodput,
            "first_order_goodput": self.first_order_goodput,
            "simulated_goodput": self.simulated_goodput,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen interval (``interval_steps``, one of ``candidates``), the formulas' intervals, the horizon."""

    inputs: PlanInputs
    young_seconds: float
    daly_seconds: float
    optimum_seconds: float
    interval_steps: int
    candidates: tuple[Candidate, ...]
    seed: int
    simulated_failures: int
    simulated_hours: float

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.steps == self.interval_steps)

    def to_dict(self) -> dict[str, Any]:
        chosen, i = self.chosen, self.inputs
        return {
            "chips": i.chips,
            "mtbf_hours_per_chip": i.mtbf_hours_per_chip,
            "step_seconds": i.step_seconds,
            "snapshot_seconds": i.snapshot_seconds,
            "restart_seconds": i.restart_seconds,
            "job_mtbf_hours": i.job_mtbf_seconds / 3600.0,
            "young_seconds": self.young_seconds,
            "daly_seconds": self.daly_seconds,
            "optimum_seconds": self.optimum_seconds,
            "interval_steps": self.interval_steps,
            "interval_seconds": chosen.seconds,
            "expected_goodput": chosen.expected_goodput,
            "first_order_goodput": chosen.first_order_goodput,
            "simulated_goodput": chosen.simulated_goodput,
            "difference": chosen.simulated_goodput - chosen.expected_goodput,
            "seed": self.seed,
            "simulated_failures": self.simulated_failures,
            "simulated_hours": self.simulated_hours,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def plan(
    inputs: PlanInputs, *, seed: int = 0, horizon_failures: int | None = None, horizon_hours: float | None = None
) -> Plan:
    """The best whole-step interval and candidates around it (x1/4 .. x4), each simulated on the same
    failure times (``horizon_failures`` defaults to 100,000 when neither horizon is given)."""
    if horizon_failures is None and horizon_hours is None:
        horizon_failures = 100_000
    m, c, r, step = inputs.job_mtbf_seconds, inputs.snapshot_seconds, inputs.restart_seconds, inputs.step_seconds
    optimum = optimal_interval(c, m)
    near = {max(1, math.floor(optimum / step)), max(1, math.ceil(optimum / step))}
    best = max(sorted(near), key=lambda k: expected_goodput(k * step, c, r, m))
    steps = sorted({max(1, round(best * f)) for f in CANDIDATE_FACTORS})
    gaps = failure_gaps(m, seed=seed, horizon_failures=horizon_failures, horizon_hours=horizon_hours)
    candidates = tuple(
        Candidate(
            steps=k,
            seconds=k * step,
            expected_goodput=expected_goodput(k * step, c, r, m),
            first_order_goodput=first_order_goodput(k * step, c, r, m),
            simulated_goodput=simulated_goodput(gaps, k * step, c, r),
        )
        for k in steps
    )
    failures = len(gaps) if horizon_hours is None else len(gaps) - 1
    return Plan(
        inputs=inputs,
        young_seconds=young_interval(c, m),
        daly_seconds=daly_interval(c, m),
        optimum_seconds=optimum,
        interval_steps=best,
        candidates=candidates,
        seed=seed,
        simulated_failures=failures,
        simulated_hours=float(gaps.sum()) / 3600.0,
    )
