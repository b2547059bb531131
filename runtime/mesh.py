"""A mesh over the healthy slices only.

The default mesh has two axes: ``replica`` across slices (data parallel) and ``local`` inside a
slice. A user ``mesh_fn(devices) -> Mesh`` receives the healthy devices grouped by slice instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .topology import Slice

__all__ = ["REPLICA_AXIS", "LOCAL_AXIS", "MeshFn", "build_mesh", "batch_sharding", "replicated"]

REPLICA_AXIS = "replica"
LOCAL_AXIS = "local"

MeshFn = Callable[[Sequence[Sequence[Any]]], Mesh]


def default_mesh(devices_by_slice: Sequence[Sequence[Any]]) -> Mesh:
    grid = np.array([list(group) for group in devices_by_slice], dtype=object)
    return Mesh(grid, (REPLICA_AXIS, LOCAL_AXIS))


def build_mesh(slices: Sequence[Slice], mesh_fn: MeshFn | None = None) -> Mesh:
    """Mesh over ``slices`` (healthy ones, in index order); ``mesh_fn`` overrides the layout."""
    if not slices:
        raise ValueError("cannot build a mesh over zero slices")
    groups = [list(s.devices) for s in slices]
    mesh = (mesh_fn or default_mesh)(groups)
    wanted = {d.id for g in groups for d in g}
    got = {d.id for d in mesh.devices.flat}
    if got != wanted:
        raise ValueError(
            f"mesh_fn must place exactly the healthy devices {sorted(wanted)} on the mesh, got {sorted(got)}"
        )
    return mesh


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts the whole array on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())
