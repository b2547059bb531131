"""Slices: groups of devices that fail together.

A TPU slice is found from ``device.slice_index``; any other local devices are grouped by a configured
size (:func:`device_topology` is the job's own devices, checked against the slices it asks for); and a simulated
N x M topology groups forced CPU devices for tests and the demo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

__all__ = ["Slice", "Topology", "TopologyError", "device_topology", "simulated_topology", "topology_from_devices"]


class TopologyError(ValueError):
    """The devices cannot be grouped into slices as asked."""


@dataclass(frozen=True, kw_only=True)
class Slice:
    """One failure domain: ``index`` is stable for the life of the job."""

    index: int
    devices: tuple[Any, ...]

    @property
    def device_ids(self) -> frozenset[int]:
        """Ids of the slice's devices."""
        return frozenset(d.id for d in self.devices)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Every slice the job was started with, healthy or not, ordered by index."""

    slices: tuple[Slice, ...]

    def __post_init__(self) -> None:
        sizes = {len(s.devices) for s in self.slices}
        if not self.slices:
            raise TopologyError("a topology needs at least one slice")
        if len(sizes) != 1:
            raise TopologyError(f"every slice must hold the same number of devices, got sizes {sorted(sizes)}")

    @property
    def num_slices(self) -> int:
        """Slices in the topology."""
        return len(self.slices)

    @property
    def devices_per_slice(self) -> int:
        """Devices in each slice."""
        return len(self.slices[0].devices)

    @property
    def indices(self) -> frozenset[int]:
        """The slices' indices."""
        return frozenset(s.index for s in self.slices)

    def slice(self, index: int) -> Slice:
        """The slice with ``index``; ``TopologyError`` when there is none."""
        for s in self.slices:
            if s.index == index:
                return s
        raise TopologyError(f"no slice {index}; slices are {sorted(self.indices)}")

    def select(self, indices: frozenset[int] | Sequence[int]) -> tuple[Slice, ...]:
        """The slices named by ``indices``, in index order."""
        return tuple(self.slice(i) for i in sorted(indices))

    def slice_of(self, device: Any) -> int:
        """The index of the slice holding ``device``; ``TopologyError`` when none does."""
        for s in self.slices:
            if device.id in s.device_ids:
                return s.index
        raise TopologyError(f"device {device} belongs to no slice of this topology")


def topology_from_devices(devices: Sequence[Any] | None = None, *, devices_per_slice: int | None = None) -> Topology:
    """Group ``devices`` (default: ``jax.devices()``) into slices.

    Devices that carry ``slice_index`` (TPU multi-slice) are grouped by it; otherwise
    ``devices_per_slice`` must be given and must divide the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if devices_per_slice is None:
        if not all(getattr(d, "slice_index", None) is not None for d in devices):
            raise TopologyError("these devices carry no slice_index: pass devices_per_slice to group them into slices")
        groups: dict[int, list[Any]] = {}
        for d in devices:
            groups.setdefault(int(d.slice_index), []).append(d)
        return Topology(slices=tuple(Slice(index=i, devices=tuple(groups[i])) for i in sorted(groups)))
    if devices_per_slice < 1 or len(devices) % devices_per_slice:
        raise TopologyError(
            f"devices_per_slice={devices_per_slice} does not divide the {len(devices)} devices; "
            f"choose a divisor of {len(devices)}"
        )
    return Topology(
        slices=tuple(
            Slice(index=i, devices=tuple(devices[i * devices_per_slice : (i + 1) * devices_per_slice]))
            for i in range(len(devices) // devices_per_slice)
        )
    )


def simulated_topology(num_slices: int, devices_per_slice: int) -> Topology:
    """``num_slices`` x ``devices_per_slice`` simulated slices over the local CPU devices.

    The CPU device count must have been raised before jax started, e.g. with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` or ``jax.config.update('jax_num_cpu_devices', 8)``.
    """
    need = num_slices * devices_per_slice
    if num_slices < 1 or devices_per_slice < 1:
        raise TopologyError(f"a simulated topology needs positive sizes, got {num_slices} x {devices_per_slice}")
    cpus = jax.devices("cpu")
    if len(cpus) < need:
        raise TopologyError(
            f"{num_slices} slices x {devices_per_slice} devices need {need} CPU devices but jax has {len(cpus)}: "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax is imported, or simulated=False "
            "to train on the devices jax has"
        )
    return topology_from_devices(cpus[:need], devices_per_slice=devices_per_slice)


def device_topology(num_slices: int, devices_per_slice: int, devices: Sequence[Any] | None = None) -> Topology:
    """``num_slices`` x ``devices_per_slice`` slices over the devices jax sees (default ``jax.devices()``): the
    accelerators where there are any, else the CPU.

    Devices of more than one TPU slice (distinct ``slice_index``) are grouped by it; any others by
    ``devices_per_slice``, in order. Every device is used: a count that does not match raises ``TopologyError``
    with one line naming the settings that would fit, and how to simulate slices instead.
    """
    devices = list(jax.devices() if devices is None else devices)
    need = num_slices * devices_per_slice
    kind = f"{getattr(devices[0], 'platform', 'jax')} device" if devices else "device"
    simulate = (
        f"or simulate slices on CPU: simulated=True, with XLA_FLAGS=--xla_force_host_platform_device_count={need} "
        "set before jax is imported"
    )
    indices = {getattr(d, "slice_index", None) for d in devices}
    if None not in indices and len(indices) > 1:
        topo = topology_from_devices(devices)
        if (topo.num_slices, topo.devices_per_slice) != (num_slices, devices_per_slice):
            raise TopologyError(
                f"jax sees {topo.num_slices} TPU slices of {topo.devices_per_slice} devices, but the config asks for "
                f"num_slices={num_slices} x devices_per_slice={devices_per_slice}: set num_slices={topo.num_slices} "
                f"and devices_per_slice={topo.devices_per_slice}, {simulate}"
            )
        return topo
    if len(devices) != need:
        fits = [(len(devices) // per, per) for per in (devices_per_slice, 1) if per and len(devices) % per == 0]
        example = f" (e.g. num_slices={fits[0][0]}, devices_per_slice={fits[0][1]})" if fits else ""
        raise TopologyError(
            f"num_slices={num_slices} x devices_per_slice={devices_per_slice} needs {need} devices but jax sees "
            f"{len(devices)} {kind}{'s' if len(devices) != 1 else ''}: set num_slices and devices_per_slice to "
            f"use them all{example}, {simulate}"
        )
    return topology_from_devices(devices, devices_per_slice=devices_per_slice)
