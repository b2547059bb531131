"""Configuration: frozen, keyword-only, validated when built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.errors import ConfigError

__all__ = ["ElasticConfig", "Policy", "Tiers"]


def _count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer of at least {minimum}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the supervisor answers changes in slice health.

    ``min_slices``: shrink while at least this many slices are healthy; below it, wait up to
    ``repair_timeout_s`` for repairs, then give up. ``max_slice_failures``: a slice that failed this
    many times is not taken back (0: no limit).
    """

    min_slices: int = 1
    repair_timeout_s: float = 60.0
    max_slice_failures: int = 0

    def __post_init__(self) -> None:
        if self.min_slices < 1:
            raise ConfigError(f"min_slices must be at least 1, got {self.min_slices}")
        _positive("repair_timeout_s", self.repair_timeout_s)
        if self.max_slice_failures < 0:
            raise ConfigError(f"max_slice_failures must be 0 (no limit) or more, got {self.max_slice_failures}")


@dataclass(frozen=True, kw_only=True)
class Tiers:
    """Where snapshots live, fastest first, and what each survives.

    1. In memory: every byte of a snapshot on ``copies`` distinct slices' host memory (survives the loss
       of ``copies - 1`` slices; capped at the number of slices in the mesh). A snapshot requested while an earlier one still waits to be copied
       replaces it (``on_busy="coalesce"``, counted) or waits for it (``"wait"``).
    2. Keepers: every ``keeper_every``-th snapshot is copied to ``keepers`` keeper actors on other Ray
       nodes (survives the client process and any one node; 0 turns the tier off).
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
        if self.on_busy not in ("coalesce", "wait"):
            raise ConfigError(f"tiers.on_busy must be 'coalesce' or 'wait', got {self.on_busy!r}")
        if self.persistent_dir is not None and not str(self.persistent_dir).strip():
            raise ConfigError("tiers.persistent_dir must be a directory or bucket path, or None to turn it off")


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """One elastic job.

    Slices: ``num_slices`` x ``devices_per_slice`` devices; ``simulated`` groups forced CPU devices
    (tests, demo) and lets fault injection kill them. ``num_steps`` steps run in all;
    a host snapshot is taken every ``snapshot_every`` steps (bounding the work a failure can lose).
    """

    job_name: str = "elastic"
    num_slices: int = 4
    devices_per_slice: int = 2
    simulated: bool = True
    num_steps: int = 100
    snapshot_every: int = 10
    keep_snapshots: int = 2
    seed: int = 0
    policy: Policy = Policy()
    tiers: Tiers = Tiers()
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 3.0
    startup_timeout_s: float = 60.0
    recovery_timeout_s: float = 120.0
    max_transient_retries: int = 3

    def __post_init__(self) -> None:
        if not self.job_name or not all(c.isalnum() or c in "-_" for c in self.job_name):
            raise ConfigError(f"job_name must be non-empty letters, digits, '-' or '_', got {self.job_name!r}")
        for name in ("num_slices", "devices_per_slice", "num_steps", "snapshot_every", "keep_snapshots"):
            _count(name, getattr(self, name))
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
        if self.max_transient_retries < 0:
            raise ConfigError(f"max_transient_retries must be 0 or more, got {self.max_transient_retries}")

    @property
    def namespace(self) -> str:
        """The Ray namespace holding this job's supervisor and agents."""
        return f"elastic-{self.job_name}"
