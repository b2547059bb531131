"""Elastic, fault-tolerant training for JAX: survive a slice loss in the same process.

    import elastic

Public names load lazily, so Ray workers that host the supervisor and agents do not import jax.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import Any

try:
    __version__: str = _metadata.version("jax-elastic")
except _metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = (
    "AccessError",
    "ClusterError",
    "ConfigError",
    "ElasticConfig",
    "ElasticError",
    "ElasticJob",
    "Faults",
    "GiveUpError",
    "JobResult",
    "Notice",
    "NoticeError",
    "NoticeSources",
    "OptaxStep",
    "Policy",
    "Processes",
    "RecoveryTimeoutError",
    "Report",
    "Run",
    "SupervisorError",
    "SupervisorLostError",
    "Tiers",
    "Trainer",
    "View",
    "decide",
    "optax_step",
)

_WHERE = {
    "AccessError": "errors",
    "ClusterError": "errors",
    "ConfigError": "errors",
    "ElasticError": "errors",
    "GiveUpError": "errors",
    "NoticeError": "errors",
    "RecoveryTimeoutError": "errors",
    "SupervisorError": "errors",
    "SupervisorLostError": "errors",
    "ElasticConfig": "config",
    "Policy": "config",
    "Processes": "config",
    "NoticeSources": "config",
    "Tiers": "config",
    "ElasticJob": "api.job",
    "JobResult": "api.job",
    "Faults": "chaos.faults",
    "Run": "loop.run",
    "Report": "control.report",
    "Trainer": "api.trainer",
    "OptaxStep": "api.trainer",
    "optax_step": "api.trainer",
    "View": "supervision.membership",
    "Notice": "supervision.notices",
    "decide": "supervision.policy",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"elastic.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
