"""The snapshot-interval planner: closed-form checks against Young-Daly, the simulation against the
renewal formula, bad input, and ``elastic plan --json``."""

from __future__ import annotations

import json
import math

import pytest

from elastic.cli import main
from elastic.errors import ConfigError
from elastic.ops.planner import (
    PlanInputs,
    daly_interval,
    expected_goodput,
    failure_gaps,
    first_order_goodput,
    optimal_interval,
    plan,
    simulated_goodput,
    young_interval,
)

# (id, inputs): the task's fleet, a slow-step big-snapshot job, a small job, a failure-heavy one
REGIMES = [
    ("16k-chips", dict(chips=16384, mtbf_hours_per_chip=50000)),
    (
        "slow-steps",
        dict(chips=1024, mtbf_hours_per_chip=10000, step_seconds=2.0, snapshot_seconds=5.0, restart_seconds=300.0),
    ),
    ("small-job", dict(chips=64, mtbf_hours_per_chip=20000, step_seconds=0.5, snapshot_seconds=2.0)),
    ("failure-heavy", dict(chips=65536, mtbf_hours_per_chip=5000, snapshot_seconds=3.0, restart_seconds=30.0)),
]


@pytest.mark.parametrize("kwargs", [k for _, k in REGIMES], ids=[i for i, _ in REGIMES])
def test_optimum_matches_young_daly(kwargs):
    inputs = PlanInputs(**kwargs)
    m, c = inputs.job_mtbf_seconds, inputs.snapshot_seconds
    assert young_interval(c, m) == pytest.approx(math.sqrt(2 * c * m))
    optimum = optimal_interval(c, m)
    # Daly's higher-order form is the optimum's expansion; Young's the leading term (off by ~C + C/3 ...)
    assert optimum == pytest.approx(daly_interval(c, m), rel=1e-3)
    assert optimum == pytest.approx(young_interval(c, m), rel=2 * math.sqrt(c / m) + 1e-3)
    # the stationary point of the exact goodput, and the whole step count beats its neighbours
    h = optimum * 1e-4
    assert expected_goodput(optimum, c, 0, m) >= max(
        expected_goodput(optimum - h, c, 0, m), expected_goodput(optimum + h, c, 0, m)
    )
    p = plan(inputs, horizon_failures=1000)
    step, r = inputs.step_seconds, inputs.restart_seconds
    g = [expected_goodput(k * step, c, r, m) for k in (p.interval_steps - 1, p.interval_steps, p.interval_steps + 1)]
    assert g[1] >= max(g[0] if p.interval_steps > 1 else 0.0, g[2])
    assert abs(p.chosen.seconds - optimum) <= step


def test_goodput_formulas_limits():
    # no failures: only the snapshot costs; small intervals against M: first order matches the exact form
    assert expected_goodput(100.0, 1.0, 60.0, 1e15) == pytest.approx(100 / 101)
    assert first_order_goodput(100.0, 0.5, 60.0, 1e6) == pytest.approx(
        expected_goodput(100.0, 0.5, 60.0, 1e6), abs=1e-4
    )
    assert expected_goodput(100.0, 1.0, 1e6, 1.0) == 0.0  # overflow is no goodput, not an error


@pytest.mark.parametrize("kwargs", [k for _, k in REGIMES], ids=[i for i, _ in REGIMES])
def test_simulation_agrees_and_optimum_beats_4x(kwargs):
    p = plan(PlanInputs(**kwargs), seed=3)
    d = p.to_dict()
    assert abs(d["difference"]) < 0.05
    assert abs(d["simulated_goodput"] - d["expected_goodput"]) < 0.01  # in fact much closer
    by_steps = {c.steps: c for c in p.candidates}
    k = p.interval_steps
    quarter = max(1, round(k / 4))
    assert {quarter, 4 * k} <= set(by_steps)
    for other in {quarter, 4 * k} - {k}:
        assert by_steps[other].simulated_goodput < p.chosen.simulated_goodput


def test_simulation_seeded_and_horizon_hours():
    inputs = PlanInputs(chips=16384, mtbf_hours_per_chip=50000)
    assert plan(inputs, seed=7).to_dict() == plan(inputs, seed=7).to_dict()
    gaps = failure_gaps(inputs.job_mtbf_seconds, seed=1, horizon_hours=1000.0)
    assert gaps.sum() == pytest.approx(1000 * 3600.0)
    by_hours = plan(inputs, horizon_hours=100_000.0)
    assert by_hours.simulated_hours == pytest.approx(100_000.0)
    assert abs(by_hours.chosen.simulated_goodput - by_hours.chosen.expected_goodput) < 0.005
    # a restart longer than every gap: only the first gap (no restart before it) does work
    assert simulated_goodput(gaps, 10.0, 1.0, 1e12) == pytest.approx(math.floor(gaps[0] / 11.0) * 10.0 / gaps.sum())


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(chips=0, mtbf_hours_per_chip=1.0), ("chips", "at least 1")),
        (dict(chips=2.0, mtbf_hours_per_chip=1.0), ("chips", "int")),
        (dict(chips=8, mtbf_hours_per_chip=0), ("mtbf_hours_per_chip", "positive")),
        (dict(chips=8, mtbf_hours_per_chip=float("nan")), ("mtbf_hours_per_chip", "positive")),
        (dict(chips=8, mtbf_hours_per_chip=1.0, step_seconds=-1.0), ("step_seconds", "positive")),
        (dict(chips=8, mtbf_hours_per_chip=1.0, snapshot_seconds=0.0), ("snapshot_seconds", "positive")),
        (dict(chips=8, mtbf_hours_per_chip=1.0, restart_seconds=-5.0), ("restart_seconds", "0 or more")),
        (dict(chips=8, mtbf_hours_per_chip="1"), ("mtbf_hours_per_chip", "number")),
    ],
)
def test_bad_inputs(kwargs, words):
    with pytest.raises(ConfigError) as err:
        PlanInputs(**kwargs)
    assert all(w in str(err.value) for w in words)


def test_bad_horizon():
    inputs = PlanInputs(chips=8, mtbf_hours_per_chip=1.0)
    with pytest.raises(ConfigError, match="horizon_failures"):
        plan(inputs, horizon_failures=0)
    with pytest.raises(ConfigError, match="horizon"):
        plan(inputs, horizon_failures=10, horizon_hours=1.0)
    with pytest.raises(ConfigError, match="at most"):
        plan(inputs, horizon_hours=1e12)


def test_cli_plan_json(capsys):
    assert main(["plan", "--chips", "16384", "--mtbf-hours-per-chip", "50000", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    d = json.loads(out)
    for key in (
        "interval_steps",
        "interval_seconds",
        "job_mtbf_hours",
        "expected_goodput",
        "simulated_goodput",
        "difference",
        "candidates",
    ):
        assert key in d
    assert d["interval_steps"] == 104 and d["interval_seconds"] == 104.0
    assert abs(d["difference"]) < 0.05 and d["difference"] == d["simulated_goodput"] - d["expected_goodput"]


def test_cli_plan_slices_and_table(capsys):
    assert (
        main(
            [
                "plan",
                "--slices",
                "64",
                "--chips-per-slice",
                "256",
                "--mtbf-hours-per-chip",
                "50000",
                "--horizon-failures",
                "2000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "16384 chips" in out and "<- best" in out and "104" in out
    assert main(["plan", "--chips", "8", "--slices", "2", "--chips-per-slice", "4", "--mtbf-hours-per-chip", "1"]) == 2
    assert "--chips" in capsys.readouterr().err
