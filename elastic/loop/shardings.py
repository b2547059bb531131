"""A job state's shardings on a mesh, from the user's ``shardings_fn``: checked leaf by leaf, with errors that
say which leaf and what to fix. The same in the client and in every worker process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from elastic import runtime
from elastic.errors import ConfigError

__all__ = ["ShardingsFn", "check_splits", "replicate_all", "state_shardings"]

ShardingsFn = Callable[[Mesh], Any]


def replicate_all(abstract_state: Any) -> Callable[[Mesh], Any]:
    """Default shardings: every leaf replicated on every device (data parallel)."""
    return lambda mesh: jax.tree_util.tree_map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract_state)


def _sharding(mesh: Mesh, path: Any, leaf: Any, spec: Any) -> Sharding:
    """One state leaf's sharding on ``mesh``; ``ConfigError`` naming the leaf when ``spec`` does not fit."""
    where = f"state leaf {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)}"
    if isinstance(spec, Sharding):
        return spec
    if not isinstance(spec, PartitionSpec):
        raise ConfigError(
            f"shardings_fn gave {spec!r} ({type(spec).__name__}) for {where}: give a "
            "jax.sharding.PartitionSpec or a Sharding per state leaf"
        )
    axes = [a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(a, str)]
    for axis in axes:
        if axis not in mesh.axis_names:
            raise ConfigError(
                f"{where}: {spec} names mesh axis {axis!r}, but the mesh has axes "
                f"{tuple(mesh.axis_names)}; name only those (or give a mesh_fn with that axis)"
            )
        if axes.count(axis) > 1:
            raise ConfigError(
                f"{where}: {spec} names mesh axis {axis!r} more than once; split a leaf over each "
                "mesh axis at most once"
            )
    if len(spec) > len(leaf.shape):
        raise ConfigError(
            f"{where}: {spec} has {len(spec)} entries for {len(leaf.shape)} dimension(s); give at "
            "most one entry per dimension"
        )
    try:
        return NamedSharding(mesh, spec)
    except ValueError as err:
        raise ConfigError(f"{where}: {spec} does not fit the mesh {dict(mesh.shape)}: {err}") from err


def state_shardings(abstract: Any, shardings_fn: ShardingsFn, mesh: Mesh) -> Any:
    """The shardings of ``abstract``'s leaves on ``mesh`` (``ConfigError`` if the structure differs, or a leaf's
    spec does not fit the mesh or the leaf)."""
    specs = shardings_fn(mesh)
    try:
        runtime.check_structure(abstract, specs)
    except runtime.StructureError as err:
        raise ConfigError(str(err)) from err
    paths = jax.tree_util.tree_leaves_with_path(abstract)
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, (PartitionSpec, Sharding)))
    shardings = [_sharding(mesh, path, leaf, spec) for (path, leaf), spec in zip(paths, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), shardings)


def check_splits(abstract: Any, shardings_fn: ShardingsFn, mesh: Mesh) -> None:
    """``ConfigError`` naming the first state leaf that does not split over ``mesh``."""
    shardings = state_shardings(abstract, shardings_fn, mesh)
    targets = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract), targets, strict=True):
        try:
            sharding.shard_shape(leaf.shape)
        except (ValueError, IndexError) as err:
            raise ConfigError(
                f"state leaf {jax.tree_util.keystr(path)} of shape {leaf.shape} does not split over the "
                f"mesh {dict(mesh.shape)}: {err}; pick sizes that divide every device count you may shrink to"
            ) from err
