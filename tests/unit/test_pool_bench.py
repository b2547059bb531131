"""benchmarks/pool.py: a short seeded trace through the three policies, and the invariants of its accounting."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pool_bench", ROOT / "benchmarks" / "pool.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pool_bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_short_trace_keeps_the_accounting_straight(bench: ModuleType) -> None:
    args = bench.parse_args(["--duration-s", "900", "--mtbf-s", "150", "--repair-s", "120", "--seeds", "1"])
    out = bench.simulate(args)
    assert out["drives"] == "simulation"
    assert out["trace"]["failures"] >= 2 and out["trace"]["noticed"] >= 1  # the trace exercises both paths
    for name, run in out["policies"].items():
        assert run["slices_counted_twice"] == 0, name
        used = sum(job["slice_seconds_committed"] for job in run["jobs"].values())
        assert used <= run["slice_seconds_available"] + 1e-6, name
        assert 0.0 <= run["utilization"] <= 1.0, name
        for job in run["jobs"].values():
            assert job["goodput"] is None or 0.0 <= job["goodput"] <= 1.0, name
    ours = out["policies"]["ours"]
    assert ours["pool_mirror_mismatches"] == 0  # the simulated leases are exactly the pool's
    assert ours["decisions"] > 0
    assert ours["utilization"] >= out["policies"]["static"]["utilization"]


def test_a_reclaim_loses_no_step_where_an_eviction_does(bench: ModuleType) -> None:
    trace = [
        bench.TraceEvent(t=0.0, kind="arrive", job="low"),
        bench.TraceEvent(t=105.5, kind="arrive", job="high"),
        bench.TraceEvent(t=300.0, kind="leave", job="high"),
    ]
    runs = {}
    for name, elastic, make in (
        ("ours", True, lambda sim: bench.Ours(sim)),
        ("evict", False, lambda sim: bench.Evict(sim, regrow=False)),
    ):
        sim = bench.Sim(trace, size=8, duration_s=400.0, elastic=elastic, save_every=50)
        sim.run(make(sim))
        runs[name] = sim.report(trace)
    low, high = runs["ours"]["jobs"]["low"], runs["ours"]["jobs"]["high"]
    assert (low["evictions"], low["failures_hit"], low["below_min"]) == (0, 0, 0)
    # high waits for low's step boundary (one step), its own start, and nothing else
    assert high["wall_seconds"] - high["committed_steps"] * bench.STEP_S <= bench.START_S + 2 * bench.STEP_S
    evicted = runs["evict"]["jobs"]["low"]
    assert evicted["evictions"] == 1
    assert evicted["committed_steps"] < low["committed_steps"]
    assert runs["ours"]["slices_counted_twice"] == runs["evict"]["slices_counted_twice"] == 0


def test_the_double_count_check_sees_a_slice_in_two_meshes(bench: ModuleType) -> None:
    sim = bench.Sim([], size=8, duration_s=10.0, elastic=True, save_every=10)
    low, mid = sim.jobs["low"], sim.jobs["mid"]
    low.held, low.mesh = {0, 1}, frozenset({0, 1})
    mid.held, mid.mesh = {1, 2}, frozenset({1, 2})
    sim._check()
    assert sim.twice == 1
    sim.down.add(2)  # and a job on a slice that is down
    mid.held, mid.mesh = {2}, frozenset({2})
    sim._check()
    assert sim.twice == 2


@pytest.mark.parametrize(
    "argv",
    [  # traces that once left a reclaim of a slice already left, or a noticed slice lent again
        ["--seed", "16", "--mtbf-s", "150", "--repair-s", "900"],
        ["--seed", "89", "--mtbf-s", "600", "--repair-s", "900", "--checkpoint-every", "10"],
        ["--seed", "278", "--mtbf-s", "60", "--repair-s", "60", "--duration-s", "1200"],
    ],
)
def test_many_losses_keep_the_leases_the_pools(bench: ModuleType, argv: list[str]) -> None:
    out = bench.simulate(bench.parse_args([*argv, "--seeds", "1"]))
    assert out["policies"]["ours"]["pool_mirror_mismatches"] == 0
    assert all(run["slices_counted_twice"] == 0 for run in out["policies"].values())
