"""A restore lands in the buffers of the state it replaces (``elastic.runtime.landing``), from a snapshot that lent
its bytes (``Snapshotter.load(borrow=True)``)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from elastic.runtime import LAND, StandbyCompiler, land, land_args, landing, landing_pays, owned, refusal
from elastic.snapshot import SnapshotConfig, Snapshotter

from ..conftest import compile_events


def _mesh(devices: list) -> Mesh:
    return Mesh(np.array(devices).reshape(len(devices) // 2, 2), ("replica", "local"))


def _owned(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` in buffers the runtime owns, as a step's outputs are (on CPU an array put from aligned numpy memory
    wraps it, and such a buffer cannot be donated)."""
    # ready, as a dropped state's buffers are once the survivors' probe answered (landing takes none still computing)
    return jax.device_put(jax.device_put(x, sharding), sharding, may_alias=False).block_until_ready()


def _state(mesh: Mesh, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P("local"))
    return {
        "w": _owned(rng.normal(size=(8, 6)).astype(np.float32), sharding),
        "b": _owned(rng.normal(size=(4,)).astype(np.float32), NamedSharding(mesh, P())),
        "key": jax.random.key(seed),
        "count": 3,
    }


def _abstract(state: dict, mesh: Mesh) -> dict:
    specs = {"w": P("local"), "b": P(), "key": P(), "count": None}
    return {
        k: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v), sharding=NamedSharding(mesh, specs[k]))
        if specs[k] is not None
        else v
        for k, v in state.items()
    }


def _pointers(x: jax.Array) -> dict[int, int]:
    return {s.device.id: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def test_a_restore_lands_in_the_dropped_states_buffers_on_the_survivors() -> None:
    """The survivors' buffers of the state live at the failure take the restored values: nothing is allocated,
    the old arrays are donated, and every value is the restored one."""
    devices = jax.devices()
    old = _state(_mesh(devices), seed=1)  # 4 slices
    survivors = _mesh([d for d in devices if d.id not in (2, 3)])  # slice 1 lost
    target = _abstract(old, survivors)
    before = {d: p for d, p in _pointers(old["w"]).items() if d not in (2, 3)}

    dst = landing(old, target)
    assert dst is not None and len(dst) == 2  # the two plain arrays; the key and the int pass through
    restored = _state(survivors, seed=2)
    result = land(dst, restored)
    assert result is not None and result.spare == []  # nothing kept in place: every buffer taken
    landed = result.state
    jax.block_until_ready(landed)

    assert _pointers(landed["w"]) == before  # the same memory, now holding the restored values
    assert old["w"].is_deleted() and old["b"].is_deleted()
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(landed[k]), np.asarray(restored[k]))
        assert landed[k].sharding == restored[k].sharding
    assert landed["key"] is restored["key"] and landed["count"] == 3


def test_a_shard_kept_in_place_is_not_copied_and_the_others_land() -> None:
    """A restore that kept some shards in place (a survivor's own buffer of the snapshot's step): those stay as
    they are, in the result; every other shard is copied into the dropped state's buffer on its device. ``owned``
    keeps them too."""
    devices = jax.devices()
    old = _state(_mesh(devices), seed=11)
    survivors = _mesh([d for d in devices if d.id not in (2, 3)])
    target = _abstract(old, survivors)
    before = {d: p for d, p in _pointers(old["w"]).items() if d not in (2, 3)}
    restored = _state(survivors, seed=12)
    mine = _pointers(restored["w"])
    keep_w = frozenset(d for d in survivors.devices.flat if d.id in (0, 5, 6))
    leaves, treedef = jax.tree_util.tree_flatten(restored)
    kept = tuple(keep_w if x is restored["w"] else frozenset() for x in leaves)
    expected = {k: np.asarray(restored[k]) for k in ("w", "b")}

    fresh = owned(restored, kept)
    assert {d: p for d, p in _pointers(fresh["w"]).items() if d in (0, 5, 6)} == {d: mine[d] for d in (0, 5, 6)}
    assert all(_pointers(fresh["w"])[d] != mine[d] for d in (1, 4, 7))

    dst = landing(old, target)
    assert dst is not None
    result = land(dst, restored, kept)
    assert result is not None
    landed = result.state
    jax.block_until_ready(landed)
    # the dropped buffers under the kept shards come back spare, to be freed off the recovery's path
    assert sorted(x.unsafe_buffer_pointer() for x in result.spare) == sorted(before[d] for d in (0, 5, 6))
    got = _pointers(landed["w"])
    assert {d: got[d] for d in (0, 5, 6)} == {d: mine[d] for d in (0, 5, 6)}  # kept: nothing moved
    assert {d: got[d] for d in (1, 4, 7)} == {d: before[d] for d in (1, 4, 7)}  # copied into the dropped buffers
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(landed[k]), expected[k])
        assert landed[k].sharding == restored[k].sharding
        for shard in landed[k].addressable_shards:  # every device holds its own region of the restored value
            np.testing.assert_array_equal(np.asarray(shard.data), expected[k][shard.index])
    assert old["w"].is_deleted()


def test_a_landing_needs_every_buffer_ready_and_whole() -> None:
    """No landing when a leaf of the dropped state is still computing, was donated, has shards of another shape, or
    the tree differs; the same state once computed lands."""
    devices = jax.devices()
    mesh = _mesh(devices)
    target = _abstract(_state(mesh), mesh)
    release = threading.Event()

    def gated(x: jax.Array) -> jax.Array:  # ready once ``release`` is set (bounded: the test ends either way)
        token = io_callback(
            lambda t: (release.wait(30), t)[1],
            jax.ShapeDtypeStruct((), jnp.int32),
            jnp.int32(0),
            sharding=SingleDeviceSharding(devices[0]),
        )
        return jax.lax.optimization_barrier((token, x))[1] + 1

    computing = _state(mesh)
    computing["w"] = jax.jit(gated, out_shardings=computing["w"].sharding)(computing["w"])
    try:
        assert landing(computing, target) is None
    finally:
        release.set()
    jax.block_until_ready(computing["w"])
    assert landing(computing, target) is not None

    donated = _state(mesh)
    jax.jit(lambda x: x + 1, donate_argnums=0)(donated["w"])
    assert landing(donated, target) is None

    other_shape = _state(mesh)
    other_shape["w"] = _owned(np.zeros((8, 6), np.float32), NamedSharding(mesh, P()))  # whole on each device
    assert landing(other_shape, target) is None

    assert landing({"w": _state(mesh)["w"]}, target) is None  # another structure


def test_the_same_buffer_twice_is_not_landed_in_twice() -> None:
    """A dropped state holding one array in two leaves gives no landing: a buffer donated twice in one call fails."""
    mesh = _mesh(jax.devices())
    x = _owned(np.ones((8, 6), np.float32), NamedSharding(mesh, P("local")))
    target = {k: jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(mesh, P("local"))) for k in "ab"}
    assert landing({"a": x, "b": x}, target) is None


def test_a_state_that_reads_a_landing_buffer_is_not_landed() -> None:
    """When the restored state reads the memory of a buffer it would land in (its own shard, or a view of one),
    ``land`` does nothing and says so; ``owned`` copies it into fresh buffers instead."""
    mesh = _mesh(jax.devices())
    old = _state(mesh, seed=4)
    target = _abstract(old, mesh)
    dst = landing(old, target)
    assert dst is not None
    assert land(dst, old) is None  # the very same buffers
    view = dict(old, w=jax.make_array_from_single_device_arrays(
        (8, 6), old["w"].sharding, [jax.device_put(np.asarray(s.data), s.device) for s in old["w"].addressable_shards]
    ))  # fmt: skip
    assert land(dst, view) is None  # views of them (on CPU a host array is wrapped without a copy)
    assert not old["w"].is_deleted()

    copy = owned(view)
    assert set(_pointers(copy["w"]).values()).isdisjoint(_pointers(old["w"]).values())
    np.testing.assert_array_equal(np.asarray(copy["w"]), np.asarray(old["w"]))


def test_a_landing_onto_a_standby_mesh_compiles_nothing() -> None:
    """The landing program recorded on one mesh (``land_args``) and compiled ahead for the survivors' mesh by the
    standby compiler serves the landing there: no compilation on the way."""
    devices = jax.devices()
    full, survivors = _mesh(devices), _mesh([d for d in devices if d.id not in (2, 3)])
    old = _state(full, seed=8)
    standby = StandbyCompiler()
    try:
        standby.record(LAND, land_args(old), full)
        standby.prepare([survivors])
        assert standby.wait(60) and standby.ready(survivors)
    finally:
        standby.close()
    target = _abstract(old, survivors)
    with compile_events() as compiles:
        dst = landing(old, target)
        assert dst is not None
        landed = land(dst, _state(survivors, seed=9))
        assert landed is not None
        jax.block_until_ready(landed)
    assert compiles == []


def test_a_borrowed_restore_holds_the_snapshots_values_and_says_so() -> None:
    """``load(borrow=True)`` gives the same values as an owned load, marked borrowed: on CPU its shards wrap the
    snapshot's host bytes. An owned load never aliases them."""
    mesh = _mesh(jax.devices())
    state = _state(mesh, seed=5)
    snaps = Snapshotter(SnapshotConfig(copies=2, keep=2, engine="host"), slice_of=lambda d: d.id // 2)
    try:
        snaps.save(7, state)
        snaps.wait(30)
        target = _abstract(state, mesh)
        lent = snaps.load(target, borrow=True)
        kept = snaps.load(target)
        assert lent.borrowed and not kept.borrowed
        for k in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(lent.state[k]), np.asarray(state[k]))
            np.testing.assert_array_equal(np.asarray(kept.state[k]), np.asarray(state[k]))
        dst = landing(_state(mesh, seed=6), target)
        assert dst is not None
        landed = land(dst, lent.state)
        assert landed is not None
        np.testing.assert_array_equal(np.asarray(landed.state["w"]), np.asarray(state["w"]))
        again = snaps.load(target)  # the snapshot is intact after the landing
        np.testing.assert_array_equal(np.asarray(again.state["w"]), np.asarray(state["w"]))
    finally:
        snaps.close()


def test_a_paused_copy_holds_until_resumed_or_waited_for() -> None:
    """``pause`` holds the copy in flight between pieces; ``wait`` (any waiter) lets it go on."""
    mesh = _mesh(jax.devices())
    snaps = Snapshotter(SnapshotConfig(copies=2, keep=2, engine="host"), slice_of=lambda d: d.id // 2)
    try:
        snaps.pause()
        snaps.save(1, _state(mesh))
        with snaps._cv:
            done = snaps._cv.wait_for(lambda: snaps.latest is not None, 0.3)
        assert not done
        snaps.wait(30)  # resumes it
        assert snaps.latest is not None and snaps.latest.step == 1
    finally:
        snaps.close()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_landing_is_for_cpu_memory_only(platform: str) -> None:
    class _Device:
        def __init__(self, platform: str) -> None:
            self.platform = platform

    assert not landing_pays([_Device("cpu"), _Device(platform)])


def test_a_restore_that_does_not_land_says_why_and_one_that_lands_says_nothing() -> None:
    """The placement's landing step: a state that reads the buffers it would donate is copied into fresh ones, and
    the reason goes to the timeline's ``restored`` event (``not_landed``); a state that can land gives no reason."""
    from elastic.placements.local import LocalPlacement

    devices = jax.devices()
    mesh = _mesh(devices)
    old = _state(mesh, seed=5)
    dst = landing(old, _abstract(old, mesh))
    assert dst is not None
    copy, why, spare = LocalPlacement._land(dst, old, (), tuple(devices))
    assert "the dropped state's own buffers" in why and spare == []
    np.testing.assert_array_equal(np.asarray(copy["w"]), np.asarray(old["w"]))

    restored = _state(mesh, seed=6)
    landed, why, _ = LocalPlacement._land(dst, restored, (), tuple(devices))
    assert why == ""
    np.testing.assert_array_equal(np.asarray(landed["w"]), np.asarray(restored["w"]))


def test_refusal_tells_a_restore_of_the_dropped_states_own_buffers_from_one_that_reads_another_device_s() -> None:
    """A loss at the step of a snapshot still in flight restores the very buffers the landing would donate (their
    own device's); a replicated leaf restored from one device's copy reads it from the others. Neither lands, and
    the reason says which; a state apart from the dropped one lands."""
    devices = jax.devices()
    mesh = _mesh(devices)
    old = _state(mesh, seed=9)
    dst = landing(old, _abstract(old, mesh))
    assert dst is not None
    assert "the dropped state's own buffers" in refusal(dst, old)

    b0 = old["b"].addressable_shards[0]  # device 0's copy of the replicated leaf, wrapped on every other device
    b = jax.make_array_from_single_device_arrays((4,), old["b"].sharding, [
        jax.device_put(np.array(b0.data) if s.device == b0.device else np.asarray(b0.data), s.device)
        for s in old["b"].addressable_shards
    ])  # fmt: skip
    assert refusal(dst, dict(_state(mesh, seed=10), b=b)) == "the state reads a buffer it would donate"
    assert refusal(dst, _state(mesh, seed=10)) == ""
