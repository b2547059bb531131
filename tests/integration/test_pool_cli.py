"""``elastic pool start|status|events|mark|stop`` against a real Ray (the shared embedded cluster, named by
RAY_ADDRESS): credentials from the files ``start`` wrote, a user's view of their own jobs only, errors in one line."""

from __future__ import annotations

import json

import pytest

from elastic.cli import main
from elastic.pool import JobSpec
from elastic.pool.access import user_credential
from elastic.pool.client import find_pool


@pytest.fixture
def cli_env(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", ray_local.get_runtime_context().gcs_address)
    monkeypatch.delenv("ELASTIC_TOKEN", raising=False)
    return tmp_path


def _json(capsys) -> object:
    return json.loads(capsys.readouterr().out)


def test_start_status_events_stop(cli_env, capsys) -> None:
    name = "clipool"
    assert (
        main(["pool", "start", "--name", name, "--slices", "4", "--quota", "bob=2", "--user", "alice", "--json"]) == 0
    )
    started = _json(capsys)
    assert started["users"] == ["alice", "bob"] and (cli_env / "tokens" / f"pool-{name}").stat().st_mode & 0o077 == 0
    try:
        token = (cli_env / "tokens" / f"pool-{name}").read_text().strip()
        find_pool(name, user_credential(token, "alice"), user="alice").call(
            "submit", JobSpec(name="a", user="alice", max_slices=3)
        )
        find_pool(name, user_credential(token, "bob"), user="bob").call(
            "submit", JobSpec(name="b", user="bob", priority=5, max_slices=3)
        )
        assert main(["pool", "status", "--name", name, "--json"]) == 0
        status = _json(capsys)
        assert status["jobs"]["b"]["target"] == 2 and status["jobs"]["a"]["leave"] == [2]
        assert main(["pool", "status", "--name", name, "--user", "alice"]) == 0
        text = capsys.readouterr().out
        assert "a (alice, priority 0): running on 0,1,2, leaving 2" in text and "b (" not in text
        assert "1 slice(s) held by other users' jobs" in text
        assert main(["pool", "events", "--name", name, "--json"]) == 0
        kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
        assert kinds == ["pool_started", "decision", "decision"]
        assert main(["pool", "events", "--name", name, "--user", "alice"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 2
        assert main(["pool", "mark", "--name", name, "--slice", "0", "--failed", "--user", "alice", "--json"]) == 0
        assert _json(capsys) == {"pool": name, "slice": 0, "failed": True, "version": 3}
        assert main(["pool", "mark", "--name", name, "--slice", "0", "--returned", "--user", "alice"]) == 1
        assert "only pool" in capsys.readouterr().err
        assert main(["pool", "mark", "--name", name, "--slice", "0", "--returned"]) == 0
        assert "marked returned (decision 4)" in capsys.readouterr().out
        assert main(["pool", "stop", "--name", name, "--user", "alice"]) == 2
        assert "operator's" in capsys.readouterr().err
    finally:
        assert main(["pool", "stop", "--name", name]) == 0
    capsys.readouterr()
    assert main(["pool", "status", "--name", name]) == 2
    assert "is not running" in capsys.readouterr().err


def test_errors_are_one_line(cli_env, capsys, monkeypatch) -> None:
    assert main(["pool", "status", "--name", "nopool"]) == 2
    assert "no credential of its operator" in capsys.readouterr().err
    assert main(["pool", "start", "--name", "bad", "--slices", "0"]) == 2
    assert "slices is an integer >= 1" in capsys.readouterr().err
    monkeypatch.delenv("RAY_ADDRESS")
    assert main(["pool", "status", "--name", "x"]) == 2
    assert "set RAY_ADDRESS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pool", "status", "--name", "x", "--token", "abc"])
    assert "command line is readable" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pool", "start", "--name", "x", "--slices", "2", "--quota", "bob"])
    assert "USER=N" in capsys.readouterr().err
