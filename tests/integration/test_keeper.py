"""The keeper tier holds host images in detached actors that outlive the client and a lost node."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from elastic.snapshot.image import HostImage, LeafImage, Piece, checksum, meta_checksum
from elastic.snapshot.keeper import KeeperTier, keepers_for
from elastic.snapshot.keeper_actor import Keeper

from ..conftest import fresh_cluster

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def make_image(step: int, *, seed: int = 0) -> HostImage:
    """A two-leaf image: ``w`` (24 x 8 float32) in two row pieces, ``b`` (8 int32) in one."""
    w = np.random.default_rng(seed * 1000 + step).standard_normal((24, 8)).astype(np.float32)
    b = np.arange(8, dtype=np.int32) + step
    w_pieces = tuple(
        Piece(index=((r0, r1), (0, 8)), data=w[r0:r1].copy(), checksum=checksum(w[r0:r1]))
        for r0, r1 in ((0, 12), (12, 24))
    )
    meta = {"step": step, "ledger": list(range(step)), "rng": np.array([seed, step], np.uint32)}  # arrays too
    return HostImage(
        step=step,
        generation=step,
        meta=meta,
        meta_checksum=meta_checksum(meta),
        leaves=(
            LeafImage(shape=(24, 8), dtype="float32", pieces=w_pieces),
            LeafImage(shape=(8,), dtype="int32", pieces=(Piece(index=((0, 8),), data=b, checksum=checksum(b)),)),
        ),
    )


def corrupted(image: HostImage) -> HostImage:
    """``image`` with one byte of its first piece changed after the checksum was taken."""
    piece = image.leaves[0].pieces[0]
    data = piece.data.copy()
    data.view(np.uint8)[3] ^= 0xFF
    leaf = dataclasses.replace(
        image.leaves[0], pieces=(dataclasses.replace(piece, data=data),) + image.leaves[0].pieces[1:]
    )
    return dataclasses.replace(image, leaves=(leaf,) + image.leaves[1:])


def assert_same(got: HostImage | None, want: HostImage, *, verify: bool = True) -> None:
    assert got is not None and got.step == want.step and got.meta.keys() == want.meta.keys()
    assert all(np.array_equal(got.meta[k], v) for k, v in want.meta.items())
    if verify:  # meta arrays that came through Ray are read-only; KeeperTier.latest makes them verify again
        got.verify()
    for g, w in zip(got.leaves, want.leaves, strict=True):
        assert [p.index for p in g.pieces] == [p.index for p in w.pieces]
        for gp, wp in zip(g.pieces, w.pieces, strict=True):
            assert gp.data.dtype == wp.data.dtype and np.array_equal(gp.data, wp.data)


def held_steps(tier: KeeperTier) -> list[list[int]]:
    return [ray.get(k.steps.remote(), timeout=30) for _, k in sorted(tier.handles().items())]


def assert_no_keepers_left(namespace: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(e["namespace"] == namespace for e in ray.util.list_named_actors(all_namespaces=True)):  # kill is async
        assert time.monotonic() < deadline, f"keepers of {namespace} still listed {timeout} s after close(kill=True)"
        time.sleep(0.2)


def test_keeper_stores_private_copies_of_object_store_views(ray_local):
    view = ray.get(ray.put(make_image(4)), timeout=30)  # arrays here are read-only views into shared memory
    assert not view.leaves[0].pieces[0].data.flags.writeable
    own = view.private()
    for leaf_view, leaf_own in zip(view.leaves, own.leaves, strict=True):
        for pv, po in zip(leaf_view.pieces, leaf_own.pieces, strict=True):
            assert po.data.flags.writeable and not np.shares_memory(po.data, pv.data)
    assert_same(own, make_image(4))


def test_keeper_actor_keeps_newest_and_drops_a_discarded_future(ray_local):
    keeper = Keeper.remote(keep=2)
    try:
        for step in (5, 10, 15):
            ray.get(keeper.put.remote(make_image(step)), timeout=30)
        assert ray.get(keeper.steps.remote(), timeout=30) == [10, 15]
        rolled = make_image(12, seed=1)
        held = ray.get(keeper.put.remote(rolled), timeout=30)  # a rollback: 15 belongs to a discarded future
        assert ray.get(keeper.steps.remote(), timeout=30) == [10, 12]
        assert held == make_image(10).nbytes + rolled.nbytes == ray.get(keeper.held_bytes.remote(), timeout=30)
        assert_same(ray.get(keeper.latest.remote(), timeout=30), rolled, verify=False)
        ray.get(keeper.put.remote(corrupted(make_image(20))), timeout=30)
        assert_same(ray.get(keeper.latest.remote(), timeout=30), rolled, verify=False)  # the corrupt one is skipped
        assert ray.get(keeper.steps.remote(), timeout=30) == [12]  # ... and dropped
        ray.get(keeper.drop.remote(), timeout=30)
        assert ray.get(keeper.latest.remote(), timeout=30) is None
    finally:
        ray.kill(keeper, no_restart=True)


def test_tier_pushes_coalesces_rolls_back_and_skips_a_corrupt_keeper(ray_local, monkeypatch):
    namespace = f"keeper-test-tier-{os.getpid()}"
    tier = KeeperTier(namespace, num_keepers=2, keep=1).start()
    try:
        here = ray.get_runtime_context().get_node_id()
        assert set(tier.nodes().values()) == {here}  # a one-node cluster: the keepers fall back to the client's node
        assert keepers_for(2) == 1  # ... where a job starts one (two would hold the same bytes in the same memory)
        first = make_image(5)
        assert tier.push(first) and tier.wait(30)
        assert_same(tier.latest(), first)
        stats = tier.stats()
        assert stats["keeper_bytes"] == 2 * first.nbytes and stats["keepers_alive"] == 2, stats
        assert stats["keeper_pushes"] == 1

        # Pushes that come while one is in flight: the push thread is held at its gate (the real send runs once
        # it opens), so at least one queued image is replaced, and counted, whatever the machine's speed.
        gate, send = threading.Event(), tier._send

        def held_send(step: int, ref: object) -> None:
            gate.wait(30)
            send(step, ref)

        monkeypatch.setattr(tier, "_send", held_send)
        for step in (6, 7, 8):
            tier.push(make_image(step))
        gate.set()
        assert tier.wait(30)
        stats = tier.stats()
        assert stats["keeper_coalesced"] >= 1 and stats["keeper_pushes"] + stats["keeper_coalesced"] == 4, stats
        assert stats["keeper_push_failures"] == 0 and stats["keeper_bytes"] == 2 * make_image(8).nbytes
        assert held_steps(tier) == [[8], [8]]  # keep=1: only the newest
        assert_same(tier.latest(), make_image(8))

        rolled = make_image(6, seed=1)  # a rollback to step 6: step 8 belongs to a discarded future
        assert tier.push(rolled) and tier.wait(30)
        assert held_steps(tier) == [[6], [6]]
        assert_same(tier.latest(), rolled)

        ray.get(tier.handles()["keeper-0"].put.remote(corrupted(make_image(9))), timeout=30)
        assert_same(tier.latest(), rolled)  # keeper-0's step 9 fails its checksum: keeper-1's step 6 wins

        thin = KeeperTier.attach(
            namespace, adopt=lambda n: ray.get_actor(n, namespace=namespace), every=2
        )  # a second client of the same keepers
        assert thin is not None
        try:
            sent = [thin.push(make_image(step)) for step in (10, 11, 12, 13)] + [thin.push(make_image(11, seed=3))]
            assert sent == [True, False, True, False, True]  # one in two, and a rollback always
            assert thin.wait(30) and thin.stats()["keeper_skipped"] == 2
            assert_same(tier.latest(), make_image(11, seed=3))
        finally:
            thin.close(kill=False)
    finally:
        tier.close(kill=True)
    assert_no_keepers_left(namespace)


def test_a_push_owns_what_it_sends_once_it_returns(ray_local):
    """The in-memory tier pushes views of its own host buffers and reuses them for the next snapshot: what a
    keeper holds is the image as it was when ``push`` returned, sealed, whatever the buffers hold afterwards."""
    namespace = f"keeper-test-owns-{os.getpid()}"
    tier = KeeperTier(namespace, num_keepers=1, credential="keeper-cred", image_key="image-key").start()
    try:
        want = make_image(4)
        views = make_image(4)  # the same content, in buffers the caller goes on to overwrite
        assert tier.push(views)
        for leaf in views.leaves:
            for piece in leaf.pieces:
                piece.data[...] = 0  # the next snapshot lands here before the keeper's call went out
        assert tier.wait(30) and tier.stats()["keeper_pushes"] == 1
        assert_same(tier.latest(), want)  # latest() refuses an image whose MAC does not check
        bad = dataclasses.replace(make_image(5), meta={"step": 5, "lock": threading.Lock()})  # cannot be pickled
        assert not tier.push(bad) and tier.stats()["keeper_push_failures"] == 1  # counted, not raised
        for step in (5, 6, 7):  # faster than they are sent: a push is left pending when the tier closes
            tier.push(make_image(step))
    finally:
        tier.close(kill=True)  # says which step it abandons (it raised while one was pending)
    assert_no_keepers_left(namespace)


DRIVER = """
import os, signal, ray
from elastic.snapshot.keeper import KeeperTier
from tests.integration.test_keeper import make_image
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
tier = KeeperTier({namespace!r}, num_keepers=2).start()
tier.push(make_image(7, seed=9))
assert tier.wait(60)
print("pushed", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_images_outlive_a_sigkilled_client_and_restore_onto_a_mesh(ray_local):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from elastic.snapshot.image import restore_image

    namespace = f"keeper-test-orphan-{os.getpid()}"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER.format(namespace=namespace))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    tier = KeeperTier.attach(namespace, adopt=lambda n: ray.get_actor(n, namespace=namespace))
    try:
        assert proc.returncode == -signal.SIGKILL and "pushed" in proc.stdout, proc.stderr[-3000:]
        assert tier is not None and sorted(tier.handles()) == ["keeper-0", "keeper-1"]
        image = tier.latest()
        want = make_image(7, seed=9)
        assert_same(image, want)
        mesh = Mesh(np.array(jax.devices()[:8]), ("dev",))
        treedef = jax.tree_util.tree_structure([0, 0])  # the saved state was [w, b]
        shardings = [NamedSharding(mesh, P("dev")), NamedSharding(mesh, P())]
        w, b = restore_image(image, treedef, shardings)
        assert w.sharding == shardings[0] and len(w.addressable_shards) == 8
        assert np.array_equal(np.asarray(w), np.concatenate([p.data for p in want.leaves[0].pieces]))
        assert np.array_equal(np.asarray(b), want.leaves[1].pieces[0].data)
    finally:
        if tier is not None:
            tier.close(kill=True)
    assert_no_keepers_left(namespace)


def test_keepers_live_on_other_nodes_and_survive_losing_one():
    tier, namespace = None, f"keeper-test-nodes-{os.getpid()}"
    with fresh_cluster(1, [{"num_cpus": 1, "wait": False}] * 2) as (cluster, hosts):
        try:
            assert (keepers_for(2), keepers_for(3), keepers_for(1)) == (2, 2, 1)  # one per node besides the client's
            tier = KeeperTier(namespace, num_keepers=2).start()
            nodes = tier.nodes()
            assert sorted(nodes.values()) == sorted(h.node_id for h in hosts), nodes  # not the head, one per node
            image = make_image(3)
            tier.push(image)
            assert tier.wait(30)
            lost = next(h for h in hosts if h.node_id == nodes["keeper-0"])
            cluster.remove_node(lost)
            assert_same(tier.latest(timeout=30), image)
            assert tier.stats()["keepers_alive"] == 1
            tier.close(kill=True)
            assert_no_keepers_left(namespace)
        finally:
            if tier is not None:
                tier.close(kill=True)
