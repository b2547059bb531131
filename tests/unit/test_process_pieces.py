"""The pure and in-process parts of multi-process mode: a worker's host snapshots (its own shards, buddy copies, the
newest step the survivors hold whole), its restore from pieces, the keepers' parts, jitted calls made portable for
the standby group, and the mode's configuration."""

from __future__ import annotations

import pickle

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic import runtime
from elastic.config import ElasticConfig, Processes
from elastic.control.sources import common_step
from elastic.errors import ConfigError
from elastic.placements.holdings import Holdings, regions_of
from elastic.placements.processes import restarted
from elastic.placements.restore import layout_of, restore_state
from elastic.snapshot import HostImage
from elastic.snapshot.image import LeafImage, Piece, checksum
from elastic.snapshot.keeper_actor import _covers

W = 1  # the leaf index of "w" (leaves in key order: "k", "w")


def _mesh(n: int = 4) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(n // 2, 2), ("replica", "local"))


def _state(mesh: Mesh) -> dict:
    rows = NamedSharding(mesh, PartitionSpec(("replica", "local")))
    return {
        "w": jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), rows),
        "k": jax.jit(lambda: jax.random.key(7), out_shardings=NamedSharding(mesh, PartitionSpec()))(),
    }


def _holdings(state: dict, steps: tuple[int, ...], sent: list | None = None) -> Holdings:
    holdings = Holdings(keep=2)
    holdings.begin(lambda d: 0, [sent.append] if sent is not None else [], state)
    leaves = jax.tree_util.tree_leaves(state)
    static = {"_regions": regions_of(leaves), "_layout": layout_of(leaves)}
    for step in steps:
        holdings.save(step, state, {"ledger": {"runs": [[0, 0, step]]}}, static=static)
        holdings.held()  # waits for the copy
    return holdings


def test_a_worker_holds_its_own_regions_and_cuts_any_region_from_them() -> None:
    state = _state(_mesh())
    sent: list[HostImage] = []
    holdings = _holdings(state, (5, 10, 15), sent)
    assert [image.step for image in sent] == [5, 10, 15]  # each generation handed on (the buddy, the keepers)
    for image in sent:
        image.verify()  # the layout added beside the snapshot keeps the image's checksums right
    holdings.end()
    held = holdings.held()
    assert sorted(held) == [10, 15]  # keep=2
    assert held[15]["own"] and len(held[15]["held"][W]) == 4  # the four row blocks of "w"
    np.testing.assert_array_equal(holdings.find(15, W, ((2, 6), (0, 4))), np.arange(8.0, 24.0).reshape(4, 4))
    assert holdings.find(15, W, ((0, 9), (0, 4))) is None  # no piece covers it
    assert holdings.meta(15)["ledger"] == {"runs": [[0, 0, 15]]}


def test_buddy_copies_are_private_and_a_rollback_drops_the_future() -> None:
    holdings = Holdings(keep=2)
    data = np.arange(4.0)
    image = HostImage(
        step=10,
        generation=1,
        meta={"_regions": [[((4, 8),)]]},
        leaves=(
            LeafImage(
                shape=(8,), dtype="float64", pieces=(Piece(index=((4, 8),), data=data, checksum=checksum(data)),)
            ),
        ),
    )
    holdings.hold(3, image)
    data[:] = -1  # the sender's buffer is reused: the copy held here must not change
    np.testing.assert_array_equal(holdings.find(10, 0, ((5, 7),)), [1.0, 2.0])
    holdings.hold(3, HostImage(step=5, generation=2, meta=image.meta, leaves=image.leaves))
    assert sorted(holdings.held()) == [5]  # step 10 belonged to a future the job rolled back from


def test_common_step_is_the_newest_step_the_survivors_hold_whole() -> None:
    halves = [[((0, 4),), ((4, 8),)]]

    def held(*steps_and_regions: tuple[int, bool, list]) -> dict:
        return {step: {"own": own, "held": [regions], "regions": halves} for step, own, regions in steps_and_regions}

    a = held((5, True, [((0, 4),)]), (10, True, [((0, 4),)]), (15, True, [((0, 4),)]))
    b = held((5, True, [((0, 4),)]), (10, True, [((0, 4),), ((4, 8),)]), (15, True, [((0, 4),)]))
    assert common_step([a, b]) == 10  # b holds step 10's second half (a buddy copy of the lost slice's)
    assert common_step([a]) is None  # nobody holds the second half
    assert common_step([]) is None


def test_restore_places_each_device_region_from_local_pieces_or_asks_for_the_rest() -> None:
    mesh4, mesh2 = _mesh(4), _mesh(2)
    state = _state(mesh4)
    holdings = _holdings(state, (10,))
    abstract = jax.eval_shape(lambda: state)
    shardings = {
        "w": NamedSharding(mesh2, PartitionSpec(("replica", "local"))),
        "k": NamedSharding(mesh2, PartitionSpec()),
    }
    meta = holdings.meta(10)
    asked = []
    local = lambda leaf: [p for p in holdings.pieces(10, leaf) if leaf != W or p[0][0][0] < 4]  # noqa: E731

    def fetch(leaf: int, index: tuple, have: list) -> list:
        asked.append((leaf, index))
        return holdings.overlapping(10, leaf, index)

    got = restore_state(abstract, shardings, [tuple(x) for x in meta["_layout"]], local=local, fetch=fetch, what="t")
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
    assert jax.random.key_data(got["k"]).tolist() == jax.random.key_data(state["k"]).tolist()
    assert str(got["k"].dtype) == str(state["k"].dtype)  # a typed key again
    assert asked == [(W, ((4, 8), (0, 4)))]  # only the region the local pieces do not cover crossed


def test_keeper_parts_make_a_whole_step_only_together() -> None:
    def part(lo: int, hi: int) -> HostImage:
        data = np.zeros(hi - lo)
        return HostImage(
            step=5,
            generation=1,
            leaves=(
                LeafImage(
                    shape=(8,), dtype="float64", pieces=(Piece(index=((lo, hi),), data=data, checksum=checksum(data)),)
                ),
            ),
        )

    assert not _covers([part(0, 4)])
    assert _covers([part(0, 4), part(4, 8)])
    assert _covers([part(0, 4), part(0, 4), part(4, 8)])  # replicas of a region count once


def test_a_lost_workers_replacement_is_not_a_restarted_survivor() -> None:
    """Group {0, 1, 2} ran in pids 10, 11, 12. Slice 0 was killed and slice 1 died with it (gloo), and both
    replacements registered before the next group formed: neither is a survivor restarted. Slice 2 re-formed in a
    new process though its own was never lost: that one is. A slice new to the group (3) is neither."""
    last = {0: 10, 1: 11, 2: 12}
    now = {0: 20, 1: 21, 2: 22, 3: 23}
    assert restarted(now, (0, 1, 2), last, gone={0, 1}) == {2}
    assert restarted({0: 10, 1: 11, 2: 12}, (0, 1, 2), last, gone=set()) == set()  # re-formed in place
    assert restarted(now, (0, 1, 2), last, gone={0, 1, 2}) == set()


def test_a_jitted_call_survives_the_trip_to_another_process() -> None:
    fn = jax.jit(lambda x, y: (x * 2, y), donate_argnums=0)
    parts = runtime.standby.portable(fn)
    assert parts is not None and parts[1]["donate_argnums"] == (0,)
    again = runtime.standby.rebuild(*pickle.loads(cloudpickle.dumps(parts)))
    x = jnp.arange(4.0)
    assert again.lower(x, 1.0).as_text() == fn.lower(x, 1.0).as_text()
    assert runtime.standby.portable(lambda x: x) is None  # not a jax.jit function
    mesh = _mesh(2)
    placed = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
    assert runtime.standby.portable(placed) is None  # its shardings name this process's mesh


@pytest.mark.parametrize(
    "overrides, word",
    [
        ({"collective_timeout_s": 0}, "collective_timeout_s"),
        ({"rendezvous_timeout_s": 1.5}, "rendezvous_timeout_s"),
        ({"settle_timeout_s": -1}, "settle_timeout_s"),
        ({"replace_lost": "yes"}, "replace_lost"),
        ({"resources_per_worker": {"GPU": -1}}, "resources_per_worker"),
        ({"resources_per_worker": ["GPU"]}, "resources_per_worker"),
    ],
)
def test_bad_processes_config_is_refused_at_once_naming_the_field(overrides: dict, word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        Processes(**overrides)


def test_a_mode_is_a_config_choice() -> None:
    assert ElasticConfig().mode == "single-process"
    assert ElasticConfig(processes=Processes()).mode == "multi-process"
    with pytest.raises(ConfigError, match="processes"):
        ElasticConfig(processes={"collective_timeout_s": 5})  # type: ignore[arg-type]
    assert Processes().worker_options() == {"num_cpus": 0}
    options = Processes(resources_per_worker={"CPU": 4, "GPU": 8, "trainer_host": 1}).worker_options()
    assert options == {"num_cpus": 4, "num_gpus": 8, "resources": {"trainer_host": 1}}
