"""The job's credential on the client's machine: the token a client runs under and the private file it keeps it in,
for the operator's commands and a successor client (a take-over).

``job_token`` is the credential a new client runs under (its predecessor's for a take-over, else a new one);
``find_token`` the one an operator's command or a successor presents: ``--token-file``, ``$ELASTIC_TOKEN``, or the file
``$ELASTIC_HOME/tokens/<job>`` (0600 in a 0700 directory of this user) the job's client wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

from elastic.config import ElasticConfig
from elastic.control.private import elastic_home, write_private
from elastic.errors import ElasticError
from elastic.log import get_logger
from elastic.supervision import credential
from elastic.supervision.identity import holder
from elastic.supervision.supervisor import SUPERVISOR_NAME

__all__ = ["find_token", "job_token", "read_token", "remove_token", "token_path", "write_token"]


def job_token(config: ElasticConfig) -> str:
    """The credential a client of job ``config`` runs under: its predecessor's when the job's supervisor is still
    there (a take-over; :func:`find_token`), else a new one. A take-over without it is refused at launch."""
    if holder(SUPERVISOR_NAME, config.namespace) is None:  # Ray's actor table: the holder is not called
        return credential.new_token()
    return find_token(config.job_name) or credential.new_token()


def token_path(job_name: str) -> Path:
    """``$ELASTIC_HOME/tokens/<job>`` (default ``~/.elastic``): a 0600 file in a 0700 directory of the client's
    user (:mod:`elastic.control.private`)."""
    return elastic_home() / "tokens" / job_name


def write_token(job_name: str, token: str) -> None:
    path = token_path(job_name)
    try:
        write_private(path, token)
    except (OSError, ElasticError) as err:  # a read-only or foreign home: operators then pass --token-file
        get_logger("elastic.control.tokens", job=job_name).warning("token_not_written", path=str(path), error=str(err))


def read_token(job_name: str) -> str | None:
    try:
        return token_path(job_name).read_text().strip() or None
    except OSError:
        return None


def find_token(job_name: str, explicit: str | None = None) -> str | None:
    """The job's credential: ``explicit`` (``--token-file``), else ``$ELASTIC_TOKEN``, else the file its client wrote
    for this user."""
    return explicit or os.environ.get("ELASTIC_TOKEN") or read_token(job_name)


def remove_token(job_name: str, token: str) -> None:
    """Remove the token file if it is still this client's (a successor may have written its own)."""
    if read_token(job_name) == token:
        try:
            token_path(job_name).unlink()
        except OSError:
            pass
