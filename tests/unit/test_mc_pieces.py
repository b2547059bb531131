"""The pure parts of multi-controller mode: host snapshot bookkeeping (regions, buddy copies, the newest step the
survivors hold whole), the driver's config checks and placement options, and the run's abort and boundary."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic.errors import ConfigError
from elastic.placements.mc_driver import McConfig
from elastic.placements.mc_run import Aborted, Boundary, McRun
from elastic.placements.mc_snapshots import Generation, HostSnapshots, common_step, region_of, take


def _gen(step: int, pieces: dict, regions: frozenset) -> Generation:
    return Generation(step=step, pieces=[pieces], regions=[regions], meta={"ledger": [[0, 0, step]]})


HALVES = frozenset({((0, 4),), ((4, 8),)})


def test_region_of_fills_open_bounds_and_trailing_dimensions() -> None:
    assert region_of((slice(None), slice(2, 4)), (8, 6)) == ((0, 8), (2, 4))
    assert region_of((slice(4, 8),), (8, 3)) == ((4, 8), (0, 3))


def test_take_keeps_each_distinct_region_once_and_knows_the_whole_layout() -> None:
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replica", "local"))
    x = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, PartitionSpec("local")))
    gen = take(5, {"w": x}, {"ledger": []})
    assert sorted(gen.pieces[0]) == [((0, 4), (0, 2)), ((4, 8), (0, 2))]  # replicated over "replica": kept once
    assert gen.regions[0] == frozenset({((0, 4), (0, 2)), ((4, 8), (0, 2))})
    piece = gen.pieces[0][((4, 8), (0, 2))]
    np.testing.assert_array_equal(piece, np.arange(8.0, 16.0).reshape(4, 2))
    assert not np.shares_memory(piece, np.asarray(x.addressable_shards[0].data))


def test_buddy_copies_are_private_and_the_oldest_generations_go() -> None:
    snaps = HostSnapshots(keep=2)
    sent = np.arange(4.0)
    for step in (5, 10, 15):
        snaps.add_buddy(3, _gen(step, {((4, 8),): sent}, HALVES))
    sent[:] = -1  # the sender's buffer is reused: the copy held here must not change
    assert sorted(snaps.held()) == [10, 15]
    np.testing.assert_array_equal(snaps.find(15, 0, ((5, 7),)), [1.0, 2.0])  # cut from the piece that covers it
    assert snaps.find(15, 0, ((2, 6),)) is None  # no single held piece covers it
    assert snaps.find(5, 0, ((4, 8),)) is None  # trimmed


def test_common_step_is_the_newest_step_the_survivors_hold_whole() -> None:
    a, b = HostSnapshots(keep=3), HostSnapshots(keep=3)
    for step in (5, 10, 15):
        a.add_own(_gen(step, {((0, 4),): np.zeros(4)}, HALVES))
        b.add_own(_gen(step, {((0, 4),): np.zeros(4)}, HALVES))  # both hold the first half only ...
    b.add_buddy(1, _gen(10, {((4, 8),): np.ones(4)}, HALVES))  # ... and b a buddy copy of step 10's second half
    assert common_step([a.held(), b.held()]) == 10
    assert common_step([a.held()]) is None  # nobody holds the second half: no step is whole
    assert common_step([]) is None
    c = HostSnapshots()
    c.add_buddy(2, _gen(15, {((0, 4),): np.zeros(4), ((4, 8),): np.ones(4)}, HALVES))
    assert common_step([a.held(), c.held()]) is None  # c has no own generation of 15: it would not know its ledger


@pytest.mark.parametrize("overrides, word", [
    ({"num_steps": 2.5}, "num_steps"), ({"num_slices": "4"}, "num_slices"), ({"num_slices": True}, "num_slices"),
    ({"snapshot_every": 0}, "snapshot_every"), ({"settle_timeout_s": float("inf")}, "settle_timeout_s"),
    ({"pass_timeout_s": -1}, "pass_timeout_s"), ({"resources_per_worker": {"host": -1}}, "resources_per_worker"),
    ({"resources_per_worker": {"host": True}}, "resources_per_worker"),
])
def test_bad_config_is_refused_at_once_naming_the_field(overrides: dict, word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        McConfig(**{"num_steps": 10, **overrides})


def test_worker_options_place_one_worker_per_host_resource() -> None:
    assert McConfig(num_steps=1).worker_options() == {"num_cpus": 0}
    options = McConfig(num_steps=1, resources_per_worker={"CPU": 4, "GPU": 8, "trainer_host": 1}).worker_options()
    assert options == {"num_cpus": 4, "num_gpus": 8, "resources": {"trainer_host": 1}}


def _run(start: int, *, aborted=lambda: False, stop_before=lambda s: False) -> tuple[McRun, list[int]]:  # noqa: ANN001
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("replica", "local"))
    committed: list[int] = []
    run = McRun(mesh=mesh, state={}, start_step=start, num_steps=10, seed=0, epoch=1,
                on_commit=lambda step, state, metrics: committed.append(step), stop_before=stop_before,
                aborted=aborted)
    return run, committed


def test_an_aborted_pass_ends_before_its_next_step() -> None:
    flag = {"set": False}
    run, committed = _run(3, aborted=lambda: flag["set"])
    with pytest.raises(Aborted):
        for step in run.steps:
            run.commit({})
            flag["set"] = step == 4
    assert committed == [3, 4]


def test_a_boundary_ends_the_pass_before_the_requested_step_not_at_the_first() -> None:
    run, committed = _run(3, stop_before=lambda s: s >= 3)
    with pytest.raises(Boundary) as caught:
        for _ in run.steps:
            run.commit({})
    assert caught.value.step == 4 and committed == [3]
