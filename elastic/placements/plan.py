"""What a job's mode is built from (:class:`JobParts`); what a multi-process job's workers are built from
(:class:`WorkerSpec`, once per job) and what each group is formed by (:class:`GroupPlan`, once per group): both
pickled from the driver to every worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from etils import epath

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.hooks import FaultPlan, WorkerHook
from elastic.control.sources import Source
from elastic.supervision.membership import View

__all__ = ["GroupPlan", "JobParts", "WorkerSpec"]


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What every worker of a job is built with: the job's configuration and the user's functions (pickled to
    each worker once), the worker-side faults of a drill, and where compiled executables are cached."""

    config: ElasticConfig
    init_fn: Callable[[jax.Array], Any]
    shardings_fn: Callable[..., Any] | None = None
    mesh_fn: runtime.MeshFn | None = None
    init_from: str | None = None  # an Orbax checkpoint whose state replaces init_fn's at step ``init_step``
    init_step: int = 0  # where a fresh start begins (the checkpoint's step: the run continues there)
    step_hooks: tuple[WorkerHook, ...] = ()  # run in the worker as each step starts (a drill's faults)
    cache_dir: str | None = None  # JAX's persistent compilation cache, shared with the standby group
    keepers: bool = False  # the job keeps keeper actors (in its namespace)
    keeper_credential: str | None = None  # what the job's keepers answer (elastic.supervision.credential "keeper")
    identity_key: str | None = None  # checks the job's record of each keeper's actor ID (elastic.supervision.identity)


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Group ``epoch``: ``members`` (slices, in process order) served at ``address``; the state comes from
    ``source`` (memory: the members' host snapshots, the keepers, Orbax, or fresh) at ``step``;
    ``peers``: every member's actor; ``donors``: the workers of slices leaving on notice, not members, asked for
    what no member holds; ``pids``: the driver processes the job has had (kept in snapshots)."""

    epoch: int
    address: str
    members: tuple[int, ...]
    peers: dict[int, Any]
    source: Source
    step: int | None
    view: View
    live: bool = False  # a move at a step boundary: the boundary's snapshot (maybe still being copied) is restored
    pids: tuple[int, ...] = ()
    keeper: str | None = None  # the keeper to read a keeper restore from
    rendezvous_timeout_s: int = 5
    record_calls: bool = False  # report the jitted calls of this pass for standby compiles
    fault_floor: int = -1  # faults at or below this step fired already (a recomputed step does not fire again)
    loop: Any = None
    donors: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class JobParts:
    """What a job is built from, as a mode needs it: the configuration, the user's functions (``shardings_fn``
    already defaulted), the state's shapes, ``init_from`` (a resolved Orbax checkpoint, None: ``init_fn``) and
    the step a fresh start begins at, the drill's faults, and the compilation cache directory."""

    config: ElasticConfig
    init_fn: Callable[[jax.Array], Any]
    abstract: Any
    shardings_fn: Callable[..., Any]
    mesh_fn: runtime.MeshFn | None = None
    init_from: epath.Path | None = None
    init_step: int = 0
    faults: FaultPlan | None = None
    cache_dir: str = ""
