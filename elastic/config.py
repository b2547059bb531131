"""Configuration: frozen, keyword-only, validated when built."""
from __future__ import annotations

from dataclasses import dataclass

from elastic.errors import ConfigError

__all__ = ["ElasticConfig", "Policy"]


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
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 3.0
    startup_timeout_s: float = 60.0
    recovery_timeout_s: float = 120.0
    max_transient_retries: int = 3

    def __post_init__(self) -> None:
        if not self.job_name or not all(c.isalnum() or c in "-_" for c in self.job_name):
            raise ConfigError(f"job_name must be non-empty letters, digits, '-' or '_', got {self.job_name!r}")
        for name in ("num_slices", "devices_per_slice", "num_steps", "snapshot_every", "keep_snapshots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
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
