"""Where notices come from beside the ones every job takes (``job.notice``, ``elastic drain``, Ray node drains): a
host's metadata server polled by its slice's agent, and a signal to a slice's worker process. Part of the job's
config (``ElasticConfig(notices=...)``, re-exported by :mod:`elastic.config`); here so that the agents and workers
that read it import no config module above them."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from elastic.errors import ConfigError
from elastic.validate import positive as _positive

__all__ = ["NoticeSources"]


@dataclass(frozen=True, kw_only=True)
class NoticeSources:
    """Where a slice's agent listens for notices that its host will go (beside ``job.notice``, ``elastic drain`` and
    Ray node drains, which need no setting).

    ``metadata_url``: the base of the cloud's metadata server as the host sees it (GCE:
    ``http://metadata.google.internal/computeMetadata/v1``); each agent polls its ``instance/maintenance-event``,
    ``instance/upcoming-maintenance`` and ``instance/preempted`` keys every ``metadata_poll_s`` seconds; a
    ``{slice}`` in it is replaced by the agent's slice index. None (the default): not polled. A loss announced
    there is a notice with ``maintenance_deadline_s`` seconds of warning.

    ``signal``: in multi-process mode, the signal (a name: ``"SIGTERM"``, ``"SIGUSR1"``...) that a slice's worker
    process takes as notice that it will go, as a scheduler sends it (Kubernetes, Slurm's ``--signal``); the slice
    goes ``signal_grace_s`` seconds later (the scheduler's grace period: the process ends then, left or not). A
    second such signal ends the process at once. None: the signal ends the worker, as Ray's own handler does.
    """

    metadata_url: str | None = None
    metadata_poll_s: float = 5.0
    maintenance_deadline_s: float = 60.0
    signal: str | None = "SIGTERM"
    signal_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.metadata_url is not None and not self.metadata_url.startswith(("http://", "https://")):
            raise ConfigError(f"NoticeSources.metadata_url is an http(s) URL; got {self.metadata_url!r}")
        _positive("metadata_poll_s", self.metadata_poll_s)
        _positive("maintenance_deadline_s", self.maintenance_deadline_s)
        _positive("signal_grace_s", self.signal_grace_s)
        if self.signal is not None and not (
            isinstance(self.signal, str) and self.signal.startswith("SIG") and hasattr(signal, self.signal)
        ):
            raise ConfigError(f"NoticeSources.signal is a signal's name ('SIGTERM'...) or None; got {self.signal!r}")
        if self.signal in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"NoticeSources.signal cannot be {self.signal}: a process cannot catch it")
