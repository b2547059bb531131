"""The configuration of a multi-controller job (:class:`elastic.placements.mc_driver.McDriver`), checked at construction."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.config import Policy
from elastic.errors import ConfigError

__all__ = ["McConfig"]


@dataclass(frozen=True, kw_only=True)
class McConfig:
    """A multi-controller job: ``num_slices`` worker processes of ``devices_per_slice`` devices each."""

    num_steps: int
    num_slices: int = 4
    devices_per_slice: int = 2
    snapshot_every: int = 5
    seed: int = 0
    collective_timeout_s: int = 5  # a collective with a dead peer raises after this (gloo)
    settle_timeout_s: float = 15.0  # after a failure, a member still in the pass past this is hung: killed, replaced
    rendezvous_timeout_s: int = 5  # a group whose members do not all join within about twice this fails (bounded)
    startup_timeout_s: float = 120.0  # worker processes start (and import jax) within this
    pass_timeout_s: float = 600.0  # one pass of the loop over one group, at most
    stop_margin_steps: int = 3  # a join boundary is at least this many steps after the progress seen
    replace_lost: bool = True  # start a new process for every lost slice at once; it joins at a step boundary
    # Keep host snapshots in files on each worker's node (tmpfs), so that they outlive a worker process: a new
    # process for a lost slice, started on its node, takes them over when the survivors alone miss a shard.
    node_store: bool = True
    policy: Policy = field(default_factory=lambda: Policy(min_slices=1))
    # What one worker process needs of a node (one host of a slice), e.g. {"GPU": 8} or a custom host resource
    # such as {"trainer_host": 1}: Ray places each worker where that is free. Empty: anywhere.
    resources_per_worker: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_steps", "num_slices", "devices_per_slice", "snapshot_every", "collective_timeout_s",
                     "rendezvous_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"McConfig.{name} must be an integer of at least 1, got {value!r}")
        for name in ("settle_timeout_s", "startup_timeout_s", "pass_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ConfigError(f"McConfig.{name} must be a finite number of seconds above 0, got {value!r}")
        for key, amount in dict(self.resources_per_worker).items():
            if not isinstance(key, str) or isinstance(amount, bool) or not isinstance(amount, int | float) \
                    or amount < 0:
                raise ConfigError(f"McConfig.resources_per_worker maps resource names to amounts >= 0, got "
                                  f"{key!r}: {amount!r}")

    def worker_options(self) -> dict[str, Any]:
        """The Ray actor options that place one worker (``num_cpus``/``num_gpus`` from ``CPU``/``GPU``)."""
        resources = dict(self.resources_per_worker)
        options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 0)}
        if "GPU" in resources:
            options["num_gpus"] = resources.pop("GPU")
        if resources:
            options["resources"] = resources
        return options
