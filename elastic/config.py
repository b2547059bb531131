"""Configuration: frozen, keyword-only, validated when built."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from elastic.errors import ConfigError
from elastic.supervision.policy import Policy
from elastic.supervision.sources import NoticeSources
from elastic.validate import count as _count
from elastic.validate import instance as _instance
from elastic.validate import positive as _positive

__all__ = [
    "FIRST_STEP_FACTOR",
    "ElasticConfig",
    "NoticeSources",
    "Policy",
    "Processes",
    "Tiers",
    "check_batch_splits",
]

FIRST_STEP_FACTOR = 3  # the first step of each pass (a new mesh) waits this many step_timeout_s


@dataclass(frozen=True, kw_only=True)
class Tiers:
    """Where snapshots live, fastest first, and what each survives.

    1. In memory: every byte of a snapshot on ``copies`` distinct slices' host memory (survives the loss
       of ``copies - 1`` slices; capped at the number of slices in the mesh). A snapshot requested while an earlier one
       still waits to be copied
       replaces it (``on_busy="coalesce"``, counted) or waits for it (``"wait"``).
    2. Keepers: every ``keeper_every``-th snapshot is copied to ``keepers`` keeper actors on other Ray
       nodes (survives the client process and any one node; 0 turns the tier off). One keeper per node: fewer
       where the cluster has fewer nodes besides the client's, one on a one-node cluster (``keepers_capped``).
    3. Persistent: an Orbax checkpoint every ``persistent_every`` steps under ``persistent_dir`` (a
       directory or bucket path; survives the whole cluster; None turns the tier off).
    """

    copies: int = 2
    on_busy: Literal["coalesce", "wait"] = "coalesce"
    keeper_every: int = 5
    keepers: int = 2
    persistent_dir: str | None = None
    persistent_every: int = 100

    def __post_init__(self) -> None:
        _count("tiers.copies", self.copies)
        _count("tiers.keeper_every", self.keeper_every, 0)
        _count("tiers.keepers", self.keepers)
        _count("tiers.persistent_every", self.persistent_every)
        if not isinstance(self.on_busy, str) or self.on_busy not in ("coalesce", "wait"):
            raise ConfigError(f"tiers.on_busy must be 'coalesce' or 'wait', got {self.on_busy!r}")
        if self.persistent_dir is not None and (
            not isinstance(self.persistent_dir, (str, os.PathLike)) or not str(self.persistent_dir).strip()
        ):
            raise ConfigError(
                f"tiers.persistent_dir must be a directory or bucket path, or None to turn it off, "
                f"got {self.persistent_dir!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Processes:
    """Multi-process mode: each slice is a worker process (a Ray actor on the slice's host), joined with the
    others by ``jax.distributed``; the user's loop runs SPMD in every worker. Pass it as
    ``ElasticConfig(processes=Processes(...))``; without it, one process drives every slice (single-process
    mode, as with Pathways).

    ``collective_timeout_s``: a collective whose peer died raises after this (gloo on CPU) instead of hanging.
    ``rendezvous_timeout_s``: a group whose members do not all join within about twice this fails (bounded).
    ``settle_timeout_s``: after a failure, a member still inside the pass past this is hung: killed, replaced.
    ``resources_per_worker``: what one worker needs of a node (``{"GPU": 8}``, or a custom host resource such
    as ``{"trainer_host": 1}``); Ray places each worker where that is free. Empty: anywhere.
    ``replace_lost``: start a new process for a slice whose worker died, which joins at a step boundary once up
    (where the node died too, Ray places it elsewhere: see ``resources_per_worker``). ``standby``: compile the
    step for the group one slice smaller in the background (a short-lived group of helper processes writing
    JAX's persistent compilation cache), so the first step after a loss does not compile.
    """

    collective_timeout_s: int = 5
    rendezvous_timeout_s: int = 5
    settle_timeout_s: float = 15.0
    resources_per_worker: Mapping[str, float] = field(default_factory=dict)
    replace_lost: bool = True
    standby: bool = True

    def __post_init__(self) -> None:
        _count("processes.collective_timeout_s", self.collective_timeout_s)
        _count("processes.rendezvous_timeout_s", self.rendezvous_timeout_s)
        _positive("processes.settle_timeout_s", self.settle_timeout_s)
        for name in ("replace_lost", "standby"):
            _instance(f"processes.{name}", getattr(self, name), bool)
        if not isinstance(self.resources_per_worker, Mapping):
            raise ConfigError(
                f"processes.resources_per_worker must map resource names to amounts, got {self.resources_per_worker!r}"
            )
        for key, amount in self.resources_per_worker.items():
            if (
                not isinstance(key, str)
                or isinstance(amount, bool)
                or not isinstance(amount, (int, float))
                or not 0 <= amount < math.inf
            ):
                raise ConfigError(
                    f"processes.resources_per_worker maps resource names to amounts >= 0, got {key!r}: {amount!r}"
                )

    def worker_options(self) -> dict[str, object]:
        """The Ray actor options that place one worker (``num_cpus``/``num_gpus`` from ``CPU``/``GPU``)."""
        resources = dict(self.resources_per_worker)
        options: dict[str, object] = {"num_cpus": resources.pop("CPU", 0)}
        if "GPU" in resources:
            options["num_gpus"] = resources.pop("GPU")
        if resources:
            options["resources"] = resources
        return options


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """One elastic job.

    Slices: ``num_slices`` x ``devices_per_slice`` devices. ``simulated=False`` (the default): the devices jax
    sees, accelerators where there are any (grouped by ``slice_index`` on multi-slice TPU, else ``devices_per_slice``
    at a time), every one of them used: a count that does not match fails at construction, naming the settings
    that fit. ``simulated=True``: slices of forced CPU devices (tests, demos; ``XLA_FLAGS`` must raise the CPU
    device count before jax is imported), which fault injection can kill. ``num_steps`` steps run in all;
    a host snapshot is taken every ``snapshot_every`` steps (bounding the work a failure can lose).
    ``global_batch_size``: the leading size of every batch, when known; ``ElasticJob`` then checks at
    construction that it splits over every device count the job may shrink to (see
    :attr:`device_counts`), unless the loop splits uneven batches into micro-batches (``Trainer`` with
    ``optax_step``).

    ``step_timeout_s`` is the step watchdog: ``run.commit`` waits at most this long for a step's result
    (compile time is not counted: jax compiles when the step is called, before ``commit`` waits); a step
    that makes no progress for longer is hung, and the job recovers from it as from a lost slice. The first
    step of each pass (a new mesh: program load, collective set-up) and the state's restore wait
    ``FIRST_STEP_FACTOR`` times as long. Set it to several times your slowest step; None turns it off.

    ``steps_in_flight``: how many steps the loop may have dispatched and not yet confirmed when ``run.commit``
    returns, plus one: with 2 a commit waits for the step before it, so the loop dispatches step k+1 while step
    k computes, as a plain jitted loop does (a step whose state the next one donates, with no metrics committed,
    is waited on through a one-element copy of its result queued behind it; a loop left to run ahead without
    bound was aborted on CPU devices by XLA's collective rendezvous 60 steps ahead); 1: each commit waits for
    its own step. A commit whose step ends on
    a snapshot boundary waits for its own step either way (the snapshot is of a computed state), and a failure
    surfaces at the next commit or step boundary at the latest. None (the default): 2 in single-process mode,
    1 in multi-process mode, where a step dispatched ahead lets a survivor start the next step's collective
    while a peer is still in this step's, broken by a dead process: gloo then aborts that peer (the bytes of one
    collective reach the pending receive of another), and one kill costs two processes (measured: 7 of 7 demo
    runs at 2, 0 of 17 at 1). :attr:`in_flight` is the value in force.

    ``processes``: run each slice as a worker process (:class:`Processes`); None (the default): one process
    drives every slice. With ``simulated``, each worker gets ``devices_per_slice`` forced CPU devices; without, each
    worker uses the devices Ray gives its process (``Processes.resources_per_worker``), which must number
    ``devices_per_slice``.

    ``pool``: the name of a pool of slices (:mod:`elastic.pool`) the job leases its slices from, with its
    ``priority`` (higher goes first), ``min_slices`` (the fewest it runs on; None: ``policy.min_slices``),
    ``max_slices`` (the most it asks; None: ``num_slices``) and ``spares`` (how many of its failed slices the pool
    replaces from lower-priority jobs). Without ``pool`` these four stay at their defaults.
    """

    job_name: str = "elastic"
    num_slices: int = 4
    devices_per_slice: int = 2
    simulated: bool = False
    num_steps: int = 100
    snapshot_every: int = 10
    keep_snapshots: int = 2
    seed: int = 0
    policy: Policy = Policy()
    tiers: Tiers = Tiers()
    heartbeat_interval_s: float = 1.0  # a death is seen at once (the lifeline); a hung agent after the timeout
    heartbeat_timeout_s: float = 3.0
    startup_timeout_s: float = 60.0
    recovery_timeout_s: float = 120.0
    max_transient_retries: int = 3
    step_timeout_s: float | None = 300.0
    global_batch_size: int | None = None
    processes: Processes | None = None
    steps_in_flight: int | None = None
    notices: NoticeSources = NoticeSources()
    pool: str | None = None
    priority: int = 0
    min_slices: int | None = None
    max_slices: int | None = None
    spares: int = 0

    def __post_init__(self) -> None:
        if (
            not isinstance(self.job_name, str)
            or not self.job_name
            or not all(c.isalnum() or c in "-_" for c in self.job_name)
        ):
            raise ConfigError(f"job_name must be non-empty letters, digits, '-' or '_', got {self.job_name!r}")
        for name in ("num_slices", "devices_per_slice", "num_steps", "snapshot_every", "keep_snapshots"):
            _count(name, getattr(self, name))
        if self.steps_in_flight is not None:
            _count("steps_in_flight", self.steps_in_flight)
        _instance("simulated", self.simulated, bool)
        _instance("policy", self.policy, Policy)
        _instance("tiers", self.tiers, Tiers)
        _count("seed", self.seed, -(2**63), maximum=2**63, what="a 64-bit signed integer, as jax.random.key takes")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "startup_timeout_s", "recovery_timeout_s"):
            _positive(name, getattr(self, name))
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or every agent would look silent"
            )
        if self.policy.min_slices > self.num_slices:
            raise ConfigError(
                f"policy.min_slices={self.policy.min_slices} is above num_slices={self.num_slices}: "
                f"the job could never run; lower min_slices to at most {self.num_slices}"
            )
        _count("max_transient_retries", self.max_transient_retries, 0, what="0 or more")
        if self.step_timeout_s is not None:
            try:
                _positive("step_timeout_s", self.step_timeout_s)
            except ConfigError as err:
                raise ConfigError(f"{err}; or None to turn the step watchdog off") from err
        if self.global_batch_size is not None:
            _count("global_batch_size", self.global_batch_size, what="an integer of at least 1, or None")
        if self.processes is not None:
            _instance("processes", self.processes, Processes)
        self._check_pool()

    def _check_pool(self) -> None:
        if self.pool is None:
            given = [n for n, v in (("priority", self.priority), ("spares", self.spares)) if v != 0]
            given += [n for n in ("min_slices", "max_slices") if getattr(self, n) is not None]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} a pool job's: set pool= to the pool's "
                    "name too, or leave them out"
                )
            return
        if not isinstance(self.pool, str) or not self.pool or not all(c.isalnum() or c in "-_." for c in self.pool):
            raise ConfigError(f"pool must be a pool's name (letters, digits, '-', '_' or '.'), got {self.pool!r}")
        _count("priority", self.priority, -(2**31), maximum=2**31, what="an integer (higher goes first)")
        _count("spares", self.spares, 0, what="0 or more")
        low, high = self.pool_min_slices, self.pool_max_slices
        _count("min_slices", low, what="an integer of at least 1, or None for policy.min_slices")
        _count("max_slices", high, what="an integer of at least 1, or None for num_slices")
        if high > self.num_slices:
            raise ConfigError(
                f"max_slices={high} is above num_slices={self.num_slices}: the job runs on at most num_slices; "
                f"lower max_slices or raise num_slices"
            )
        if low > high:
            raise ConfigError(f"min_slices={low} is above max_slices={high}: lower min_slices or raise max_slices")
        if low < self.policy.min_slices:
            raise ConfigError(
                f"min_slices={low} is below policy.min_slices={self.policy.min_slices}: the pool could lend the job "
                "fewer slices than it runs on; raise min_slices or lower policy.min_slices"
            )

    @property
    def pool_min_slices(self) -> int:
        """The fewest slices the pool must lend this job for it to run: ``min_slices``, or ``policy.min_slices``."""
        return self.policy.min_slices if self.min_slices is None else self.min_slices

    @property
    def pool_max_slices(self) -> int:
        """The most slices it asks of the pool: ``max_slices``, or ``num_slices``."""
        return self.num_slices if self.max_slices is None else self.max_slices

    @property
    def mode(self) -> str:
        """``"multi-process"`` (a worker process per slice) or ``"single-process"`` (one process drives all)."""
        return "single-process" if self.processes is None else "multi-process"

    @property
    def namespace(self) -> str:
        """The Ray namespace holding this job's supervisor and agents."""
        return f"elastic-{self.job_name}"

    @property
    def in_flight(self) -> int:
        """``steps_in_flight`` in force: as set, or 2 in single-process mode and 1 in multi-process mode."""
        if self.steps_in_flight is not None:
            return self.steps_in_flight
        return 1 if self.processes is not None else 2

    def step_wait_s(self, *, first: bool) -> float | None:
        """How long a step's result is waited for (``first``: the first step of a pass, or a restore)."""
        if self.step_timeout_s is None:
            return None
        return self.step_timeout_s * (FIRST_STEP_FACTOR if first else 1)

    @property
    def device_counts(self) -> tuple[int, ...]:
        """Every device count the job may run on: ``policy.min_slices..num_slices`` slices, smallest first."""
        return tuple(n * self.devices_per_slice for n in range(self.policy.min_slices, self.num_slices + 1))


def _names(counts: Sequence[int]) -> str:
    return ", ".join(str(n) for n in counts[:-1]) + (" or " if len(counts) > 1 else "") + str(counts[-1])


def check_batch_splits(rows: int, config: ElasticConfig, *, what: str) -> None:
    """``ConfigError`` unless a batch of ``rows`` splits evenly over every device count the job may run
    on; the message names the counts that fail and the sizes that would work. ``what`` names the batch."""
    counts = config.device_counts
    bad = [n for n in counts if rows % n]
    if not bad:
        return
    unit = math.lcm(*counts)
    below = rows // unit * unit
    sizes = " or ".join(str(s) for s in (below, below + unit) if s > 0)
    fewer = "raise policy.min_slices, " if len(counts) > 1 else ""
    raise ConfigError(
        f"{what} of {rows} rows does not split over {_names(bad)} devices, and the job may run on "
        f"{_names(counts)} devices (policy.min_slices={config.policy.min_slices} to num_slices={config.num_slices} "
        f"slices of {config.devices_per_slice}); use a batch size that is a multiple of {unit} (e.g. {sizes}), "
        f"{fewer}or use elastic.Trainer with elastic.optax_step, which splits an uneven batch into micro-batches"
    )
