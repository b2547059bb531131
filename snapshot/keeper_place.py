"""Where a job's keepers go (one per alive node other than the client's, where the cluster has any) and how one is
created there: a detached :class:`~snapshot.keeper_actor.Keeper` pinned to its node."""

from __future__ import annotations

from typing import Any

import ray
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .errors import KeeperAccessError
from .keeper_actor import Keeper

__all__ = ["create_keeper", "keepers_for", "placements"]

log = structlog.get_logger("snapshot.keeper")


def _other_nodes(avoid_node: str) -> list[str]:
    """Alive nodes that can host an actor, other than ``avoid_node``."""
    return sorted(
        node["NodeID"]
        for node in ray.nodes()
        if node.get("Alive") and node.get("Resources") and node["NodeID"] != avoid_node
    )


def keepers_for(wanted: int, avoid_node: str | None = None) -> int:
    """How many keepers a job should run: ``wanted``, at most one per alive node other than ``avoid_node`` (the
    client's, by default), and one where there is no other node (logged as ``keepers_capped``). Two keepers on one
    node hold the same bytes in the same memory and survive the same faults: the second costs a copy per push and
    its memory for nothing."""
    fit = max(1, min(wanted, len(_other_nodes(avoid_node or ray.get_runtime_context().get_node_id()))))
    if fit < wanted:
        log.info("keepers_capped", keepers=wanted, started=fit, why="one keeper per node other than the client's")
    return fit


def placements(n: int, avoid_node: str) -> list[str]:
    """Node ids for ``n`` keepers: spread over alive nodes other than ``avoid_node``, else on it."""
    others = _other_nodes(avoid_node)
    return [others[i % len(others)] for i in range(n)] if others else [avoid_node] * n


def create_keeper(name: str, namespace: str, node: str, keep: int, access: str | None) -> Any:
    """A new detached keeper ``name`` in ``namespace`` on ``node`` (a hard affinity), holding ``keep`` images and
    answering calls whose credential hashes to ``access``. A name held already is refused
    (:class:`~snapshot.errors.KeeperAccessError`): nothing of the actor holding it is loaded or called."""
    try:
        return Keeper.options(  # type: ignore[attr-defined]  # a ray actor class
            name=name,
            namespace=namespace,
            lifetime="detached",
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(keep, access)
    except ValueError as err:
        raise KeeperAccessError(
            f"keeper name {name!r} in namespace {namespace!r} is held by an actor this job did not create: it was "
            "not used"
        ) from err
