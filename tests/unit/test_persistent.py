"""The persistent tier: async Orbax checkpoints saved from a 4x2 mesh, restored onto a 3x2 mesh, on 8 CPU devices."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic.snapshot.errors import NoSnapshotError, SnapshotError, SnapshotStructureError
from elastic.snapshot.persistent import PersistentDirectoryError, PersistentTier

from ..conftest import bounded, compile_events

SPECS = {
    "w": P("replica", "local"),
    "r": P(),
    "h": P("replica"),
    "n": P(),
    "keys": P("replica"),
    "opt": (P("local"), [P()]),
}
META = {
    "step": 10,
    "lr": 0.1,
    "big": 2**62,
    "tiny": 5e-324,
    "neg_zero": -0.0,
    "name": "run-1",
    "flag": True,
    "none": None,
    "data": {"epoch": 3, "cursor": [7, 11, 13], "shape": (24, 16)},
    "rng": [(1, 2), [3.5, "x"]],
    "by_slice": {0: 4, 1: 5},
    "tagged": {"__tuple__": [1]},
}


def grid_mesh(rows: int, cols: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("replica", "local"))


def make_state(mesh: Mesh, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(24, 16)).astype(np.float32)
    w[0, 0], w[1, 1] = -0.0, np.float32(1e-45)  # the sign of zero and a subnormal must survive
    h = rng.normal(size=(24, 4)).astype(jnp.bfloat16)
    h[0, 0] = np.nan
    host = {
        "w": w,
        "r": rng.normal(size=(8,)).astype(np.float32),
        "h": h,
        "n": np.int32(-123456789),
        "opt": (rng.normal(size=(6,)).astype(np.float32), [np.float32(2.5)]),
    }
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    state = jax.tree.map(put, host, {k: v for k, v in SPECS.items() if k != "keys"})
    state["keys"] = put(jax.random.split(jax.random.key(seed), 24), SPECS["keys"])
    return state


def abstract_on(mesh: Mesh, state: dict) -> dict:
    return jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), state, SPECS
    )


def host_bits(x: jax.Array) -> tuple[str, bytes]:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(x.dtype), np.asarray(jax.random.key_data(x)).tobytes()
    return str(x.dtype), np.asarray(x).tobytes()


def tree_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint of step 10 saved asynchronously from the 4x2 mesh, with the state it holds."""
    directory = tmp_path_factory.mktemp("persistent")
    state = make_state(grid_mesh(4, 2))
    tier = PersistentTier(directory, every=5, job="job-a")
    assert tier.save(10, state, META) is True
    bounded(tier.wait, 120, "PersistentTier.wait (the started saves durable)")
    stats = tier.stats()
    tier.close()
    return directory, state, stats


def test_restores_bit_for_bit_onto_a_smaller_mesh(saved):
    directory, state, stats = saved
    mesh6 = grid_mesh(3, 2)
    target = abstract_on(mesh6, state)
    with PersistentTier(directory, every=5, job="job-a") as tier:
        step, restored, meta = tier.load(target)
    assert step == 10
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want, abstract in zip(
        jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(target), strict=True
    ):
        assert host_bits(got) == host_bits(want)
        assert got.sharding == abstract.sharding
    assert str(restored["keys"].dtype) == "key<fry>" and str(jax.random.key_impl(restored["keys"])) == "threefry2x32"
    assert meta == META and json.dumps(meta, sort_keys=False) == json.dumps(META, sort_keys=False)
    assert isinstance(meta["data"]["shape"], tuple) and isinstance(meta["rng"][0], tuple)
    assert list(meta["by_slice"]) == [0, 1] and meta["tagged"] == {"__tuple__": [1]}
    assert stats["persistent_saves"] == 1 and stats["persistent_last_step"] == 10
    assert 0 < stats["persistent_blocking_seconds"] < 10


def test_keeps_the_newest_steps_and_never_overwrites(tmp_path):
    mesh = grid_mesh(4, 2)
    with PersistentTier(tmp_path, every=10, keep=2, job="j") as tier:
        started = [tier.save(s, make_state(mesh, seed=s), {"step": s}) for s in range(10, 31) if tier.due(s)]
        assert started == [True, True, True]
        assert tier.save(30, make_state(mesh), {}) is False  # already saved: skipped, not overwritten
        bounded(tier.wait, 120, "PersistentTier.wait (the started saves durable)")
        assert tier.latest_step() == 30
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["20", "30"]
        step, _, meta = tier.load(abstract_on(mesh, make_state(mesh)), step=20)
        assert (step, meta) == (20, {"step": 20})
        assert tier.stats()["persistent_saves"] == 3


def test_same_job_resumes_after_the_old_checkpoints(saved, tmp_path):
    directory, state, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)  # resume on a copy: the shared checkpoint stays as it was
    with PersistentTier(copy, every=5, keep=1, job="job-a") as tier:
        assert tier.latest_step() == 10
        assert tier.save(10, state, {}) is False
        assert tier.save(15, state, {"step": 15}) is True
        bounded(tier.wait, 120, "PersistentTier.wait (the started saves durable)")
    assert sorted(p.name for p in copy.iterdir() if p.name.isdigit()) == ["15"]
    with PersistentTier(copy, every=5, job="job-a") as again:
        assert again.latest_step() == 15


def test_another_jobs_directory_is_refused_untouched(saved, tmp_path):
    directory = saved[0]
    before = tree_files(directory)
    with pytest.raises(PersistentDirectoryError, match="job 'job-a', not 'job-b'"):
        PersistentTier(directory, every=5, job="job-b")
    with pytest.raises(PersistentDirectoryError):
        PersistentTier(directory, every=5)  # an unnamed job is another job too
    assert tree_files(directory) == before

    (tmp_path / "README").write_text("someone else's")
    (tmp_path / "7").mkdir()
    before = tree_files(tmp_path)
    with pytest.raises(PersistentDirectoryError, match="holds no checkpoints of a PersistentTier"):
        PersistentTier(tmp_path, every=5, job="job-a")
    assert tree_files(tmp_path) == before


def test_structure_mismatch_names_the_difference(saved):
    directory, state, _ = saved
    target = abstract_on(grid_mesh(3, 2), state)
    with PersistentTier(directory, every=5, job="job-a") as tier:
        missing = {k: v for k, v in target.items() if k != "h"}
        with pytest.raises(SnapshotStructureError, match=r"missing from target: \['h'\]"):
            tier.load(missing)
        wrong = dict(target, w=jax.ShapeDtypeStruct((24, 8), jnp.float32, sharding=target["w"].sharding))
        with pytest.raises(SnapshotStructureError, match=r"\['w'\]: saved \(24, 16\) float32, target \(24, 8\)"):
            tier.load(wrong)
        rbg = dict(
            target,
            keys=jax.ShapeDtypeStruct((24,), jax.random.key(0, impl="rbg").dtype, sharding=target["keys"].sharding),
        )
        with pytest.raises(SnapshotStructureError, match="key<rbg>"):
            tier.load(rbg)
        unsharded = dict(target, n=jax.ShapeDtypeStruct((), jnp.int32))
        with pytest.raises(SnapshotStructureError, match=r"\['n'\] of abstract_state has no sharding"):
            tier.load(unsharded)


def test_empty_directory_has_no_snapshot(tmp_path):
    with PersistentTier(tmp_path / "new", every=3, job="j") as tier:
        assert tier.latest_step() is None and tier.due(6) and not tier.due(7)
        with pytest.raises(NoSnapshotError):
            tier.load({})
        assert tier.stats() == {"persistent_saves": 0, "persistent_blocking_seconds": 0.0, "persistent_last_step": None}


def test_missing_step_and_bad_arguments(saved, tmp_path):
    with PersistentTier(saved[0], every=5, job="job-a") as tier, pytest.raises(NoSnapshotError, match="step 20"):
        tier.load({}, step=20)
    for kwargs in ({"every": 0}, {"every": 5, "keep": 0}):
        with pytest.raises(ValueError, match="at least 1"):
            PersistentTier(tmp_path, **kwargs)
    with PersistentTier(tmp_path / "m", every=1, job="j") as tier, pytest.raises(TypeError, match=r"meta\['x'\]"):
        tier.save(1, {"a": jnp.zeros(3)}, {"x": object()})
    assert issubclass(PersistentDirectoryError, SnapshotError)


def test_first_save_on_a_new_mesh_compiles_nothing_and_keeps_the_key_impl(tmp_path):
    # Orbax's replica-parallel saving jits a slice per device and shape: 2-5 s on the first save of each mesh.
    mesh = Mesh(np.array(jax.devices()[2:6]).reshape(2, 2), ("replica", "local"))
    state = make_state(mesh, seed=3)
    state["keys"] = jax.device_put(jax.random.split(jax.random.key(3, impl="rbg"), 24), state["keys"].sharding)
    jax.block_until_ready(state)
    with PersistentTier(tmp_path, every=1, job="j") as tier:
        with compile_events() as compiles:
            tier.save(1, state, {})
        assert compiles == []
        _, restored, _ = tier.load(abstract_on(grid_mesh(4, 2), state))
    assert str(jax.random.key_impl(restored["keys"])) == "rbg"
    assert host_bits(restored["keys"]) == host_bits(state["keys"])
