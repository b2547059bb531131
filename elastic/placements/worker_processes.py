"""The agent factory of multi-process mode: one worker process per slice (:class:`WorkerProcesses`), and the
environment every process of the job starts with (:func:`process_env`)."""

from __future__ import annotations

import os
from typing import Any

import ray

from elastic import priority
from elastic.config import ElasticConfig
from elastic.control.cluster import workers_start_niced
from elastic.errors import ConfigError
from elastic.placements.plan import WorkerSpec
from elastic.placements.worker import SliceWorker
from elastic.runtime import distributed

__all__ = ["NORMAL_PRIORITY", "WorkerProcesses", "process_env"]

# A worker process on a cluster that starts them at Ray's nice 15 asks for an ordinary priority from its start
# (elastic.priority). Not on the embedded cluster, which starts every worker at 0: there it would cost an idle
# process reused (0.5-1 s of the multi-process demo's start).
NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": str(priority.NORMAL)}}


def process_env(config: ElasticConfig) -> dict[str, str]:
    """The environment of a job's worker (and standby) processes: with ``simulated``, ``devices_per_slice`` CPU
    devices each; always a collective timeout, so that a collective whose peer died fails instead of hanging."""
    assert config.processes is not None
    timeout = config.processes.collective_timeout_s
    if config.simulated:
        return distributed.collective_env(config.devices_per_slice, collective_timeout_s=timeout)
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_cpu_collective_timeout_seconds={timeout}".strip()}


class WorkerProcesses:
    """The agent factory of multi-process mode: the slice's worker process (named as its agent, owned by the
    driver: it dies with it), placed by ``Processes.resources_per_worker``."""

    detached = False

    def __init__(self, config: ElasticConfig, spec: WorkerSpec) -> None:
        self._config = config
        self._spec = spec

    @property
    def spec(self) -> WorkerSpec:
        """What each worker is built from."""
        return self._spec

    def actor_options(self) -> dict[str, Any]:
        """Ray options that place a process of this job (a worker, or a standby helper). No ``runtime_env``: a
        process sets its environment up itself (:func:`runtime.distributed.setup_process`), so Ray may hand it one
        of its idle processes instead of starting one per environment (a second or more of each worker's start).
        Only a worker on a cluster that starts them niced asks for one (:data:`NORMAL_PRIORITY`)."""
        assert self._config.processes is not None
        return {**self._config.processes.worker_options(), "max_restarts": 0}

    def env(self) -> dict[str, str]:
        return process_env(self._config)

    def check_fits(self) -> None:
        """``ConfigError`` (one line) when the cluster holds fewer of a resource than ``num_slices`` workers ask for
        in all (``Processes.resources_per_worker``): they could never all be placed."""
        assert self._config.processes is not None
        want = {k: v for k, v in self._config.processes.resources_per_worker.items() if v > 0}
        if not want:
            return
        have = ray.cluster_resources()
        n = self._config.num_slices
        for name, amount in sorted(want.items()):
            if have.get(name, 0.0) < n * amount:
                fit = int(have.get(name, 0.0) // amount)
                fewer = f"set num_slices={fit} or " if fit >= 1 else ""
                raise ConfigError(
                    f"num_slices={n} workers of {{{name!r}: {amount:g}}} need {n * amount:g} {name} but the cluster "
                    f"has {have.get(name, 0.0):g}: {fewer}lower processes.resources_per_worker, or add nodes before "
                    "the job starts"
                )

    def __call__(
        self, index: int, incarnation: int, supervisor: Any, options: dict[str, Any], control: str | None
    ) -> Any:
        if workers_start_niced():  # its imports too start at an ordinary priority, without any right to raise it
            options = {**options, "runtime_env": NORMAL_PRIORITY}
        return (
            ray.remote(SliceWorker)
            .options(**self.actor_options(), **options, max_concurrency=16)
            .remote(index, incarnation, supervisor, self._spec, self.env(), control)
        )
