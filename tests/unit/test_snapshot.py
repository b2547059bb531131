"""The in-memory snapshot tier: host copies of sharded state next to their shards, on 8 CPU devices as 4 slices x 2.

Every test saves from a 4x2 mesh (slice = device.id // 2) and restores onto that mesh or a 3x2 mesh: the first
6 devices (slice 3 gone) or devices [0, 1, 4, 5, 6, 7] (slice 1 gone). Slice loss goes through
``runtime.simulated`` and the snapshotter's guard seam, corruption through ``snapshot.testing``.
"""

from __future__ import annotations

import pickle
import threading
from collections import defaultdict

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest
import structlog.testing
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic import runtime
from elastic.snapshot import (
    HostImage,
    NoSnapshotError,
    SnapshotConfig,
    SnapshotConfigError,
    SnapshotCorruptError,
    SnapshotFailedError,
    SnapshotStructureError,
    Snapshotter,
    SnapshotUnavailableError,
    restore_image,
)
from elastic.snapshot.testing import copies_of, flip_byte

ENGINES = ("host", "device")
TOPOLOGY = runtime.simulated_topology(4, 2)


def slice_of(device) -> int:
    return device.id // 2


def mesh_of(ids: list[int], rows: int) -> Mesh:
    devices = {d.id: d for d in jax.devices()}
    return Mesh(np.array([devices[i] for i in ids]).reshape(rows, -1), ("replica", "local"))


MESH8 = mesh_of(list(range(8)), 4)
MESH6 = mesh_of([0, 1, 2, 3, 4, 5], 3)  # slice 3 gone
MESH6_NO1 = mesh_of([0, 1, 4, 5, 6, 7], 3)  # slice 1 gone
MESHES = {"same": MESH8, "first6": MESH6, "without_slice1": MESH6_NO1}

# Leaves in tree order (dict keys sorted): b, h, keys, lr, n, r, step, w.
SPECS = {
    "b": P(None, "local"),
    "h": P("replica"),
    "keys": P("replica"),
    "lr": None,
    "n": P(),
    "r": P(),
    "step": None,
    "w": P("replica", "local"),
}
META = {
    "epoch": 3,
    "cursor": [7, (1, 2)],
    "nested": {"a": {"b": [1, {"c": (3,)}]}, 4: "four"},
    "big": 2**62,
    "none": None,
}


def make_state(mesh: Mesh = MESH8, seed: int = 0, specs: dict = SPECS) -> dict:
    """Every kind of leaf: f32 over both axes (-0.0, a subnormal), replicated f32, int32 across slices, bf16
    (with a NaN), an int32 scalar, typed PRNG keys across slices, a Python int and a Python float."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(24, 8)).astype(np.float32)
    w[0, 0], w[1, 1] = -0.0, np.float32(1e-45)
    b = rng.normal(size=(24, 4)).astype(jnp.bfloat16)
    b[2, 3] = np.nan
    host = {
        "w": w,
        "r": rng.normal(size=(16,)).astype(np.float32),
        "h": rng.integers(-(2**31), 2**31 - 1, size=(24, 3), dtype=np.int32),
        "b": b,
        "n": np.int32(-123456789 + seed),
    }
    state = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    state["keys"] = jax.device_put(jax.random.split(jax.random.key(seed), 24), NamedSharding(mesh, specs["keys"]))
    state["step"] = 7 + seed
    state["lr"] = 0.5 + seed
    return state


def shardings_on(mesh: Mesh, specs: dict = SPECS) -> dict:
    return {k: None if spec is None else NamedSharding(mesh, spec) for k, spec in specs.items()}


def bits(x) -> tuple:
    """A leaf as comparable bits: dtype and raw bytes for arrays (key data for typed keys), type and value else."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return str(x.dtype), x.shape, np.asarray(jax.random.key_data(x)).tobytes()
        return str(x.dtype), x.shape, np.asarray(x).tobytes()
    return type(x), x


def tree_bits(state) -> dict:
    return jax.tree.map(bits, state, is_leaf=lambda x: not isinstance(x, dict))


def assert_same(restored: dict, expected_bits: dict) -> None:
    assert tree_bits(restored) == expected_bits


def bytes_by_device(snap: Snapshotter, generation: int = -1) -> dict[int, int]:
    held: dict[int, int] = defaultdict(int)
    gen = snap._generations[generation]
    for rec in gen.leaves:
        for piece in rec.pieces:
            for c in piece.copies:
                held[c.device.id] += (
                    int(np.prod([hi - lo for lo, hi in piece.index], dtype=np.int64)) * np.dtype(rec.dtype).itemsize
                )
    return dict(held)


class Recorder:
    """A guard that records every device it is asked about and fails for devices of killed slices."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, devices) -> None:
        devices = list(devices)
        with self._lock:
            self.seen.extend(d.id for d in devices)
        runtime.simulated.check_devices(devices)


@pytest.fixture
def make():
    """Snapshotters over 4 slices x 2 devices, closed (and simulated slices revived) after the test."""
    made: list[Snapshotter] = []

    def build(guard=None, **config) -> Snapshotter:
        config.setdefault("engine", "host")
        snap = Snapshotter(SnapshotConfig(**config), slice_of=slice_of, guard=guard)
        made.append(snap)
        return snap

    yield build
    for snap in made:
        snap.close()
    runtime.simulated.reset()


def saved(snap: Snapshotter, step: int, state, meta=None) -> None:
    snap.save(step, state, meta)
    snap.wait(60)


# -- 1. every kind of leaf, bit for bit -----------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("target", sorted(MESHES))
def test_every_leaf_round_trips_bit_for_bit(make, engine, target):
    snap = make(engine=engine)
    state = make_state()
    expected = tree_bits(state)
    saved(snap, 7, state, META)
    mesh = MESHES[target]
    restored = snap.load(shardings_on(mesh))
    assert (restored.step, restored.tier) == (7, "memory")
    assert_same(restored.state, expected)
    assert restored.meta == META
    assert restored.meta["cursor"][1] == (1, 2) and isinstance(restored.meta["cursor"][1], tuple)
    assert restored.meta["nested"]["a"]["b"][1]["c"] == (3,)
    for key, sharding in shardings_on(mesh).items():
        if sharding is not None:
            assert restored.state[key].sharding == sharding, key
    assert isinstance(restored.state["step"], int) and isinstance(restored.state["lr"], float)
    assert snap.stats()["engine"] == engine


def test_abstract_target_and_returned_meta_is_a_copy(make):
    snap = make()
    state = make_state()
    saved(snap, 7, state, META)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH6_NO1, SPECS[k]))
        if isinstance(v, jax.Array)
        else v
        for k, v in state.items()
    }
    first = snap.load(abstract)
    assert_same(first.state, tree_bits(state))
    first.meta["nested"]["a"]["b"].append("changed")
    assert snap.load(abstract).meta == META


@pytest.mark.parametrize("engine", ENGINES)
def test_restored_state_never_aliases_the_snapshot(make, engine):
    """The restored state keeps its values while later saves reuse the snapshot's buffers, and donating it to
    an in-place step leaves the snapshot intact."""
    snap = make(engine=engine, keep=1)
    specs = {"w": SPECS["w"], "r": P()}

    def put(v: float) -> dict:
        return {
            "w": jax.device_put(np.full((24, 8), v, np.float32), NamedSharding(MESH8, SPECS["w"])),
            "r": jax.device_put(np.full((16,), v, np.float32), NamedSharding(MESH8, P())),
        }

    state = put(1.0)
    expected = tree_bits(state)
    saved(snap, 1, state)
    held = snap.load(shardings_on(MESH8, specs)).state
    for step in range(2, 5):  # every buffer slot is written again
        saved(snap, step, put(float(step)))
    assert_same(held, expected)
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1.0, s), donate_argnums=0)
    jax.block_until_ready(bump(snap.load(shardings_on(MESH8, specs)).state))
    assert_same(snap.load(shardings_on(MESH8, specs)).state, tree_bits(put(4.0)))


# -- 2. placement -------------------------------------------------------------------------


@pytest.mark.parametrize("copies", [1, 2, 3, 4])
def test_every_piece_is_on_distinct_slices(make, copies):
    snap = make(copies=copies)
    saved(snap, 1, make_state())
    gen = snap._generations[-1]
    for i, rec in enumerate(gen.leaves):
        for j, piece in enumerate(rec.pieces):
            slices = [c.slice for c in piece.copies]
            assert len(slices) == copies and len(set(slices)) == copies, (i, j, slices)
            assert all(slice_of(c.device) == c.slice for c in piece.copies)
    assert snap.latest.copies == copies == snap.stats()["copies"]


def test_copies_capped_at_the_number_of_slices(make):
    snap = make(copies=6)
    saved(snap, 1, make_state())
    assert {len(c) for c in [copies_of(snap, leaf=i) for i in (0, 1, 2, 4, 5, 7)]} == {4}
    assert snap.latest.copies == 4


def test_replicated_leaf_is_copied_on_exactly_copies_slices(make):
    snap = make(copies=2)
    saved(snap, 1, make_state())
    r = 5  # leaf "r", replicated on all 8 devices
    gen = snap._generations[-1]
    assert len(gen.leaves[r].pieces) == 1
    assert len({c.slice for c in copies_of(snap, leaf=r)}) == 2
    assert len(copies_of(snap, leaf=r)) == 2


def test_leaf_sharded_across_slices_gets_a_buddy_on_another_slice(make):
    snap = make(copies=2)
    state = make_state()
    saved(snap, 1, state)
    h = 1  # leaf "h": P("replica"), each region lives on one slice only
    shards = state["h"].addressable_shards
    gen = snap._generations[-1]
    assert len(gen.leaves[h].pieces) == 4
    for j, piece in enumerate(gen.leaves[h].pieces):
        home = {slice_of(s.device) for s in shards if s.index[0].start == piece.index[0][0]}
        assert len(home) == 1
        first, buddy = copies_of(snap, leaf=h, piece=j)
        assert first.slice in home  # copied where it lives: no transfer for the first copy
        assert buddy.slice not in home


def test_held_bytes_bounded_after_many_saves(make):
    keep, copies = 2, 2
    snap = make(keep=keep, copies=copies)
    for step in range(6):
        saved(snap, step, make_state(seed=step))
    stats = snap.stats()
    assert stats["state_bytes"] > 0
    assert stats["held_bytes"] <= (keep + 1) * copies * stats["state_bytes"]
    assert stats["generations"] == keep and snap.steps == (4, 5)


def test_bytes_per_device_balanced(make):
    snap = make(copies=2)
    state = {f"p{i}": jax.device_put(np.full((48,), i, np.float32), NamedSharding(MESH8, P())) for i in range(8)}
    saved(snap, 1, state)
    held = bytes_by_device(snap)
    mean = sum(held.values()) / 8
    assert len(held) == 8, held  # every device holds some of it
    assert max(held.values()) <= 2 * mean, held
    assert sum(held.values()) == 2 * 8 * 48 * 4


# -- 3. survivors only --------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_restore_after_slice_loss_reads_only_survivors(make, engine):
    guard = Recorder()
    snap = make(engine=engine, guard=guard)
    state = make_state()
    expected = tree_bits(state)
    saved(snap, 7, state, META)
    runtime.simulated.kill_slice(TOPOLOGY.slice(1))
    guard.seen.clear()
    restored = snap.load(shardings_on(MESH6_NO1))
    assert_same(restored.state, expected)
    assert restored.step == 7
    assert guard.seen, "the guard was never asked"
    assert not {2, 3} & set(guard.seen), guard.seen


def two_slice_state() -> dict:
    """Three leaves; with copies=2 the last replicated leaf ("c") lands on slices {1, 2} only."""
    values = np.arange(48, dtype=np.float32).reshape(24, 2)
    put = lambda spec: jax.device_put(values, NamedSharding(MESH8, spec))  # noqa: E731
    return {"a": put(P()), "b": put(P("replica", "local")), "c": put(P())}


MESH_0_3 = mesh_of([0, 1, 6, 7], 2)  # survivors of slices 1 and 2


def test_losing_every_slice_of_a_piece_is_unavailable_not_wrong(make):
    snap = make(copies=2, guard=Recorder())
    state = two_slice_state()
    saved(snap, 1, state)
    assert {c.slice for c in copies_of(snap, leaf=2)} == {1, 2}  # the construction holds
    for s in (1, 2):
        runtime.simulated.kill_slice(TOPOLOGY.slice(s))
    with pytest.raises(SnapshotUnavailableError) as info:
        snap.load(shardings_on(MESH_0_3, {"a": P(), "b": P("replica", "local"), "c": P()}))
    assert (info.value.step, tuple(info.value.slices)) == (1, (1, 2))
    assert info.value.leaf in (1, 2)  # the first leaf with a piece only there ("b" has one too: home 1, buddy 2)
    assert pickle.loads(pickle.dumps(info.value)).slices == (1, 2)
    with pytest.raises(SnapshotUnavailableError):
        snap.image()


def test_three_copies_survive_two_lost_slices(make):
    snap = make(copies=3, guard=Recorder())
    state = two_slice_state()
    expected = tree_bits(state)
    saved(snap, 1, state)
    for s in (1, 2):
        runtime.simulated.kill_slice(TOPOLOGY.slice(s))
    restored = snap.load(shardings_on(MESH_0_3, {"a": P(), "b": P("replica", "local"), "c": P()}))
    assert_same(restored.state, expected)
    image = snap.image()  # read from the survivors only
    assert restore_image(
        image, jax.tree.structure(state), shardings_on(MESH_0_3, {"a": P(), "b": P("replica"), "c": P()})
    )["c"].shape == (24, 2)


# -- 4. integrity -------------------------------------------------------------------------


@pytest.mark.parametrize("leaf,piece", [(7, 0), (7, 5), (5, 0), (2, 3), (0, 1), (4, 0)])
@pytest.mark.parametrize("copy", [0, 1])
def test_one_corrupt_copy_is_skipped(make, leaf, piece, copy):
    snap = make(keep=2)
    saved(snap, 1, make_state(seed=1))
    state = make_state(seed=2)
    expected = tree_bits(state)
    saved(snap, 2, state)
    assert flip_byte(snap, leaf=leaf, piece=piece, copy=copy, byte=3) == 1
    with structlog.testing.capture_logs() as logs:
        restored = snap.load(shardings_on(MESH8))
    assert restored.step == 2
    assert_same(restored.state, expected)
    assert snap.steps == (1, 2)
    corrupt = [e for e in logs if e["event"] == "snapshot_copy_corrupt"]
    if copy == 0:  # the first copy is tried first: its failure is logged, the second is used
        assert [(e["step"], e["leaf"]) for e in corrupt] == [(2, leaf)]


@pytest.mark.parametrize("leaf", [7, 5, 2, 4])
def test_every_copy_corrupt_falls_back_to_previous_generation(make, leaf):
    snap = make(keep=2)
    older = make_state(seed=1)
    expected = tree_bits(older)
    saved(snap, 1, older, {"at": 1})
    saved(snap, 2, make_state(seed=2), {"at": 2})
    assert flip_byte(snap, leaf=leaf, piece=0) == 2
    with structlog.testing.capture_logs() as logs:
        restored = snap.load(shardings_on(MESH6))
    assert (restored.step, restored.meta) == (1, {"at": 1})
    assert_same(restored.state, expected)
    assert snap.steps == (1,)
    assert any(e["event"] == "snapshot_corrupt" and e["step"] == 2 for e in logs)


def test_every_generation_corrupt_raises(make):
    snap = make(keep=2)
    saved(snap, 1, make_state(seed=1))
    saved(snap, 2, make_state(seed=2))
    flip_byte(snap, leaf=0, piece=1, generation=0)
    flip_byte(snap, leaf=7, piece=2, generation=1)
    with pytest.raises(SnapshotCorruptError) as info:
        snap.load(shardings_on(MESH8))
    assert info.value.step == 1
    assert pickle.loads(pickle.dumps(info.value)).leaf == info.value.leaf
    assert snap.steps == ()
    with pytest.raises(NoSnapshotError):
        snap.load(shardings_on(MESH8))


@pytest.mark.parametrize("held", [1, 2])
def test_tampered_meta_is_corrupt(make, held):
    snap = make(keep=2)
    for step in range(1, held + 1):
        saved(snap, step, make_state(seed=step), {"at": step, "ledger": [step]})
    snap._generations[-1].meta["ledger"].append(99)
    if held == 1:
        with pytest.raises(SnapshotCorruptError) as info:
            snap.load(shardings_on(MESH8))
        assert info.value.leaf == -1
    else:
        restored = snap.load(shardings_on(MESH8))
        assert (restored.step, restored.meta) == (1, {"at": 1, "ledger": [1]})
        assert_same(restored.state, tree_bits(make_state(seed=1)))


# -- 5. failure mid-snapshot ----------------------------------------------------------------


class FailOnCall:
    """A guard that raises the slice-loss error from its ``n``th call on, once armed (``n`` counts from 1):
    a slice lost mid-snapshot. Pieces with a copy written before still complete; pieces left with none
    fail the save."""

    def __init__(self) -> None:
        self.n = 0
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, devices) -> None:
        with self._lock:
            self.calls += 1
            if self.n and self.calls >= self.n:
                raise jax.errors.JaxRuntimeError("UNAVAILABLE: simulated slice lost mid-snapshot")

    def arm(self, n: int) -> None:
        with self._lock:
            self.calls, self.n = 0, n

    def disarm(self) -> None:
        with self._lock:
            self.n = 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("nth", [1, 4, 20])
def test_failed_save_keeps_the_previous_generation(make, engine, nth):
    guard = FailOnCall()
    snap = make(engine=engine, guard=guard, keep=2)
    before = make_state(seed=1)
    expected = tree_bits(before)
    saved(snap, 1, before, {"at": 1})
    guard.arm(nth)
    snap.save(2, make_state(seed=2), {"at": 2})
    with pytest.raises(SnapshotFailedError) as info:
        snap.wait(60)
    assert info.value.step == 2 and "JaxRuntimeError" in info.value.cause
    snap.wait(60)  # raised once only
    stats = snap.stats()
    assert (stats["snapshots_failed"], stats["snapshots_taken"], stats["snapshots_dropped"]) == (1, 1, 0)
    assert snap.steps == (1,)
    guard.disarm()  # the slice is back
    restored = snap.load(shardings_on(MESH6_NO1))
    assert (restored.step, restored.meta) == (1, {"at": 1})
    assert_same(restored.state, expected)
    after = make_state(seed=3)
    saved(snap, 3, after)  # the snapshotter goes on
    assert_same(snap.load(shardings_on(MESH8)).state, tree_bits(after))


def test_failed_save_leaves_nothing_writing_into_reused_buffers(make):
    """A failed save's other copies must be finished (or abandoned) before the next save reuses the slot:
    otherwise the failed step's bytes land in the next generation under a matching checksum."""
    put = lambda v: jax.device_put(np.full((64,), v, np.float32), NamedSharding(MESH8, P()))  # noqa: E731
    release, stale_wrote = threading.Event(), threading.Event()
    phase = {"now": "idle", "stale": None}

    def guard(devices) -> None:
        (device,) = list(devices)
        me = threading.get_ident()
        if me == phase["stale"] and device.id == 3:
            stale_wrote.set()  # the failed save's copy of "b" is written
        elif phase["now"] == "fail" and device.id in (0, 2):  # both copies of "a": the save fails
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: simulated slice lost mid-snapshot")
        elif phase["now"] == "fail" and device.id == 1:
            phase["stale"] = me
            release.wait(1.0)
        elif phase["now"] == "next" and device.id == 3 and me != phase["stale"]:
            release.set()
            stale_wrote.wait(1.0)

    snap = make(keep=1, copies=2, threads=2, guard=guard)
    saved(snap, 1, {"a": put(1), "b": put(1)})
    saved(snap, 2, {"a": put(2), "b": put(2)})
    assert [c.device.id for c in copies_of(snap, leaf=0)] == [0, 2]
    assert [c.device.id for c in copies_of(snap, leaf=1)] == [1, 3]
    phase["now"] = "fail"
    snap.save(3, {"a": put(3), "b": put(3)})
    with pytest.raises(SnapshotFailedError):
        snap.wait(60)
    phase["now"] = "next"
    saved(snap, 4, {"a": put(4), "b": put(4)})
    phase["now"] = "done"
    restored = snap.load(shardings_on(MESH8, {"a": P(), "b": P()}))
    assert restored.step == 4
    assert np.asarray(restored.state["b"]).tolist() == [4.0] * 64


# -- 6. never dropped silently ------------------------------------------------------------


@pytest.mark.parametrize("on_busy", ["coalesce", "wait"])
def test_burst_of_saves_is_accounted(make, on_busy):
    snap = make(on_busy=on_busy, keep=2)
    states = [make_state(seed=s) for s in range(3)]
    for step in range(1, 25):
        snap.save(step, states[step % 3], {"at": step})
    snap.wait(60)
    stats = snap.stats()
    assert stats["snapshots_requested"] == 24
    assert stats["snapshots_dropped"] == 0
    assert stats["snapshots_taken"] + stats["snapshots_coalesced"] + stats["snapshots_failed"] == 24
    if on_busy == "wait":
        assert (stats["snapshots_coalesced"], stats["snapshots_taken"]) == (0, 24)
        assert snap.steps == (23, 24)
    assert snap.latest.step == 24
    restored = snap.load(shardings_on(MESH8))
    assert (restored.step, restored.meta) == (24, {"at": 24})
    assert_same(restored.state, tree_bits(states[0]))


def test_close_counts_a_waiting_save(make):
    snap = make()
    for step in range(1, 6):
        snap.save(step, make_state())
    snap.close()
    stats = snap.stats()
    assert stats["snapshots_dropped"] == 0
    assert stats["snapshots_taken"] + stats["snapshots_coalesced"] == 5
    with pytest.raises(SnapshotConfigError):
        snap.save(6, make_state())


# -- 7. donation ----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_donating_the_state_right_after_save(make, engine):
    stepped = threading.Event()
    snap = make(engine=engine, guard=lambda devices: stepped.wait(10.0))  # no copy is written before the steps
    rng = np.random.default_rng(0)
    state = {
        "w": jax.device_put(rng.normal(size=(384, 512)).astype(np.float32), NamedSharding(MESH8, SPECS["w"])),
        "r": jax.device_put(rng.normal(size=(256, 256)).astype(np.float32), NamedSharding(MESH8, P())),
    }
    expected = tree_bits(state)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 3.0 + 1.0, s), donate_argnums=0)
    snap.save(1, state)
    state = step(state)  # before the copy finished
    state = step(state)
    jax.block_until_ready(state)
    stepped.set()
    snap.wait(60)
    restored = snap.load(shardings_on(MESH8, {"w": SPECS["w"], "r": P()}))
    assert_same(restored.state, expected)


@pytest.mark.parametrize("engine", ENGINES)
def test_save_returns_before_the_state_is_computed_and_the_snapshot_survives_its_donation(make, engine):
    """A pipelined loop saves a state whose step is still running: ``save`` returns at once, and the
    generation holds that step's result although the next step donated it. Twice: the host engine stages the
    first save of a layout with a ``device_put`` and compiles a device-side copy for the later ones."""
    release = threading.Event()

    def held_back(x):  # the step cannot finish until the test says so
        release.wait(20.0)  # a save that waits for this step returns after it, and fails below
        return x

    @jax.jit
    def slow_step(s):
        one = jax.experimental.io_callback(held_back, jax.ShapeDtypeStruct((), jnp.float32), jnp.float32(1.0))
        return jax.tree.map(lambda x: x * 2.0 + one, s)  # exact doubling: one rounding, fused or not

    donated = threading.Event()
    snap = make(engine=engine, guard=lambda devices: donated.wait(20.0))  # no copy is read before the donation
    rng = np.random.default_rng(1)
    state = {
        "w": jax.device_put(rng.normal(size=(384, 512)).astype(np.float32), NamedSharding(MESH8, SPECS["w"])),
        "r": jax.device_put(rng.normal(size=(256, 256)).astype(np.float32), NamedSharding(MESH8, P())),
    }
    for step in (1, 2):
        release.clear()
        donated.clear()
        expected = {k: np.asarray(v) * np.float32(2.0) + np.float32(1.0) for k, v in state.items()}
        state = slow_step(state)
        snap.save(step, state)
        returned_early = not release.is_set()
        release.set()
        state = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.0 - 7.0, s), donate_argnums=0)(state)
        jax.block_until_ready(state)
        donated.set()
        snap.wait(60)
        restored = snap.load(shardings_on(MESH8, {"w": SPECS["w"], "r": P()}))
        assert returned_early, f"save {step} waited for the step it saves"
        assert restored.step == step
        for k, want in expected.items():
            np.testing.assert_array_equal(np.asarray(restored.state[k]), want)
    if engine == "host":
        assert True in snap._engine._copies.values(), "the second save did not stage with the compiled copy"


# -- 8. rollback ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps,held",
    [
        ((10, 20, 30, 20), (10, 20)),  # a rollback: 20 and 30 belong to a discarded future
        ((10, 20, 30, 5), (5,)),
        ((10, 20, 30, 30), (10, 20, 30)),  # a repeat replaces the generation of that step
        ((10, 20, 20), (10, 20)),
        ((10, 20, 30, 40), (20, 30, 40)),  # keep=3
    ],
)
def test_saving_an_older_step_drops_the_newer_generations(make, steps, held):
    snap = make(keep=3)
    states = [make_state(seed=i) for i in range(3)]
    for n, step in enumerate(steps):
        saved(snap, step, states[n % 3], {"n": n})
    assert snap.steps == held
    restored = snap.load(shardings_on(MESH8))
    last = len(steps) - 1
    assert (restored.step, restored.meta, restored.generation) == (steps[-1], {"n": last}, snap.latest.generation)
    assert_same(restored.state, tree_bits(states[last % 3]))


# -- 9. clear errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("keep", 0),
        ("copies", 0),
        ("keep", True),
        ("copies", -1),
        ("threads", 0),
        ("keep", 1.5),
        ("on_busy", "x"),
        ("engine", "tpu"),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(SnapshotConfigError, match=field) as info:
        SnapshotConfig(**{field: value})
    assert isinstance(info.value, ValueError)


def test_load_before_any_save(make):
    snap = make()
    with pytest.raises(NoSnapshotError):
        snap.load(shardings_on(MESH8))
    with pytest.raises(NoSnapshotError):
        snap.image()
    assert snap.latest is None and snap.steps == ()


@pytest.mark.parametrize(
    "target",
    [
        {"w": NamedSharding(MESH8, P())},
        [NamedSharding(MESH8, P())] * 8,
        {**shardings_on(MESH8), "extra": NamedSharding(MESH8, P())},
    ],
)
def test_target_of_another_structure(make, target):
    snap = make()
    state = make_state()
    saved(snap, 1, state)
    with pytest.raises(SnapshotStructureError):
        snap.load(target)
    assert_same(snap.load(shardings_on(MESH8)).state, tree_bits(state))


# -- 10. host images ----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_image_restores_on_another_mesh_and_survives_pickle(make, engine):
    snap = make(engine=engine)
    state = make_state()
    saved(snap, 7, state, META)
    image = pickle.loads(pickle.dumps(snap.image()))
    assert isinstance(image, HostImage) and (image.step, image.generation) == (7, snap.latest.generation)
    image.verify()
    assert {k: v for k, v in image.meta.items() if k != "_values"} == META
    restored = restore_image(image, jax.tree.structure(state), shardings_on(MESH6))
    assert_same(restored, tree_bits(state))
    for key, sharding in shardings_on(MESH6).items():
        if sharding is not None:
            assert restored[key].sharding == sharding, key


def test_image_is_a_copy_and_corruption_is_detected(make):
    snap = make()
    state = make_state()
    saved(snap, 7, state)
    image = snap.image()
    image.leaves[7].pieces[0].data.reshape(-1).view(np.uint8)[0] ^= 0xFF
    with pytest.raises(SnapshotCorruptError):
        restore_image(image, jax.tree.structure(state), shardings_on(MESH6))
    assert_same(snap.load(shardings_on(MESH6)).state, tree_bits(state))  # the held copy is untouched


def test_a_slice_lost_mid_snapshot_leaves_a_usable_snapshot_on_the_survivors(make):
    """The save in flight when slice 1 dies completes with the copies on the other slices (none is
    written to slice 1), and it restores onto the survivors: a dead destination costs a copy, not the
    snapshot."""
    topo = runtime.simulated_topology(4, 2)
    snap = make(guard=runtime.simulated.check_devices, keep=2)
    saved(snap, 1, make_state(seed=1))
    runtime.simulated.kill_slice(topo.slice(1))
    state = make_state(seed=2)
    snap.save(2, state, {"at": 2})
    snap.wait(60)  # no failure
    assert snap.steps == (1, 2)
    newest = snap._generations[-1]
    assert all(c.slice != 1 for leaf in newest.leaves for p in leaf.pieces for c in p.copies)
    restored = snap.load(shardings_on(MESH6_NO1))
    assert restored.step == 2
    assert_same(restored.state, tree_bits(state))


def _pointers(state) -> set[int]:
    arrays = [
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in jax.tree_util.tree_leaves(state)
        if isinstance(x, jax.Array)
    ]
    return {s.data.unsafe_buffer_pointer() for x in arrays for s in x.addressable_shards}


def test_restore_gives_runtime_owned_buffers_that_never_alias_the_snapshot_and_can_be_donated(make):
    """Restored shards are fresh buffers the runtime owns: the generation stays restorable after later saves,
    and the first step donates them (updated in place, not copied)."""
    snap = make(keep=2)
    state2 = make_state(seed=2)
    saved(snap, 2, state2)
    expected = tree_bits(state2)
    held = {c.buffer.ctypes.data for leaf in snap._generations[-1].leaves for p in leaf.pieces for c in p.copies}
    restored = snap.load(shardings_on(MESH6_NO1))
    assert not _pointers(restored.state) & held  # nothing aliases the snapshot
    assert snap.steps == (2,)  # the generation stays
    for step in (3, 4, 5):
        saved(snap, step, make_state(seed=step))  # slots are reused: the restored state is untouched
    assert_same(restored.state, expected)
    again = snap.load(shardings_on(MESH6_NO1))
    w = again.state["w"]
    before = {s.device.id: s.data.unsafe_buffer_pointer() for s in w.addressable_shards}
    after = jax.jit(lambda x: x * 2, donate_argnums=0)(w)
    assert w.is_deleted()
    assert {s.device.id: s.data.unsafe_buffer_pointer() for s in after.addressable_shards} == before  # in place


def test_a_snapshot_in_flight_is_restored_from_its_staged_shards_without_waiting_for_its_copy(make):
    """A failure while a snapshot is still being copied: the restore takes that newest state from the shards the
    save staged (a survivor's own shard stays in place), does not wait for the copy, and stops it."""
    gate, copying = threading.Event(), threading.Event()

    def guard(devices):
        if threading.current_thread().name.startswith("snapshot-copy"):
            copying.set()
            assert gate.wait(30)  # the copy is held here until the restore has returned
        runtime.simulated.check_devices(devices)

    data_parallel = {k: None if v is None else P(*(None if a == "replica" else a for a in v)) for k, v in SPECS.items()}
    snap = make(guard=guard, keep=2)
    gate.set()
    saved(snap, 1, make_state(seed=1, specs=data_parallel))
    gate.clear()
    copying.clear()  # set by step 1's copy: wait for step 2's
    state2 = make_state(seed=2, specs=data_parallel)
    expected = tree_bits(state2)
    # every shard computed, as a state a snapshot follows is (``tree_bits`` reads one replica of a replicated leaf):
    # a shard still being computed has no staged view, and then the restore waits for the copy
    jax.block_until_ready(state2)
    snap.save(2, state2, {"cursor": 2})
    try:
        assert copying.wait(30)
        runtime.simulated.kill_slice(TOPOLOGY.slices[1])
        restored = snap.load(shardings_on(MESH6_NO1, data_parallel))
        assert not gate.is_set()  # returned while the copy was still held
    finally:
        gate.set()
    assert restored.step == 2 and restored.meta == {"cursor": 2}
    assert_same(restored.state, expected)
    source = {
        s.data.unsafe_buffer_pointer() for s in state2["w"].addressable_shards if s.device.id in (0, 1, 4, 5, 6, 7)
    }
    assert _pointers({"w": restored.state["w"]}) & source  # some survivors kept their own shard: nothing moved
    snap.wait(60)
    stats = snap.stats()
    assert stats["snapshots_abandoned"] == 1 and stats["snapshots_dropped"] == 0
    assert snap.steps == (1,)  # the abandoned copy published nothing
    del state2
    assert_same(restored.state, expected)


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_POPULATE"), reason="MAP_POPULATE is Linux's")
def test_a_large_copy_buffer_comes_with_its_pages_in_place_and_a_small_one_is_aligned_too():
    """A snapshot's first generations write into fresh buffers: a large one is mapped with its pages already in
    place (resident before its first write), so that write takes no fault per page (here, in a virtual machine,
    each such first touch cost 10x the copy itself)."""
    import os

    from elastic.snapshot.image import aligned_empty

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    big = aligned_empty((8 << 20,), np.dtype(np.float32))  # 32 MiB, not yet written
    assert resident() - before >= 30 << 20, "the buffer's pages are not in place before its first write"
    big.fill(1.0)
    small = aligned_empty((3, 5), np.dtype(np.int32))
    for buf in (big, small):
        assert buf.ctypes.data % 64 == 0 and buf.flags.writeable
    view = big[:4]  # the array alone holds its mapping open
    del big
    assert view.sum() == 4.0


def test_a_large_copy_buffer_is_populated_with_the_gil_released():
    """Putting a large buffer's pages in place takes milliseconds per MiB here; the snapshot's copy threads do it
    while the training loop's thread runs Python, so it must not hold the GIL: another thread keeps ticking while
    it runs (under the GIL it could tick at most once or twice, before the call began)."""
    import threading
    import time

    from elastic.snapshot import image

    image.aligned_empty((1 << 20,), np.dtype(np.float32))  # libc loaded, the kernel's support learnt
    ticks: list[float] = []
    stop, ticking = threading.Event(), threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            time.sleep(0.0002)
            ticks.append(time.perf_counter())
            ticking.set()

    thread = threading.Thread(target=ticker)
    thread.start()
    assert ticking.wait(10)
    t0 = time.perf_counter()
    buf = image.aligned_empty((128 << 20,), np.dtype(np.float32))  # 512 MiB
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    assert image._madvise is not False, "MADV_POPULATE_WRITE unsupported here (Linux before 5.14)"
    during = sum(t0 < t < t1 for t in ticks)
    assert during >= 5, f"{during} ticks in {1e3 * (t1 - t0):.0f} ms of populating: the GIL was held"
    del buf


def test_the_shards_a_snapshots_views_kept_from_donation_are_released_by_its_thread_at_the_next_generation(make):
    """A computed state is staged as views, which keep the next step from donating the viewed shards; the snapshot
    thread keeps those shards until its next generation, so it (not the loop's thread, dropping the state a step
    later) frees them."""
    snap = make()
    state = jax.block_until_ready(make_state())
    saved(snap, 1, state)
    first = list(snap._retired)
    assert first and all(isinstance(a, jax.Array) and not a.is_deleted() for a in first)
    del state  # the loop drops its state: the viewed shards stay held
    assert all(not a.is_deleted() for a in snap._retired)
    saved(snap, 2, jax.block_until_ready(make_state(seed=1)))
    assert snap._retired and not {id(a) for a in snap._retired} & {id(a) for a in first}
