"""The chaos checker cannot cry wolf and still catches a broken library: each schedule's equivalence reference
is the run's own device schedule replayed without the failure path (elastic.chaos.replay), compared bit for bit;
a restored leaf off by 1e-6, a step committed twice and a batch skipped (the library broken on purpose through
monkeypatched seams) each fail it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest

from elastic.chaos.runner import ChaosRunner
from elastic.control.accounting import Accounting
from elastic.control.tiers import TierSet

pytestmark = pytest.mark.integration

SEED, STEPS = 7, 14


@pytest.fixture(scope="module")
def runner() -> ChaosRunner:
    """One reference run for every test: the demo model, a slice killed (the device count changes)."""
    from elastic.control.cluster import connect

    connect()
    r = ChaosRunner(None, seed=SEED, steps=STEPS, scenarios=["kill"])
    r.reference()
    return r


def one(runner: ChaosRunner) -> Any:
    (result,) = runner.run(1).results
    return result


@pytest.mark.timeout(240)
def test_a_run_whose_device_count_changed_matches_its_replay_bit_for_bit(runner):
    result = one(runner)
    assert result.verdict.ok, result.verdict
    assert result.record.min_slices_seen < result.record.slices_initial  # it ran on fewer devices for a while
    eq = result.verdict["equivalence"]
    assert eq.evidence["mode"] == "replay" and eq.evidence["max_abs_diff"] == 0.0, eq
    assert "on slices" in eq.detail and "replay of the run's device schedule" in eq.detail, eq.detail


@pytest.mark.timeout(240)
def test_a_restored_leaf_off_by_a_millionth_fails_equivalence(runner, monkeypatch):
    restore = TierSet.restore

    def nudged(self: TierSet, *args: Any, **kwargs: Any) -> Any:
        got = restore(self, *args, **kwargs)
        if got is None:
            return got
        leaves, treedef = jax.tree_util.tree_flatten(got.state)
        i = next(k for k, x in enumerate(leaves) if jax.dtypes.issubdtype(x.dtype, np.floating))
        leaves[i] = leaves[i] + 1e-6
        return dataclasses.replace(got, state=jax.tree_util.tree_unflatten(treedef, leaves))

    monkeypatch.setattr(TierSet, "restore", nudged)
    result = one(runner)
    eq = result.verdict["equivalence"]
    assert eq.status == "fail" and eq.evidence["mode"] == "replay", eq
    assert 0 < eq.evidence["max_abs_diff"] < 1e-3, eq  # below the old tolerance's reach: only a replay sees it


@pytest.mark.timeout(240)
def test_a_step_committed_twice_fails_exactly_once(runner, monkeypatch):
    committed = Accounting.committed

    def twice(self: Accounting, step: int, *args: Any) -> None:
        committed(self, step, *args)
        if step == 3:
            committed(self, step, *args)

    monkeypatch.setattr(Accounting, "committed", twice)
    result = one(runner)
    assert result.verdict["exactly_once"].status == "fail", result.verdict["exactly_once"]


@pytest.mark.timeout(240)
def test_a_skipped_batch_fails_exactly_once(runner, monkeypatch):
    committed = Accounting.committed

    def skipping(self: Accounting, step: int, batch: int, *args: Any) -> None:
        committed(self, step, batch + (1 if step == 4 else 0), *args)

    monkeypatch.setattr(Accounting, "committed", skipping)
    result = one(runner)
    assert result.verdict["exactly_once"].status == "fail", result.verdict["exactly_once"]
