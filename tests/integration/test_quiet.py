"""A normal run is quiet: no Python warning, no Ray notice, nothing of Ray's on stdout (``-v`` and ELASTIC_VERBOSE:
tests/unit/test_quiet.py). A whole job's run is checked so in ``test_demo_cli.py::test_demo_json_verify``; here, a
script's own Ray started after jax, and an actor retried under a pending call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPT = textwrap.dedent("""
    import os
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax, ray
    import elastic

    jax.devices()  # JAX's backends run threads before Ray starts its processes (the usual order in a script)
    from elastic.control.cluster import connect
    connect()  # this script's own Ray, as a job's client starts it
    # an actor killed under a pending call: Ray's error listener reports its retry (stdout, before the fix)
    @ray.remote(max_restarts=1, max_task_retries=-1)
    class Sleeper:
        def nap(self, s):
            import time; time.sleep(s)
    a = Sleeper.remote()
    ref = a.nap.remote(3)
    ray.get(a.nap.remote(0), timeout=60)
    ray.kill(a, no_restart=False)
    ray.get(ref, timeout=60)
    ray.shutdown()
""")


def run(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTIC_VERBOSE")}
    env.update(PYTHONPATH=root, PYTHONWARNINGS="default", **env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=200,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_normal_run_prints_no_warning_and_no_ray_notice():
    proc = run({})
    assert proc.stdout == "", proc.stdout  # nothing of Ray's on stdout
    assert_quiet(proc.stderr)


NOISE = ("Warning", "os.fork()", "Token authentication", "(raylet)", "retries remaining")


def assert_quiet(stderr: str) -> None:
    """No Python warning and no Ray notice in a run's ``stderr``."""
    for noise in NOISE:
        assert noise not in stderr, f"{noise!r} on stderr:\n{stderr[-3000:]}"
