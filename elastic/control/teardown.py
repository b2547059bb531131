"""Ending a job's actors: ``cleanup`` (the operator's, after a crashed client; only with the job's credential), and
the pieces a client's own shutdown uses (``close_supervisor``, ``sweep_agents``, ``kill_actor``)."""

from __future__ import annotations

from typing import Any

import ray

from elastic.config import ElasticConfig
from elastic.control.tokens import find_token
from elastic.errors import AccessError
from elastic.log import get_logger
from elastic.supervision import credential, events
from elastic.supervision.credential import Credentialed
from elastic.supervision.identity import JobActors, SquatError
from elastic.supervision.supervisor import SUPERVISOR_NAME

__all__ = ["cleanup", "close_supervisor", "kill_actor", "sweep_agents"]


def cleanup(
    job_name: str, *, keep_keepers: bool = False, purge_events: bool = False, token: str | None = None
) -> list[str]:
    """Kill every actor left in job ``job_name``'s namespace (e.g. after its driver was SIGKILLed).

    The supervisor, agents and keepers are detached, so they outlive a crashed driver by design; this
    ends them (the keepers too, unless ``keep_keepers``: they hold the job's newest snapshot). The
    supervisor is closed first, so it writes no event about the agents' deaths. ``purge_events``: also
    delete the job's event stream (every run). Returns the names of the actors killed.

    Only with the job's credential (``token``, else :func:`find_token`): a live supervisor must accept it (its
    refusal is an event in its stream), and without one the job's stream must verify under it; otherwise
    :class:`~elastic.errors.AccessError` and nothing is touched.
    """
    token = find_token(job_name, token)
    namespace = ElasticConfig(job_name=job_name).namespace
    actors = JobActors(job_name, namespace, token)
    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == namespace and not (keep_keepers and entry["name"].startswith("keeper-"))
    ]
    key = None if token is None else credential.derive(token, "stream")
    proven = _authorize_cleanup(job_name, actors, key, names, purge_events)
    killed, foreign = [], []
    for name in sorted(names, key=lambda n: (n != SUPERVISOR_NAME, n)):  # the supervisor first
        try:
            actor = actors.find(name)  # the job's own actor, its ID checked before anything is sent to it
        except SquatError:
            foreign.append(name)  # not the job's: neither called nor killed
            continue
        if actor is None:  # gone meanwhile
            continue
        if name == SUPERVISOR_NAME:
            close_supervisor(actor, job_name, token)
        ray.kill(actor, no_restart=True)
        killed.append(name)
    log = get_logger("elastic.control.teardown", job=job_name)
    if foreign:
        log.warning("foreign_actors_left", names=foreign)
    if purge_events:
        kept = events.delete_runs(job_name, proven)
        if kept:
            log.warning("unproven_runs_kept", runs=kept)
    return sorted(killed)


def _authorize_cleanup(job_name: str, actors: JobActors, key: str | None, names: list[str], purge: bool) -> list[str]:
    """The runs of the job's stream whose own ``run_started`` (writer ``job``, the first record its client wrote)
    verifies under ``key``: only those a purge deletes. ``AccessError`` unless the credential is the job's, as the
    signed record of its live supervisor (checked against the actor holding the name: nothing is sent to it) or
    those runs tell; a job with neither has nothing to protect."""
    what = f"cleanup of job {job_name!r}"
    hint = (
        "pass the job's --token-file (or set ELASTIC_TOKEN); its client wrote it to $ELASTIC_HOME/tokens/<job> for "
        "its own user"
    )
    supervisor = False
    if SUPERVISOR_NAME in names:
        try:
            supervisor = actors.find(SUPERVISOR_NAME) is not None  # its record verifies and names the holder
        except SquatError as err:
            raise AccessError(f"{what} {err}; {hint}") from err
    proven: list[str] = []
    unproven: list[str] = []
    for run in events.runs(job_name):
        first = [r for r in events.read(job_name, run, writers=["job"]) if r.get("seq") == 0]
        ok = key is not None and first and first[0].get("kind") == "run_started" and events.verify(first, key)[0]
        (proven if ok else unproven).append(run)
    if supervisor or proven or not (names or (purge and unproven)):
        return proven
    raise AccessError(f"{what} refused: no credential of this job here; {hint}")


def close_supervisor(supervisor: Any, job_name: str, token: str | None, timeout_s: float = 10.0) -> None:
    """Stop a supervisor judging and writing events (bounded: a dead or hung one is only killed, next)."""
    try:
        ray.get((supervisor if token is None else Credentialed(supervisor, token)).close.remote(), timeout=timeout_s)
    except Exception as err:  # noqa: BLE001 - it is killed next in any case
        get_logger("elastic.control.teardown", job=job_name).warning("supervisor_close_failed", error=repr(err))


def sweep_agents(actors: JobActors) -> None:
    """Kill every ``agent-*`` actor of the job left in its namespace (the job's own only: checked by ID)."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != actors.namespace or not entry["name"].startswith("agent-"):
            continue
        try:
            actor = actors.find(entry["name"])
        except SquatError:  # not the job's: left alone
            continue
        if actor is not None:
            kill_actor(actor)


def kill_actor(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead is fine
        pass
