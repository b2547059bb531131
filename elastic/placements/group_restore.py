"""A worker's restore when its group forms: the state of the plan's step from the plan's source (the group's host
snapshots, the keepers, an Orbax checkpoint) or initialised, each device given its region
(:func:`elastic.placements.restore.restore_state`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import ray

from elastic.control.sources import Source
from elastic.placements.holdings import Holdings
from elastic.placements.plan import GroupPlan, WorkerSpec
from elastic.placements.restore import Layout, covers, restore_state

__all__ = ["FETCH_TIMEOUT_S", "ask_peers", "restore_group"]

FETCH_TIMEOUT_S = 30.0


def restore_group(
    plan: GroupPlan,
    abstract: Any,
    shardings: Any,
    *,
    me: int,
    spec: WorkerSpec,
    holdings: Holdings,
    keepers: Callable[[], Any],
) -> tuple[Any, dict[str, Any] | None]:
    """The state of ``plan.step`` from ``plan.source`` on ``shardings`` (``abstract``: its shapes), and its
    snapshot's meta (None for a fresh start at step 0). ``me``: this worker's slice; ``keepers``: the job's
    keeper tier, asked for only by a keeper restore (None: none)."""
    if plan.source is Source.FRESH:
        if spec.init_from is not None:
            from elastic.control import orbax_io

            path, _ = orbax_io.resolve(spec.init_from)
            state = orbax_io.restore_onto(path, abstract, shardings)
            start = spec.init_step
            return state, ({"ledger": {"runs": [[0, 0, start]]}, "extras": {}} if start else None)
        return jax.jit(spec.init_fn, out_shardings=shardings)(jax.random.key(spec.config.seed)), None
    step = plan.step
    assert step is not None
    if plan.source is Source.PERSISTENT:
        from elastic.snapshot.persistent import PersistentTier

        tier = PersistentTier(
            spec.config.tiers.persistent_dir,  # type: ignore[arg-type]
            every=spec.config.tiers.persistent_every,
            job=spec.config.job_name,
        )
        try:
            target = jax.tree_util.tree_map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
            )
            _, state, meta = tier.load(target, step=step)
        finally:
            tier.close()
        return state, meta
    if plan.source is Source.KEEPER:
        keeper_tier = keepers()
        part = keeper_tier.part_meta(plan.keeper, step) if keeper_tier is not None else None
        if part is None:
            raise RuntimeError(f"keeper {plan.keeper} no longer holds step {step}")

        def fetch(leaf: int, index: Any, have: Any) -> Any:
            data = keeper_tier.region(plan.keeper, step, leaf, index)
            return [] if data is None else [(index, data)]

        return restore_state(
            abstract,
            shardings,
            _layout(part),
            local=lambda leaf: [],
            fetch=fetch,
            what=f"step {step} from the keepers",
        ), part
    meta = holdings.meta(step) or ask_peers(plan, me, lambda peer: peer.meta.remote(step), f"meta of step {step}")

    layout = _layout(meta)

    def fetch_peer(leaf: int, index: Any, have: Any) -> Any:
        """The peers' pieces of the region, asked one peer after another until they cover it."""
        got: list[Any] = []
        for slice_index, peer in {**plan.peers, **plan.donors}.items():
            if slice_index == me:
                continue
            try:
                got += ray.get(peer.pieces.remote(step, leaf, index), timeout=FETCH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a peer gone meanwhile: ask the next
                continue
            if covers(index, have + got, layout[leaf][1]):
                break
        return got

    state = restore_state(
        abstract,
        shardings,
        layout,
        local=lambda leaf: holdings.pieces(step, leaf),
        fetch=fetch_peer,
        what=f"step {step} from the group's host snapshots",
    )
    return state, meta


def ask_peers(plan: GroupPlan, me: int, call: Callable[[Any], Any], what: str, *, required: bool = True) -> Any:
    """The first answer that is not None from the group's other members, then its donors (bounded per peer)."""
    for slice_index, peer in {**plan.peers, **plan.donors}.items():
        if slice_index == me:
            continue
        try:
            got = ray.get(call(peer), timeout=FETCH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a peer gone meanwhile: ask the next
            continue
        if got is not None:
            return got
    if not required:
        return None
    raise RuntimeError(f"no member of group {plan.epoch} holds the {what} of step {plan.step}")


def _layout(meta: dict[str, Any]) -> Layout:
    return [tuple(x) for x in meta["_layout"]]
