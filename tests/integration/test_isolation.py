"""Isolation: a job's supervisor takes commands (report_lost, close, inject) only with the job's own token, created
at start; another job's client is refused, and the refusal is written to the job's event stream."""
from __future__ import annotations

import os
import stat
import uuid

import pytest
import ray

from elastic import SupervisorError

from elastic.supervision import events
from elastic.control.cluster import ActorGroup, read_token, token_path

from .helpers import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_command_from_another_jobs_client_is_refused(ray_local):
    mine, other = (ActorGroup(config(f"iso-{name}-{uuid.uuid4().hex[:6]}")) for name in ("a", "b"))
    try:
        mine.launch()
        other.launch()
        assert mine.token != other.token
        path = token_path(mine._config.job_name)  # noqa: SLF001
        assert read_token(mine._config.job_name) == mine.token  # noqa: SLF001
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        for call in (lambda: mine.supervisor.report_lost.remote([1], "not yours", other.token),
                     lambda: mine.supervisor.close.remote(other.token),
                     lambda: mine.supervisor.inject.remote("kill", 1, other.token),
                     lambda: mine.supervisor.report_lost.remote([1], "no token")):
            with pytest.raises(SupervisorError, match="refused: it does not carry job"):
                ray.get(call(), timeout=30)
        view = ray.get(mine.supervisor.view.remote(), timeout=30)
        assert view.active == frozenset(range(4)) and view.epoch == 1, view  # nothing happened
        refused = [e for e in events.read(mine._config.job_name, mine.run) if e["kind"] == "refused_command"]  # noqa: SLF001
        assert [e["command"] for e in refused] == ["report_lost", "close", "inject kill", "report_lost"]
        out = ray.get(mine.supervisor.inject.remote("kill", 1, mine.token), timeout=30)  # its own token works
        assert out["agent"] == "agent-1-0"
    finally:
        for group in (mine, other):
            group.shutdown()
            events.delete(group._config.job_name)  # noqa: SLF001
    assert not path.exists()
