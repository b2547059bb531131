"""Place a state pytree onto the shardings of a (new) mesh."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

__all__ = ["StructureError", "as_shardings", "check_structure", "reshard"]


class StructureError(ValueError):
    """A state pytree and its shardings do not have the same structure."""


def _is_spec_or_sharding(x: Any) -> bool:
    return isinstance(x, (PartitionSpec, Sharding))


def as_shardings(mesh: Mesh, specs: Any) -> Any:
    """Turn a pytree of ``PartitionSpec`` (or shardings) into ``NamedSharding`` on ``mesh``."""
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s) if isinstance(s, PartitionSpec) else s, specs, is_leaf=_is_spec_or_sharding
    )


def check_structure(state: Any, shardings: Any, *, what: str = "state") -> None:
    """Raise :class:`StructureError` naming the difference when the two trees differ."""
    state_def: Any = jax.tree_util.tree_structure(state)  # a jaxlib PyTreeDef, which mypy cannot resolve
    shard_def: Any = jax.tree_util.tree_structure(shardings, is_leaf=_is_spec_or_sharding)
    if state_def != shard_def:
        raise StructureError(
            f"the {what} and its shardings differ in structure: {what} has {state_def.num_leaves} leaves "
            f"{state_def}, shardings have {shard_def.num_leaves} leaves {shard_def}; "
            "return exactly one sharding or PartitionSpec per array leaf"
        )


def reshard(state: Any, shardings: Any) -> Any:
    """``state`` placed on ``shardings`` (device to device, no gather through the host)."""
    check_structure(state, shardings)
    return jax.device_put(state, shardings)
