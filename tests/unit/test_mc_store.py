"""Host snapshots kept in node files: a generation is there whole or not at all, reads back bit for bit (bf16 and
scalars too) as read-only maps, is found by a new process for the same slice, and goes when trimmed."""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from elastic.placements.mc_snapshots import Generation, HostSnapshots, common_step
from elastic.placements.mc_store import NodeStore, remove_job

HALVES = frozenset({((0, 4),), ((4, 8),)})


def _gen(step: int) -> Generation:
    return Generation(step=step, meta={"ledger": [[0, 0, step]]},
                      pieces=[{((0, 4),): np.arange(4, dtype=np.float32) + step},
                              {(): np.array(7, dtype=np.int32)},
                              {((0, 2),): np.array([1.5, -2.25], dtype=jnp.bfloat16)}],
                      regions=[HALVES, frozenset({()}), frozenset({((0, 2),)})])


def test_a_generation_reads_back_bit_for_bit_as_read_only_maps(tmp_path) -> None:  # noqa: ANN001
    store = NodeStore(str(tmp_path), 3)
    held = store.put("own", _gen(10))
    assert held.step == 10 and held.meta == {"ledger": [[0, 0, 10]]} and held.regions == _gen(10).regions
    for got, want in zip(held.pieces, _gen(10).pieces, strict=True):
        assert got.keys() == want.keys()
        for region in want:
            assert got[region].dtype == want[region].dtype and got[region].shape == want[region].shape
            np.testing.assert_array_equal(got[region], want[region])
            assert not got[region].flags.writeable
    assert not [n for n in os.listdir(os.path.join(store.dir, "own")) if n.startswith(".")]  # no temporaries left


def test_a_new_process_for_the_slice_finds_what_the_dead_one_left(tmp_path) -> None:  # noqa: ANN001
    first = HostSnapshots(keep=2, store=NodeStore(str(tmp_path), 1))
    for step in (5, 10, 15):
        first.add_own(_gen(step))
    first.add_buddy(0, _gen(15))
    del first  # the process dies; its node's files stay

    second = HostSnapshots(keep=2, store=NodeStore(str(tmp_path), 1))
    assert second.adopt() == 3  # own 10 and 15 (5 was trimmed), the buddy copy of 15
    held = second.held()
    assert sorted(held) == [10, 15] and held[15]["own"]
    np.testing.assert_array_equal(second.find(15, 0, ((1, 3),)), [16.0, 17.0])
    assert common_step([held]) is None  # the second half of leaf 0 is nobody's: not whole
    assert NodeStore(str(tmp_path), 2).load() == {}  # another slice's store is its own

    remove_job(str(tmp_path))
    assert not os.path.exists(tmp_path)


def test_trimmed_generations_leave_the_node(tmp_path) -> None:  # noqa: ANN001
    store = NodeStore(str(tmp_path), 0)
    snaps = HostSnapshots(keep=1, store=store)
    snaps.add_own(_gen(5))
    snaps.add_own(_gen(10))
    assert os.listdir(os.path.join(store.dir, "own")) == ["step-10"]


def test_a_full_store_keeps_the_generation_in_memory(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    store = NodeStore(str(tmp_path), 0)

    def full(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "put", full)
    snaps = HostSnapshots(keep=2, store=store)
    snaps.add_own(_gen(5))
    assert snaps.store_errors == 1 and snaps.held()[5]["own"]
    np.testing.assert_array_equal(snaps.find(5, 0, ((0, 4),)), [5.0, 6.0, 7.0, 8.0])


@pytest.mark.parametrize("kind", ["own", "buddy-2"])
def test_an_incomplete_generation_is_not_found(tmp_path, kind: str) -> None:  # noqa: ANN001
    store = NodeStore(str(tmp_path), 0)
    store.put(kind, _gen(5))
    os.makedirs(os.path.join(store.dir, kind, ".step-10-abc"))  # a writer died mid-way
    assert list(store.load()[kind]) == [5]
