"""Micro-batch plans keep the global batch when it does not divide over the devices."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.runtime.batching import Chunk, plan_microbatches

PLANS = [
    # (global batch, devices, expected chunks as (start, size, sharded))
    (32, 8, [(0, 32, True)]),
    (8, 8, [(0, 8, True)]),
    (36, 6, [(0, 36, True)]),
    (32, 6, [(0, 30, True), (30, 2, False)]),
    (7, 8, [(0, 7, False)]),
    (1, 8, [(0, 1, False)]),
    (13, 4, [(0, 12, True), (12, 1, False)]),
    (15, 8, [(0, 8, True), (8, 7, False)]),
    (5, 1, [(0, 5, True)]),
    (1, 1, [(0, 1, True)]),
]


@pytest.mark.parametrize(("batch", "devices", "expected"), PLANS, ids=[f"B{b}-n{n}" for b, n, _ in PLANS])
def test_plan_exact(batch, devices, expected):
    plan = plan_microbatches(batch, devices)
    assert all(isinstance(c, Chunk) for c in plan)
    assert [(c.start, c.size, c.sharded) for c in plan] == expected


@pytest.mark.parametrize("batch", list(range(1, 41)))
@pytest.mark.parametrize("devices", [1, 2, 3, 6, 8])
def test_plan_invariants(batch, devices):
    plan = plan_microbatches(batch, devices)
    assert 1 <= len(plan) <= 2
    covered = [i for c in plan for i in range(c.start, c.stop)]
    assert covered == list(range(batch)), "chunks must cover the batch in order, without overlap or gap"
    for c in plan:
        assert c.size > 0
        assert c.stop == c.start + c.size
        if c.sharded:
            assert c.size % devices == 0
        else:
            assert c.size < devices
    assert [c.sharded for c in plan] == sorted((c.sharded for c in plan), reverse=True), "sharded chunk first"
    if batch % devices == 0:
        assert len(plan) == 1 and plan[0].sharded
    else:
        assert plan[-1].size == batch % devices and not plan[-1].sharded


@pytest.mark.parametrize(("batch", "devices"), [(0, 8), (-1, 8), (8, 0), (8, -2), (0, 0)])
def test_plan_rejects_non_positive(batch, devices):
    with pytest.raises(ValueError, match="positive"):
        plan_microbatches(batch, devices)


def _mean_grad(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Gradient of mean((x @ w - y)^2) with respect to w, closed form."""
    return 2.0 * x.T @ (x @ w - y) / len(x)


@pytest.mark.parametrize(("batch", "devices"), [(32, 6), (15, 8), (7, 8), (64, 8), (29, 3)])
def test_size_weighted_chunk_gradients_equal_full_batch_gradient(batch, devices):
    rng = np.random.default_rng(batch * 100 + devices)
    x = rng.normal(size=(batch, 5))
    y = rng.normal(size=(batch,))
    w = rng.normal(size=(5,))
    full = _mean_grad(x, y, w)
    plan = plan_microbatches(batch, devices)
    combined = sum(c.size / batch * _mean_grad(x[c.start : c.stop], y[c.start : c.stop], w) for c in plan)
    np.testing.assert_allclose(combined, full, rtol=1e-12, atol=1e-12)
    if len(plan) > 1:
        # An unweighted average of chunk gradients is wrong: the weighting is what makes the plan exact.
        naive = np.mean([_mean_grad(x[c.start : c.stop], y[c.start : c.stop], w) for c in plan], axis=0)
        assert not np.allclose(naive, full)
