"""Host snapshots of sharded state on real meshes over the 8 CPU devices, and restore onto other meshes."""
from __future__ import annotations

import dataclasses
import pickle
from functools import partial

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from snapshot import (
    NoSnapshotError,
    Snapshot,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotStore,
    SnapshotStructureError,
    capture,
    restore,
    verify,
)


def mesh_of(n: int, name: str = "d") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,))


def grid_mesh(rows: int, cols: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("replica", "local"))


def host_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 3)).astype(np.float32)
    w[0, 0] = -0.0  # bit-for-bit: the sign of zero must survive
    w[1, 1] = np.float32(1e-45)  # a subnormal
    return {
        "w": w,  # sharded over every device
        "b": rng.normal(size=(5,)).astype(np.float32),  # replicated
        "emb": rng.integers(-1000, 1000, size=(4, 24)).astype(np.int32),  # sharded on one mesh axis only
        "count": np.array(7, dtype=np.int32),  # a scalar, replicated
    }


def state_on(mesh8_grid: Mesh) -> dict[str, jax.Array]:
    v = host_values()
    return {
        "w": jax.device_put(v["w"], NamedSharding(mesh8_grid, P(("replica", "local")))),
        "b": jax.device_put(v["b"], NamedSharding(mesh8_grid, P())),
        "emb": jax.device_put(v["emb"], NamedSharding(mesh8_grid, P("replica"))),  # replicated across "local"
        "count": jax.device_put(v["count"], NamedSharding(mesh8_grid, P())),
    }


def targets(mesh: Mesh) -> dict[str, NamedSharding]:
    axis = mesh.axis_names
    return {
        "w": NamedSharding(mesh, P(axis)),
        "b": NamedSharding(mesh, P()),
        "emb": NamedSharding(mesh, P(None, axis)),
        "count": NamedSharding(mesh, P()),
    }


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.fixture(scope="module")
def state():
    s = state_on(grid_mesh(4, 2))
    assert len(s["w"].sharding.device_set) == 8 and not s["w"].is_fully_replicated
    assert s["b"].is_fully_replicated
    return s


def test_capture_stores_each_leaf_once(state):
    snap = capture(5, state, {"rng": [1, 2], "data_pos": 640})
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert snap.step == 5 and snap.treedef == treedef
    assert len(snap.leaves) == len(leaves) == len(snap.checksums)
    for leaf, host in zip(leaves, snap.leaves, strict=True):
        assert isinstance(host, np.ndarray)
        assert host.shape == leaf.shape and host.dtype == leaf.dtype
        assert host.nbytes == leaf.nbytes, "a replicated leaf must be stored once, not once per device"
        np.testing.assert_array_equal(bits(host), bits(leaf))
    assert snap.nbytes == sum(leaf.nbytes for leaf in leaves)
    verify(snap)


@pytest.mark.parametrize(
    "make_mesh",
    [
        pytest.param(lambda: mesh_of(6), id="6-devices"),
        pytest.param(lambda: mesh_of(8), id="8-devices"),
        pytest.param(lambda: grid_mesh(3, 2), id="3x2-grid"),
        pytest.param(lambda: mesh_of(1), id="1-device"),
    ],
)
def test_restore_bit_for_bit_onto_mesh(state, make_mesh):
    snap = capture(3, state)
    mesh = make_mesh()
    want = targets(mesh)
    out = restore(snap, want)
    expected = host_values()
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(state)
    for k, arr in out.items():
        assert isinstance(arr, jax.Array)
        assert arr.sharding == want[k], k
        assert arr.sharding.device_set == set(mesh.devices.flat)
        assert arr.dtype == expected[k].dtype and arr.shape == expected[k].shape
        np.testing.assert_array_equal(bits(arr), bits(expected[k]), err_msg=k)
    assert np.signbit(np.asarray(out["w"])[0, 0])
    verify(snap)


def test_meta_round_trips(state):
    meta = {"step": 11, "rng": np.array([3, 4], dtype=np.uint32), "data": {"epoch": 2, "pos": [5, 6]}, "note": "x"}
    snap = capture(11, state, meta)
    assert snap.meta.keys() == meta.keys()
    assert snap.meta["data"] == {"epoch": 2, "pos": [5, 6]} and snap.meta["note"] == "x"
    np.testing.assert_array_equal(snap.meta["rng"], meta["rng"])
    meta["note"] = "changed later"
    assert snap.meta["note"] == "x", "the snapshot keeps its own meta dict"
    assert capture(1, state).meta == {}
    store = SnapshotStore()
    store.save(11, state, {"data": {"pos": 3}})
    got, _ = store.load(targets(mesh_of(8)))
    assert got.meta == {"data": {"pos": 3}} and got.step == 11


def test_capture_non_jax_leaves():
    tree = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": 2.5}
    snap = capture(0, tree)
    out = restore(snap, {"a": NamedSharding(mesh_of(2), P("d")), "b": NamedSharding(mesh_of(2), P())})
    np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])
    assert float(out["b"]) == 2.5


@pytest.mark.parametrize(
    "make_target",
    [
        pytest.param(lambda t: {k: v for k, v in t.items() if k != "b"}, id="missing-leaf"),
        pytest.param(lambda t: {**t, "extra": t["b"]}, id="extra-leaf"),
        pytest.param(lambda t: [t["w"], t["b"], t["emb"], t["count"]], id="list-not-dict"),
        pytest.param(lambda t: {**t, "w": (t["w"],)}, id="nested-tuple"),
    ],
)
def test_restore_structure_mismatch(state, make_target):
    snap = capture(9, state)
    target = make_target(targets(mesh_of(8)))
    with pytest.raises(SnapshotStructureError) as info:
        restore(snap, target)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SnapshotError)
    msg = str(info.value)
    target_def = jax.tree_util.tree_structure(target, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert str(target_def) in msg, "the message must show the target's structure"
    assert str(snap.treedef) in msg, "the message must show the saved structure"
    assert "step 9" in msg


def test_restore_rejects_non_sharding_leaf(state):
    snap = capture(1, state)
    target = {**targets(mesh_of(8)), "b": "not a sharding"}
    with pytest.raises(SnapshotStructureError, match="expected a jax.sharding.Sharding, got str"):
        restore(snap, target)


def _corrupt(snap: Snapshot, leaf: int) -> None:
    a = snap.leaves[leaf]
    a.flags.writeable = True
    a.reshape(-1).view(np.uint8)[0] ^= 0x01


@pytest.mark.parametrize("leaf", [0, 1, 2, 3])
def test_verify_detects_corruption(state, leaf):
    snap = capture(4, state)
    verify(snap)
    _corrupt(snap, leaf)
    with pytest.raises(SnapshotCorruptError) as info:
        verify(snap)
    assert (info.value.step, info.value.leaf) == (4, leaf)
    with pytest.raises(SnapshotCorruptError):
        restore(snap, targets(mesh_of(8)))
    back = pickle.loads(pickle.dumps(info.value))
    assert (back.step, back.leaf) == (4, leaf)


def test_store_latest_falls_back_past_corrupt_generation(state):
    store = SnapshotStore(keep=3)
    store.save(10, state)
    s20 = store.save(20, state)
    s30 = store.save(30, state)
    assert store.latest() is s30
    _corrupt(s30, 1)
    assert store.latest() is s20
    assert store.steps == (10, 20), "a corrupt generation is dropped"
    got, restored = store.load(targets(mesh_of(6)))
    assert got is s20
    np.testing.assert_array_equal(bits(restored["w"]), bits(host_values()["w"]))


def test_store_all_corrupt_raises(state):
    store = SnapshotStore(keep=2)
    for step in (1, 2):
        _corrupt(store.save(step, state), 0)
    with pytest.raises(NoSnapshotError):
        store.latest()
    assert len(store) == 0


@pytest.mark.parametrize(
    ("keep", "steps", "expected"),
    [
        pytest.param(1, [10, 20, 30], (30,), id="keep-1"),
        pytest.param(2, [10, 20, 30], (20, 30), id="keep-2"),
        pytest.param(3, [10, 20], (10, 20), id="keep-3-under"),
        pytest.param(2, [10, 20, 20], (10, 20), id="same-step-replaces"),
        pytest.param(3, [10, 20, 30, 15], (10, 15), id="rollback-drops-newer"),
        pytest.param(3, [10, 20, 30, 20], (10, 20), id="rollback-to-existing-step"),
        pytest.param(3, [10, 20, 30, 5], (5,), id="rollback-before-all"),
        pytest.param(2, [10, 20, 30, 25, 40], (25, 40), id="rollback-then-continue"),
    ],
)
def test_store_generations(state, keep, steps, expected):
    store = SnapshotStore(keep=keep)
    snaps = [store.save(s, state, {"i": i}) for i, s in enumerate(steps)]
    assert store.steps == expected
    assert len(store) == len(expected)
    assert store.latest() is snaps[-1]


def test_store_rejects_bad_keep():
    with pytest.raises(ValueError, match="keep must be at least 1"):
        SnapshotStore(keep=0)


def test_empty_store():
    store = SnapshotStore()
    with pytest.raises(NoSnapshotError) as info:
        store.latest()
    assert isinstance(info.value, LookupError) and isinstance(info.value, SnapshotError)
    with pytest.raises(NoSnapshotError):
        store.load(targets(mesh_of(8)))


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    """``a`` copied to 64-byte aligned memory: where jax's CPU client would alias host memory without a copy."""
    buf = np.empty(a.nbytes + 64, dtype=np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_restored_state_does_not_alias_snapshot(state):
    snap = capture(2, state)
    snap = dataclasses.replace(snap, leaves=tuple(_aligned_copy(a) for a in snap.leaves))
    verify(snap)
    saved = [a.copy() for a in snap.leaves]
    mesh = mesh_of(8)
    expected = host_values()

    # Donating the restored state to a computation leaves the snapshot intact.
    restored = restore(snap, targets(mesh))

    @partial(jax.jit, donate_argnums=0)
    def scribble(s):
        return jax.tree_util.tree_map(lambda x: x * 0 + 123, s)  # reads x, so x's buffers can take the result

    out = scribble(restored)
    jax.block_until_ready(out)
    assert restored["w"].is_deleted(), "donation must have consumed the restored buffers"
    assert int(np.asarray(out["w"])[0, 0]) == 123
    verify(snap)  # the checksums still match: the snapshot's bytes were not reused by the donated buffers
    for a, b in zip(saved, snap.leaves, strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))

    # And the other way: writing into the snapshot's host memory does not reach a restored state.
    again = restore(snap, {k: NamedSharding(mesh_of(1), P()) for k in expected})
    for leaf in snap.leaves:
        leaf.flags.writeable = True
        leaf.reshape(-1).view(np.uint8)[:] ^= 0xFF
    for k, arr in again.items():
        np.testing.assert_array_equal(bits(arr), bits(expected[k]), err_msg=f"restored {k} aliases the snapshot")
