"""Simulated slice loss: guarded computations, slice probes, and resharding onto the survivors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic import runtime
from elastic.runtime import simulated
from elastic.runtime.topology import simulated_topology


@pytest.fixture
def topo():
    simulated.reset()
    yield simulated_topology(4, 2)
    simulated.reset()  # never leak dead devices into other tests


def on_slices(topo, indices):
    """A (len(indices) * 2,) array sharded over those slices' devices, and the devices."""
    devices = [d for s in topo.select(indices) for d in s.devices]
    mesh = Mesh(np.array(devices), ("d",))
    x = jax.device_put(jnp.arange(len(devices) * 2, dtype=jnp.float32), NamedSharding(mesh, P("d")))
    return x, devices


def double_sum(x):
    return (x * 2).sum()


@pytest.mark.parametrize("killed", [0, 1, 2, 3])
def test_guarded_fails_as_slice_loss_on_killed_slice(topo, killed):
    x, devices = on_slices(topo, [0, 1, 2, 3])
    step = runtime.guarded(jax.jit(double_sum), devices)
    assert float(step(x)) == float(np.arange(16).sum() * 2)

    simulated.kill_slice(topo.slice(killed))
    assert simulated.dead_device_ids() == topo.slice(killed).device_ids
    with pytest.raises(runtime.DeviceUnavailableError) as info:
        step(x)
    assert runtime.is_slice_loss(info.value)
    assert runtime.classify_failure(info.value) is runtime.FailureKind.SLICE_LOSS
    assert f"[{killed}]" in str(info.value)

    survivors = [i for i in range(4) if i != killed]
    y, other = on_slices(topo, survivors)
    assert set(d.id for d in other).isdisjoint(topo.slice(killed).device_ids)
    assert float(runtime.guarded(jax.jit(double_sum), other)(y)) == float(np.arange(12).sum() * 2)

    assert runtime.probe_slices(topo.slices) == frozenset({killed})

    simulated.revive_slice(topo.slice(killed))
    assert simulated.dead_device_ids() == frozenset()
    assert float(step(x)) == float(np.arange(16).sum() * 2)
    assert runtime.probe_slices(topo.slices) == frozenset()


@pytest.mark.parametrize(
    ("killed", "used", "fails"),
    [
        pytest.param([1, 3], [0, 2], False, id="two-dead-untouched"),
        pytest.param([1, 3], [2, 3], True, id="two-dead-one-touched"),
        pytest.param([0], [0], True, id="single-slice"),
        pytest.param([], [0, 1, 2, 3], False, id="none-dead"),
    ],
)
def test_guarded_only_fails_when_touching_dead_devices(topo, killed, used, fails):
    for k in killed:
        simulated.kill_slice(topo.slice(k))
    x, devices = on_slices(topo, used)
    step = runtime.guarded(jax.jit(double_sum), devices)
    if fails:
        with pytest.raises(runtime.DeviceUnavailableError) as info:
            step(x)
        assert runtime.is_slice_loss(info.value)
    else:
        assert float(step(x)) == float(np.arange(len(devices) * 2).sum() * 2)
    assert runtime.probe_slices(topo.slices) == frozenset(killed)


def test_probe_several_killed_then_reset(topo):
    simulated.kill_slice(topo.slice(0))
    simulated.kill_slice(topo.slice(2))
    assert runtime.probe_slices(topo.slices) == frozenset({0, 2})
    assert runtime.probe_slices(topo.select([1, 3])) == frozenset()
    simulated.reset()
    assert runtime.probe_slices(topo.slices) == frozenset()


def test_wait_ready_reports_loss_during_step(topo):
    x, devices = on_slices(topo, [0, 1])
    out = runtime.guarded(jax.jit(double_sum), devices)(x)
    simulated.kill_slice(topo.slice(1))  # the slice dies while the result is in flight
    with pytest.raises(runtime.DeviceUnavailableError) as info:
        runtime.wait_ready(out, devices)
    assert runtime.is_slice_loss(info.value)
    y, other = on_slices(topo, [2, 3])
    assert runtime.wait_ready(y, other) is y


def test_devices_of(topo):
    x, devices = on_slices(topo, [1, 2])
    assert simulated.devices_of({"x": x, "n": 3}) == set(devices)


def test_guarded_keeps_name():
    def my_step(x):
        return x

    assert runtime.guarded(my_step, []).__name__ == "my_step"


def mesh_n(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("d",))


def test_reshard_8_to_6_keeps_values(topo):
    src = mesh_n(8)
    w = np.arange(48 * 3, dtype=np.float32).reshape(48, 3) / 7
    b = np.array([1.5, -0.0, 3.25], dtype=np.float32)
    state = {"w": jax.device_put(w, NamedSharding(src, P("d"))), "b": jax.device_put(b, NamedSharding(src, P()))}
    dst = build_survivor_mesh(topo)
    specs = {"w": P("replica"), "b": P()}
    shardings = runtime.as_shardings(dst, specs)
    assert all(isinstance(s, NamedSharding) for s in shardings.values())
    out = runtime.reshard(state, shardings)
    assert out["w"].sharding == shardings["w"] and out["b"].sharding == shardings["b"]
    assert out["w"].sharding.device_set == set(dst.devices.flat) and len(out["w"].sharding.device_set) == 6
    np.testing.assert_array_equal(np.asarray(out["w"]).view(np.uint32), w.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(out["b"]).view(np.uint32), b.view(np.uint32))


def build_survivor_mesh(topo) -> Mesh:
    """The default mesh over slices 0, 1 and 3 (slice 2 lost)."""
    return runtime.build_mesh(topo.select([0, 1, 3]))


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param({"w": P("d")}, id="missing-leaf"),
        pytest.param({"w": P("d"), "b": P(), "c": P()}, id="extra-leaf"),
        pytest.param([P("d"), P()], id="list-not-dict"),
        pytest.param({"w": (P("d"),), "b": P()}, id="nested"),
    ],
)
def test_reshard_structure_mismatch(specs):
    mesh = mesh_n(6)
    state = {"w": jnp.zeros((6, 2)), "b": jnp.zeros(())}
    with pytest.raises(runtime.StructureError) as info:
        runtime.reshard(state, runtime.as_shardings(mesh, specs))
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "2 leaves" in msg and "one sharding or PartitionSpec per array leaf" in msg


def test_check_structure_accepts_specs_and_shardings():
    mesh = mesh_n(2)
    state = {"a": jnp.zeros((2,)), "b": [jnp.zeros(()), jnp.ones(())]}
    runtime.check_structure(state, {"a": P("d"), "b": [P(), NamedSharding(mesh, P())]})
