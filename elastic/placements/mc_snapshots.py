"""Host snapshots of one multi-controller worker: its own addressable shards, and its buddy's.

A worker process holds, in its own memory, the newest ``keep`` generations of the shards its devices hold
(each distinct region once: a leaf replicated over its two devices is kept once), plus the newest generations
a buddy worker sent it. A generation is keyed by the step it resumes at (``next_step``) and carries the meta
of the state at that point (the ledger of committed steps as runs), and, per leaf, every region of the global
array that existed on the mesh it was taken on, so that a restore can tell whether the survivors hold all of
it. Nothing here talks to Ray or jax's runtime: the worker moves generations between processes; this module
takes them apart and puts them together.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

__all__ = ["Generation", "HostSnapshots", "Region", "common_step", "region_of", "take"]

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the global array


def region_of(index: tuple[slice, ...], shape: Sequence[int]) -> Region:
    """A shard's ``index`` (slices into the global array) as plain bounds."""
    return tuple((s.start or 0, shape[d] if s.stop is None else s.stop)
                 for d, s in enumerate(index)) + tuple((0, n) for n in shape[len(index):])


@dataclass(kw_only=True)
class Generation:
    """The state at ``step`` (the step it resumes at): ``pieces[leaf][region] = array`` held here, and
    ``regions[leaf]``: every region of that leaf on the mesh the state was on."""

    step: int
    pieces: list[dict[Region, np.ndarray]]
    regions: list[frozenset[Region]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for leaf in self.pieces for a in leaf.values())


def take(step: int, state: Any, meta: dict[str, Any]) -> Generation:
    """Copy this process's addressable shards of ``state`` (a pytree of ``jax.Array``) into host memory.
    Blocks until they are computed; the copies own their memory (never views of device buffers)."""
    pieces: list[dict[Region, np.ndarray]] = []
    regions: list[frozenset[Region]] = []
    for leaf in jax.tree_util.tree_leaves(state):
        shape = leaf.shape
        held: dict[Region, np.ndarray] = {}
        for shard in leaf.addressable_shards:
            region = region_of(shard.index, shape)
            if region not in held:
                held[region] = np.array(shard.data, copy=True)
        pieces.append(held)
        regions.append(frozenset(region_of(i, shape) for i in leaf.sharding.devices_indices_map(shape).values()))
    return Generation(step=step, pieces=pieces, regions=regions, meta=dict(meta))


def _covers(outer: Region, inner: Region) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


class HostSnapshots:
    """The generations one worker holds: its own, and those sent by the workers it is buddy to. With a
    ``store``, each is kept in files on the node (:mod:`elastic.placements.mc_store`) that outlive this process; a store
    that cannot take one (full, missing) is counted in ``store_errors`` and the generation is kept in memory."""

    def __init__(self, keep: int = 2, store: Any = None) -> None:
        self.keep = keep
        self.store = store
        self.store_errors = 0
        self.own: dict[int, Generation] = {}
        self.buddies: dict[int, dict[int, Generation]] = {}  # slice -> step -> generation

    def _stored(self, kind: str, gen: Generation) -> Generation | None:
        if self.store is None:
            return None
        try:
            return self.store.put(kind, gen)
        except OSError:
            self.store_errors += 1
            return None

    def _dropper(self, kind: str) -> Callable[[int], None]:
        return lambda step: self.store.drop(kind, step) if self.store is not None else None

    def add_own(self, gen: Generation) -> None:
        self.own[gen.step] = self._stored("own", gen) or gen
        _trim(self.own, self.keep, self._dropper("own"))

    def add_buddy(self, slice_index: int, gen: Generation) -> None:
        """Keep a copy sent by ``slice_index``'s worker (its arrays copied: the sender's buffers may go)."""
        held = self._stored(f"buddy-{slice_index}", gen) or Generation(
            step=gen.step, meta=dict(gen.meta), regions=list(gen.regions),
            pieces=[{r: np.array(a, copy=True) for r, a in leaf.items()} for leaf in gen.pieces])
        generations = self.buddies.setdefault(slice_index, {})
        generations[gen.step] = held
        _trim(generations, self.keep, self._dropper(f"buddy-{slice_index}"))

    def adopt(self) -> int:
        """Take over what an earlier process for this slice left in the store (it died, the node lives on);
        the number of generations found."""
        if self.store is None:
            return 0
        count = 0
        for kind, generations in self.store.load().items():
            if kind == "own":
                target, drop = self.own, self._dropper("own")
            elif kind.startswith("buddy-"):
                target, drop = self.buddies.setdefault(int(kind.split("-", 1)[1]), {}), self._dropper(kind)
            else:
                continue
            target.update(generations)
            _trim(target, self.keep, drop)
            count += sum(1 for step in generations if step in target)
        return count

    def _generations(self, step: int) -> list[Generation]:
        found = [self.own[step]] if step in self.own else []
        return found + [g[step] for g in self.buddies.values() if step in g]

    def held(self) -> dict[int, dict[str, Any]]:
        """Per step held (own or buddy): the regions held per leaf, and the regions that make the whole state."""
        out: dict[int, dict[str, Any]] = {}
        for step in {s for s in self.own} | {s for g in self.buddies.values() for s in g}:
            gens = self._generations(step)
            out[step] = {"own": step in self.own,
                         "held": [frozenset().union(*(g.pieces[i].keys() for g in gens))
                                  for i in range(len(gens[0].pieces))],
                         "regions": gens[0].regions}
        return out

    def meta(self, step: int) -> dict[str, Any] | None:
        gens = self._generations(step)
        return dict(gens[0].meta) if gens else None

    def find(self, step: int, leaf: int, region: Region) -> np.ndarray | None:
        """The values of ``region`` of leaf ``leaf`` at ``step``, cut from a held piece that covers it."""
        for gen in self._generations(step):
            for held, array in gen.pieces[leaf].items():
                if _covers(held, region):
                    return array[tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(held, region, strict=True))]
        return None


def _trim(generations: dict[int, Generation], keep: int, drop: Callable[[int], None] = lambda step: None) -> None:
    for step in sorted(generations)[:-keep]:
        del generations[step]
        drop(step)


def common_step(helds: Sequence[dict[int, dict[str, Any]]]) -> int | None:
    """The newest step whose whole state the given workers hold between them (each ``held()``), with every
    one of them holding its own generation of it (so each knows the ledger there); None if there is none."""
    if not helds:
        return None
    steps = set.intersection(*({s for s, h in held.items() if h["own"]} for held in helds))
    for step in sorted(steps, reverse=True):
        regions = helds[0][step]["regions"]
        have = [frozenset().union(*(held[step]["held"][i] for held in helds)) for i in range(len(regions))]
        if all(regions[i] <= have[i] for i in range(len(regions))):
            return step
    return None
