"""How a job's slice agents are started: the :class:`AgentFactory` protocol, and single-process mode's factory."""

from __future__ import annotations

from typing import Any, Protocol

from elastic.config import ElasticConfig
from elastic.supervision.agent import SliceAgent

__all__ = ["AgentFactory", "SliceAgents"]


class AgentFactory(Protocol):
    """Starts a slice's agent actor (``options``: its name, namespace and placement; ``control``: the digest of the
    job's control credential, which every call on the agent must carry); returns its handle. The actor has
    ``start()`` (register, begin heartbeating; returns the incarnation), ``lifeline()``, ``silence()``, each
    taking ``token=``."""

    detached: bool  # the agent outlives the client (single-process mode's agents); else it dies with the driver

    def __call__(
        self, index: int, incarnation: int, supervisor: Any, options: dict[str, Any], control: str | None
    ) -> Any: ...


class SliceAgents:
    """Single-process mode's agents: a small :class:`SliceAgent` actor per slice, detached."""

    detached = True

    def __init__(self, config: ElasticConfig) -> None:
        self._config = config

    def __call__(
        self, index: int, incarnation: int, supervisor: Any, options: dict[str, Any], control: str | None
    ) -> Any:
        cfg = self._config
        return SliceAgent.options(**options).remote(  # type: ignore[attr-defined]  # a ray actor class
            index, incarnation, supervisor, cfg.heartbeat_interval_s, cfg.job_name, cfg.notices, control
        )
