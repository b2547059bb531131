"""Grouping devices into slices, and meshes over the healthy ones."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from elastic.runtime.mesh import LOCAL_AXIS, REPLICA_AXIS, batch_sharding, build_mesh, replicated
from elastic.runtime.topology import (
    Slice,
    Topology,
    TopologyError,
    device_topology,
    simulated_topology,
    topology_from_devices,
)


@dataclass(frozen=True)
class FakeDevice:
    id: int
    slice_index: int | None = None


def fakes(slice_indices: list[int | None]) -> list[FakeDevice]:
    return [FakeDevice(id=i, slice_index=s) for i, s in enumerate(slice_indices)]


@pytest.mark.parametrize(
    ("slice_indices", "expected"),
    [
        pytest.param([0, 0, 1, 1], {0: [0, 1], 1: [2, 3]}, id="two-in-order"),
        pytest.param([1, 0, 1, 0], {0: [1, 3], 1: [0, 2]}, id="interleaved"),
        pytest.param([2, 2, 5, 5, 3, 3], {2: [0, 1], 3: [4, 5], 5: [2, 3]}, id="sparse-indices"),
        pytest.param([0, 0, 0, 0], {0: [0, 1, 2, 3]}, id="one-slice"),
        pytest.param([3, 1, 2, 0], {0: [3], 1: [1], 2: [2], 3: [0]}, id="one-device-each"),
    ],
)
def test_group_by_slice_index(slice_indices, expected):
    topo = topology_from_devices(fakes(slice_indices))
    assert [s.index for s in topo.slices] == sorted(expected)
    assert {s.index: [d.id for d in s.devices] for s in topo.slices} == expected
    assert topo.num_slices == len(expected)
    assert topo.devices_per_slice == len(next(iter(expected.values())))
    assert topo.indices == frozenset(expected)
    for s in topo.slices:
        assert s.device_ids == frozenset(expected[s.index])
        for d in s.devices:
            assert topo.slice_of(d) == s.index


def test_slice_index_takes_precedence_over_order():
    """slice_index decides, not position: a devices_per_slice grouping would differ here."""
    devs = fakes([1, 0, 1, 0])
    assert [d.id for d in topology_from_devices(devs).slice(0).devices] == [1, 3]
    assert [d.id for d in topology_from_devices(devs, devices_per_slice=2).slice(0).devices] == [0, 1]


@pytest.mark.parametrize(
    ("slice_indices", "per", "expected"),
    [
        pytest.param([None] * 8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]], id="8-by-2"),
        pytest.param([None] * 8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], id="8-by-4"),
        pytest.param([None] * 6, 6, [[0, 1, 2, 3, 4, 5]], id="one-slice"),
        pytest.param([None] * 3, 1, [[0], [1], [2]], id="one-each"),
    ],
)
def test_group_by_size(slice_indices, per, expected):
    topo = topology_from_devices(fakes(slice_indices), devices_per_slice=per)
    assert [[d.id for d in s.devices] for s in topo.slices] == expected
    assert [s.index for s in topo.slices] == list(range(len(expected)))


@pytest.mark.parametrize("slice_indices", [[None] * 4, [0, 0, None, None]], ids=["none", "some"])
def test_missing_slice_index_needs_devices_per_slice(slice_indices):
    with pytest.raises(TopologyError, match="pass devices_per_slice"):
        topology_from_devices(fakes(slice_indices))


@pytest.mark.parametrize(("count", "per"), [(8, 3), (6, 4), (8, 0), (8, -2), (3, 5)])
def test_non_divisor_rejected(count, per):
    with pytest.raises(TopologyError) as info:
        topology_from_devices(fakes([None] * count), devices_per_slice=per)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert f"devices_per_slice={per}" in msg and f"choose a divisor of {count}" in msg


@pytest.mark.parametrize(
    ("slices", "match"),
    [
        pytest.param((), "at least one slice", id="empty"),
        pytest.param(
            (Slice(index=0, devices=(FakeDevice(0), FakeDevice(1))), Slice(index=1, devices=(FakeDevice(2),))),
            r"same number of devices.*\[1, 2\]",
            id="uneven",
        ),
    ],
)
def test_topology_rejects(slices, match):
    with pytest.raises(TopologyError, match=match):
        Topology(slices=slices)


def test_uneven_slice_index_groups_rejected():
    with pytest.raises(TopologyError, match="same number of devices"):
        topology_from_devices(fakes([0, 0, 0, 1]))


def test_lookup_errors():
    topo = topology_from_devices(fakes([0, 0, 1, 1]))
    with pytest.raises(TopologyError, match=r"no slice 7; slices are \[0, 1\]"):
        topo.slice(7)
    with pytest.raises(TopologyError, match="belongs to no slice"):
        topo.slice_of(FakeDevice(id=99))
    assert [s.index for s in topo.select({1, 0})] == [0, 1]


def test_simulated_topology_over_cpu_devices():
    assert jax.device_count() == 8, "tests/unit/conftest.py must force 8 CPU devices"
    topo = simulated_topology(4, 2)
    cpus = jax.devices("cpu")
    assert topo.num_slices == 4 and topo.devices_per_slice == 2
    assert [list(s.devices) for s in topo.slices] == [cpus[0:2], cpus[2:4], cpus[4:6], cpus[6:8]]
    assert sorted(topo.indices) == [0, 1, 2, 3]


def test_simulated_topology_smaller_than_devices():
    topo = simulated_topology(3, 2)
    assert [d.id for s in topo.slices for d in s.devices] == [d.id for d in jax.devices("cpu")[:6]]


@pytest.mark.parametrize(("n", "m", "need"), [(5, 2, 10), (3, 3, 9), (1, 16, 16)])
def test_simulated_topology_too_many_devices(n, m, need):
    with pytest.raises(TopologyError) as info:
        simulated_topology(n, m)
    msg = str(info.value)
    assert f"need {need} CPU devices but jax has 8" in msg
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={need}" in msg


@dataclass(frozen=True)
class PlatformDevice:
    id: int
    platform: str = "gpu"
    slice_index: int | None = None


def test_device_topology_uses_every_device_the_machine_has():
    """Real devices (the default): the 8 devices jax sees here, as 4 slices of 2, in order."""
    topo = device_topology(4, 2)
    assert [[d.id for d in s.devices] for s in topo.slices] == [
        [d.id for d in jax.devices()[i : i + 2]] for i in (0, 2, 4, 6)
    ]
    gpus = [PlatformDevice(id=i) for i in range(8)]
    assert [[d.id for d in s.devices] for s in device_topology(2, 4, gpus).slices] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_device_topology_groups_tpu_slices_by_slice_index():
    tpus = [PlatformDevice(id=i, platform="tpu", slice_index=i % 2) for i in range(8)]
    topo = device_topology(2, 4, tpus)
    assert [[d.id for d in s.devices] for s in topo.slices] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(TopologyError) as info:
        device_topology(4, 2, tpus)
    msg = str(info.value)
    assert "jax sees 2 TPU slices of 4 devices" in msg and "set num_slices=2 and devices_per_slice=4" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("n", "m", "have", "fits"),
    [
        pytest.param(4, 2, 1, "num_slices=1, devices_per_slice=1", id="one-cpu"),  # a laptop without XLA_FLAGS
        pytest.param(3, 2, 8, "num_slices=4, devices_per_slice=2", id="fewer-than-the-machine"),  # no idle device
        pytest.param(4, 2, 6, "num_slices=3, devices_per_slice=2", id="more-than-the-machine"),
        pytest.param(2, 4, 6, "num_slices=6, devices_per_slice=1", id="indivisible"),
    ],
)
def test_device_topology_that_does_not_fit_says_what_to_set_in_one_line(n, m, have, fits):
    with pytest.raises(TopologyError) as info:
        device_topology(n, m, [PlatformDevice(id=i) for i in range(have)])
    msg = str(info.value)
    assert "\n" not in msg
    assert f"num_slices={n} x devices_per_slice={m} needs {n * m} devices but jax sees {have} gpu device" in msg
    assert fits in msg
    assert f"simulated=True, with XLA_FLAGS=--xla_force_host_platform_device_count={n * m}" in msg


@pytest.mark.parametrize(("n", "m"), [(0, 2), (2, 0), (-1, 2)])
def test_simulated_topology_non_positive(n, m):
    with pytest.raises(TopologyError, match="positive sizes"):
        simulated_topology(n, m)


@pytest.mark.parametrize("healthy", [(0, 1, 3), (0, 1, 2, 3), (2,), (1, 3)], ids=str)
def test_build_mesh_over_healthy_slices(healthy):
    topo = simulated_topology(4, 2)
    slices = topo.select(healthy)
    mesh = build_mesh(slices)
    assert mesh.axis_names == (REPLICA_AXIS, LOCAL_AXIS) == ("replica", "local")
    assert mesh.devices.shape == (len(healthy), 2)
    assert [[d.id for d in row] for row in mesh.devices] == [[d.id for d in s.devices] for s in slices]
    dead = {d.id for s in topo.slices if s.index not in healthy for d in s.devices}
    assert dead.isdisjoint(d.id for d in mesh.devices.flat)
    assert batch_sharding(mesh).spec == jax.sharding.PartitionSpec(("replica", "local"))
    assert replicated(mesh).is_fully_replicated


def test_build_mesh_custom_mesh_fn():
    topo = simulated_topology(4, 2)
    slices = topo.select([0, 2, 3])
    seen = []

    def flat(groups):
        seen.append([[d.id for d in g] for g in groups])
        return Mesh(np.array([d for g in groups for d in g]), ("data",))

    mesh = build_mesh(slices, flat)
    assert seen == [[[0, 1], [4, 5], [6, 7]]]
    assert mesh.axis_names == ("data",) and mesh.devices.shape == (6,)


@pytest.mark.parametrize(
    "mesh_fn",
    [
        pytest.param(lambda groups: Mesh(np.array([d for g in groups for d in g][:-1]), ("data",)), id="drops-one"),
        pytest.param(lambda groups: Mesh(np.array(jax.devices()), ("data",)), id="adds-dead-devices"),
        pytest.param(lambda groups: Mesh(np.array([g[0] for g in groups]), ("data",)), id="one-per-slice"),
    ],
)
def test_build_mesh_rejects_wrong_devices(mesh_fn):
    slices = simulated_topology(4, 2).select([0, 1, 3])
    with pytest.raises(ValueError, match=r"exactly the healthy devices \[0, 1, 2, 3, 6, 7\]"):
        build_mesh(slices, mesh_fn)


def test_build_mesh_needs_slices():
    with pytest.raises(ValueError, match="zero slices"):
        build_mesh(())
