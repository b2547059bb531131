"""Ray's own output routing (elastic.quiet): quiet by default, back with -v / ELASTIC_VERBOSE."""

from __future__ import annotations

import logging
import warnings

import pytest

from elastic import quiet


@pytest.fixture
def ray_logger(monkeypatch):
    from ray._private import worker  # importing Ray configures its logger (INFO)

    logger = logging.getLogger("ray")
    level = logger.level
    monkeypatch.delenv("RAY_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("ELASTIC_VERBOSE", raising=False)
    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # restored after the test
    monkeypatch.setattr(quiet, "_VERBOSE", [])
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(level)


def test_rays_logger_shows_errors_only_unless_verbose(ray_logger, monkeypatch):
    quiet.route_ray_loggers()
    assert ray_logger.level == logging.ERROR
    quiet.set_verbose(True)
    assert ray_logger.level == logging.INFO
    quiet.set_verbose(False)
    assert ray_logger.level == logging.ERROR
    monkeypatch.setenv("RAY_LOGGING_LEVEL", "debug")  # the user's own choice is left alone
    ray_logger.setLevel(logging.DEBUG)
    quiet.route_ray_loggers()
    assert ray_logger.level == logging.DEBUG


def test_the_error_listeners_lines_leave_stdout(ray_logger, capsys, monkeypatch):
    from ray._private import worker

    seen = []
    monkeypatch.setattr(worker, "print_to_stdstream", lambda data, ignore_prefix: seen.append(data))
    quiet.route_ray_errors()
    quiet.route_ray_errors()  # idempotent
    line = {
        "lines": ["Task Supervisor.heartbeat failed. There are infinite retries remaining"],
        "pid": "raylet",
        "is_err": False,
    }
    worker.print_to_stdstream(line, ignore_prefix=False)
    worker.print_to_stdstream({"lines": ["a worker's print"], "pid": 123, "is_err": False}, ignore_prefix=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == "" and [d["pid"] for d in seen] == [123]  # raylet's dropped, others kept
    monkeypatch.setenv("ELASTIC_VERBOSE", "1")
    worker.print_to_stdstream(line, ignore_prefix=False)
    out = capsys.readouterr()
    assert out.out == "" and "(raylet) Task Supervisor.heartbeat failed" in out.err


def test_jaxs_fork_warning_is_ignored_only_while_ray_starts():
    def fork_warning():
        warnings.warn(  # noqa: B028 (as jax warns)
            "os.fork() was called. os.fork() is incompatible with multithreaded code",
            RuntimeWarning,
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet.starting_ray():
            fork_warning()
        assert caught == []
        fork_warning()
        assert len(caught) == 1
