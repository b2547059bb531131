"""The job's Ray metrics, read from Ray's Prometheus endpoint as an operator's scraper would.

A driver process starts its own Ray (with a 1 s report interval instead of Ray's 10 s; Ray picks the metrics
export port and the driver reports it), runs a short job that loses slice 1, then holds Ray up until the test
has scraped it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = "metrics-drill"
STEPS = 30

DRIVER = """
import json, os, sys
import ray
for attempt in range(3):  # on a loaded machine Ray's own start can miss its fixed 30 s wait for the raylet
    try:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
        break
    except Exception as e:
        if "timed out during startup" not in str(e) or attempt == 2:
            raise
        print(f"ray.init attempt {{attempt + 1}} failed: {{e}}", file=sys.stderr, flush=True)
        ray.shutdown()
port = ray.nodes()[0]["MetricsExportPort"]
from elastic import Faults
from tests.integration.helpers import trainer
result = trainer({job!r}, Faults().kill_slice(1, at_step=12), num_steps={steps}).fit()
r = result.report
with open({report!r} + ".tmp", "w") as out:  # a file: Ray's own warnings may land on stdout mid-line
    json.dump({{"port": port, "steps_committed": r.steps_committed, "recoveries": r.recoveries,
               "slices_final": r.slices_final, "snapshot_held_bytes": r.snapshot_held_bytes}}, out)
os.replace({report!r} + ".tmp", {report!r})
sys.stdin.read()  # keep Ray (and the driver's metrics) up until the test has read them
ray.shutdown()
"""

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """The endpoint's samples of this job as {(name, labels other than Ray's): value}."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        m = SAMPLE.match(line)
        if not m or not m["name"].startswith("ray_elastic_"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        if labels.pop("job", None) != JOB:
            continue
        mine = frozenset((k, v) for k, v in labels.items() if k in ("phase", "kind", "le"))
        out[(m["name"], mine)] = float(m["value"])
    return out


def read_report(proc: subprocess.Popen, path: Path, timeout: float) -> dict | None:
    """The report the driver wrote to ``path`` (None if it exited first)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            return None
        assert time.monotonic() < deadline, f"the driver wrote no report within {timeout} s"
        time.sleep(0.1)  # polls for the file (the event), bounded above
    return json.loads(path.read_text())


def test_job_metrics_reach_rays_prometheus_endpoint(tmp_path):
    env = {
        **os.environ,
        "RAY_metrics_report_interval_ms": "1000",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "RAY_DISABLE_USAGE_STATS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    code = textwrap.dedent(DRIVER.format(job=JOB, steps=STEPS, report=str(tmp_path / "report.json")))
    with open(tmp_path / "driver.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=err,  # with its stderr: nothing reads a pipe while it runs
            stderr=err,
            text=True,
        )
    try:
        report = read_report(proc, tmp_path / "report.json", 150)
        assert report, f"the driver exited ({proc.poll()}): {(tmp_path / 'driver.err').read_text()[-3000:]}"
        assert report["steps_committed"] == STEPS and report["recoveries"] == 1
        port = report["port"]

        t0, deadline, samples = time.monotonic(), time.monotonic() + 20, {}
        while time.monotonic() < deadline:  # the last commits reach the endpoint within a report interval
            samples = scrape(port)
            if (
                samples.get(("ray_elastic_steps_committed_total", frozenset())) == STEPS
                and ("ray_elastic_slices_active", frozenset()) in samples
            ):
                break
            time.sleep(0.2)
        waited = time.monotonic() - t0
        print(f"metrics final after {waited:.2f} s")

        def value(name: str, **labels: str) -> float | None:
            return samples.get((name, frozenset(labels.items())))

        assert value("ray_elastic_steps_committed_total") == STEPS, sorted(samples)
        assert value("ray_elastic_recoveries_total") == report["recoveries"] == 1
        assert value("ray_elastic_failures_total") >= 1
        assert value("ray_elastic_slices_active") == report["slices_final"] == 3
        assert value("ray_elastic_epoch") >= 2
        assert value("ray_elastic_step_seconds_count") > STEPS // 2  # steady steps (recovery gaps left out)
        assert value("ray_elastic_step_seconds_bucket", le="+Inf") == value("ray_elastic_step_seconds_count")
        assert value("ray_elastic_recovery_seconds_count") == 1
        for phase in ("detect", "decide", "restore", "first_step"):  # a killed slice: every phase is known
            assert value("ray_elastic_recovery_phase_seconds_count", phase=phase) == 1, phase
        assert 0 < value("ray_elastic_goodput") <= 1
        assert value("ray_elastic_snapshot_blocking_seconds_total") > 0
        assert value("ray_elastic_snapshots_taken_total") >= 1
        assert value("ray_elastic_snapshot_held_bytes") > 0

        # Ray drops a gauge not set for two report intervals (2 s here): the job's gauges are kept fresh.
        until = time.monotonic() + 3
        while time.monotonic() < until:
            assert ("ray_elastic_slices_active", frozenset()) in scrape(port), "the gauge expired"
            time.sleep(0.5)
        assert "metrics_update_failed" not in (tmp_path / "driver.err").read_text()
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
