"""Taking over a job whose client crashed: its supervisor is replaced only once its client is gone, and only by a
process holding the job's credential."""

from __future__ import annotations

import time
from typing import Any

import ray

from elastic.config import ElasticConfig
from elastic.control.teardown import cleanup
from elastic.control.tokens import find_token
from elastic.errors import AccessError, SupervisorError
from elastic.supervision import events
from elastic.supervision.credential import Credentialed
from elastic.supervision.identity import JobActors
from elastic.supervision.supervisor import SUPERVISOR_NAME

__all__ = ["CLIENT_GONE_S", "job_credential", "take_over"]

CLIENT_GONE_S = 5.0  # a supervisor whose client has not waited on it this long belongs to a dead client


def job_credential(config: ElasticConfig) -> str:
    """The job's credential as a successor finds it (``$ELASTIC_TOKEN``, or the file the crashed client wrote for
    this user); :class:`AccessError` when this process holds none."""
    token = find_token(config.job_name)
    if token is None:
        raise AccessError(
            f"a supervisor for job {config.job_name!r} runs and this process holds no credential for "
            "it: run the successor as the job's user on its client machine, or set ELASTIC_TOKEN"
        )
    return token


def take_over(config: ElasticConfig, actors: JobActors, token: str, run: str | None, log: Any) -> str | None:
    """Another client's supervisor runs for this job: take the job over if that client is gone (its supervisor and
    agents are replaced, its keepers kept), refuse if it is alive. The actor holding the supervisor's name is called
    only once its ID is the one the job recorded under ``token`` (:mod:`elastic.supervision.identity`): a squatter,
    or another job's supervisor, gets nothing. Returns the event stream's run to go on with (the crashed client's,
    or ``run`` when its supervisor is gone meanwhile)."""
    cfg = config
    existing = actors.find(SUPERVISOR_NAME)  # SquatError: not the job's under this credential
    if existing is None:  # gone meanwhile: a fresh start
        return run
    try:  # the crashed client's run goes on: one stream tells the crash and the take-over
        run = ray.get(Credentialed(existing, token).run_id.remote(), timeout=10)
    except AccessError as err:
        raise AccessError(
            f"job {cfg.job_name!r} runs under another credential than this process's: pick another job_name"
        ) from err
    except Exception:  # noqa: BLE001 - a dead or older supervisor: its job's current run, if any
        run = events.current_run(cfg.job_name)
    deadline = time.monotonic() + CLIENT_GONE_S + 5.0
    idle = 0.0
    while time.monotonic() < deadline:
        try:
            idle = ray.get(Credentialed(existing, token).client_idle_s.remote(), timeout=10)
        except AccessError:
            raise
        except Exception:  # noqa: BLE001 - a dead or stale supervisor is replaced like an idle one
            idle = float("inf")
        if idle > CLIENT_GONE_S:
            break
        time.sleep(0.5)
    else:
        raise SupervisorError(
            f"a supervisor for job {cfg.job_name!r} is already running in namespace {cfg.namespace!r} and its "
            "client is alive: pick another job_name or stop that job first"
        )
    replaced = cleanup(cfg.job_name, keep_keepers=True, token=token)
    log.warning("took_over_job", client_idle_s=round(idle, 1), replaced=replaced)
    return run
