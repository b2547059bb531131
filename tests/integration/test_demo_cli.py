"""`elastic demo --json --verify`: the whole story end to end, through the console script, and what the operator
CLI (`elastic report`, `events`, `status`) says about the run afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_quiet import assert_quiet

pytestmark = pytest.mark.integration

KEYS = {
    "slices_initial",
    "slices_final",
    "min_slices_seen",
    "failures_injected",
    "recoveries",
    "client_restarts",
    "steps_committed",
    "steps_recomputed",
    "duplicate_steps",
    "skipped_steps",
    "recovery_seconds",
    "final_loss",
    "reference_final_loss",
    "max_abs_param_diff_vs_reference",
}


ELASTIC = Path(sys.executable).parent / "elastic"


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(ELASTIC), *args], capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
def test_demo_json_verify(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ELASTIC_RECORD_DIR")}
    env["ELASTIC_HOME"] = str(tmp_path / "home")  # the run's records, for the operator CLI below
    env["PYTHONWARNINGS"] = "default"  # a normal run is quiet: no Python warning shown, no Ray notice (below)
    proc = subprocess.run(
        [str(ELASTIC), "demo", "--json", "--verify", "--steps", "60", "--kill-at", "23", "--revive-at", "40"],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold one JSON object, got: {proc.stdout[-2000:]}"
    assert_quiet(proc.stderr)
    out = json.loads(lines[0])
    assert KEYS <= out.keys()
    assert out["joined_existing_cluster"] is False  # no RAY_ADDRESS: an embedded cluster of its own
    assert out["slices_initial"] == out["slices_final"] == 4 and out["min_slices_seen"] == 3
    assert out["failures_injected"] == 1 and out["recoveries"] == 1 and len(out["recovery_seconds"]) == 1
    assert out["client_restarts"] == 0 and out["duplicate_steps"] == 0 and out["skipped_steps"] == 0
    assert (
        out["steps_committed"] == 60 and out["steps_recomputed"] == 2
    )  # 20, 21 since the snapshot at 20 (22 in flight)
    assert out["max_abs_param_diff_vs_reference"] < 1e-4
    events = [e["event"] for e in out["timeline"]]
    for expected in ("inject_kill", "failure", "detected", "restored", "first_step", "inject_revive", "grow"):
        assert expected in events, events

    # After the demo (the same run, as an operator sees it): report draws it and events tell why.
    out = json.loads(cli("report", "--json", "--out", str(tmp_path / "t.png"), env=env).stdout)
    assert out["job"] == "demo" and out["recoveries"] == 1 and out["steps_committed"] == 60
    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000 and out["picture"] == str(tmp_path / "t.png")
    records = [json.loads(line) for line in cli("events", "--json", env=env).stdout.splitlines()]
    failure = [r for r in records if r["kind"] == "timeline" and r["event"] == "failure"]
    decisions = [r for r in records if r["kind"] == "view"]
    recovered = [r for r in records if r["kind"] == "timeline" and r["event"] == "first_step"]
    assert len(failure) == 1 and "lost" in failure[0]["error"], failure
    assert [d["decision"] for d in decisions] == ["Grow", "Shrink", "Grow"], decisions
    assert "lost slice(s) 1" in decisions[1]["reason"] and "back" in decisions[2]["reason"], decisions
    assert len(recovered) == 1 and recovered[0]["wall"] > decisions[1]["wall"] > failure[0]["wall"] - 5
    lost = [r for r in records if r["kind"] == "health" and not r["healthy"]]
    # named by whichever sees it first: Ray's death notice of the slice's agent, or the client's report of the slice
    # its probe found dead at dispatch (sent before the survivors answer)
    assert lost and lost[0]["slice"] == 1, lost
    assert "agent died" in lost[0]["cause"] or "client report" in lost[0]["cause"], lost
    status = json.loads(cli("status", "--json", env=env).stdout)
    assert status["state"] == "finished" and status["slices"] == [0, 1, 2, 3] and status["step"] == 59
    assert status["recoveries"] == 1 and status["epoch"] == 3
    text = cli("events", env=env).stdout  # the human form names the decision and its reason
    assert "(Shrink): lost slice(s) 1" in text


def joined() -> dict[str, str]:
    """This process's environment with RAY_ADDRESS naming its Ray cluster: a demo run there joins it (as a job submitted
    to a cluster does) instead of starting an embedded one of its own (test_demo_json_verify covers that path)."""
    import ray

    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


@pytest.mark.timeout(400)
def test_demo_client_crash_resumes_from_the_keepers(ray_local):
    proc = subprocess.run(
        [
            str(ELASTIC),
            "demo",
            "--scenario",
            "client-crash",
            "--json",
            "--verify",
            "--no-progress",
            "--steps",
            "40",
            "--kill-client-at",
            "27",
            "--snapshot-every",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=360,
        stdin=subprocess.DEVNULL,
        env=joined(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold one JSON object, got: {proc.stdout[-2000:]}"
    out = json.loads(lines[0])
    assert out["scenario"] == "client-crash" and out["first_client_exit"] == -9
    assert out["resumed_from_tier"] == "keeper" and out["client_restarts"] == 1
    assert out["restores"][0]["tier"] == "keeper" and 0 < out["restores"][0]["step"] <= 25
    assert out["steps_committed"] == 40 and out["duplicate_steps"] == 0 and out["skipped_steps"] == 0
    assert out["max_abs_param_diff_vs_reference"] <= 1e-4


@pytest.mark.timeout(400)
def test_a_sigkilled_multi_process_driver_is_resumed_from_the_keepers(ray_local):
    """The multi-process job's driver is SIGKILLed (its workers die with it); the job submitted again under its name
    takes over the detached supervisor and keepers and resumes there: not from step 0, not from disk."""
    proc = subprocess.run(
        [
            str(ELASTIC),
            "demo",
            "--scenario",
            "multi-process-driver-crash",
            "--json",
            "--verify",
            "--no-progress",
            "--steps",
            "20",
            "--kill-client-at",
            "12",
            "--slices",
            "2",  # two worker processes per driver: the takeover is the same for any number
        ],
        capture_output=True,
        text=True,
        timeout=360,
        stdin=subprocess.DEVNULL,
        env=joined(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])
    assert out["scenario"] == "multi-process-driver-crash" and out["first_client_exit"] == -9
    assert out["mode"] == "multi-process" and out["resumed_from_tier"] == "keeper"
    # the workers die with the driver once Ray sees it gone: on a loaded machine they may take and push a few steps
    # past 12 first (restored exactly: no step duplicated or skipped, the parameters checked below)
    assert out["restores"][0]["tier"] == "keeper" and 0 < out["restores"][0]["step"] < 20
    assert out["steps_committed"] == 20 and out["duplicate_steps"] == 0 and out["skipped_steps"] == 0
    assert out["max_abs_param_diff_vs_reference"] <= 1e-4
