"""``elastic demo --scenario pool --json --verify``, run as the command (its own process, joined to this session's
Ray), with slower steps: two multi-process jobs on a pool of 5 slices; ``low`` shrinks in place for ``high``
(nothing recomputed), a worker of ``high`` is SIGKILLed and one of ``low``'s slices swapped in, the killed slice
returns to ``low``, ``high`` ends and ``low`` grows back to 5; each job's parameters match a plain run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.demos.pool import PoolDemoSpec

pytestmark = pytest.mark.integration

ELASTIC = Path(sys.executable).parent / "elastic"
PACE_S = 0.3  # slower steps than the demo's 0.2 s: time for each new worker to start and join on a busy machine


@pytest.mark.timeout(600)
def test_the_pool_demo_shows_its_sequence(ray_local) -> None:
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    cmd = [str(ELASTIC), "demo", "--scenario", "pool", "--json", "--verify", "--pace", str(PACE_S)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold one JSON object, got: {proc.stdout[-2000:]}"
    out = json.loads(lines[0])
    spec = PoolDemoSpec(pace_s=PACE_S)  # the command's defaults (5 slices of 1, low 150 steps, high 60)
    low, high = out["jobs"]["low"], out["jobs"]["high"]
    for r, steps in ((low, spec.steps), (high, spec.high_steps)):
        assert (r["duplicate_steps"], r["skipped_steps"], r["steps_committed"]) == (0, 0, steps), r
        assert r["max_abs_param_diff_vs_reference"] <= 1e-4, r
        assert r["mode"] == "multi-process" and r["grows"] >= 1, r
    assert (low["slices_initial"], low["min_slices_seen"], low["slices_final"]) == (5, 1, 5), low
    assert (low["notices"], low["recoveries"], low["steps_recomputed"]) == (2, 0, 0), low
    assert [d["steps_recomputed"] for d in low["notice_details"]] == [0, 0], low["notice_details"]
    assert [d["slices"] for d in low["notice_details"]] == [[2, 3, 4], [1]], low["notice_details"]
    assert {d["source"] for d in low["notice_details"]} == {"pool"}, low["notice_details"]
    # every worker that left a reclaimed slice did so at a step boundary and exited 0
    assert sorted(low["leaving_exit_codes"]) == ["1", "2", "3", "4"], low["leaving_exit_codes"]
    assert set(low["leaving_exit_codes"].values()) == {0}, low["leaving_exit_codes"]
    assert low["pool"]["slices_failed"] == [], low["pool"]
    assert (high["slices_initial"], high["min_slices_seen"], high["slices_final"]) == (3, 2, 3), high
    assert high["recoveries"] == 1 and high["pool"]["slices_failed"] == [spec.kill_slice], high
    # at most a step plus 5 s when the demo runs alone (2.5-3.3 s measured); beside another test file's processes on
    # CI's 2 cores the swapped-in slice's new worker takes longer to start (6.6 s seen), hence 10 s here
    assert high["seconds_below_asked"] <= spec.pace_s + 10.0, high["seconds_below_asked"]
    reasons = [e["reason"] for e in out["timeline"] if e["event"] == "pool"]
    killed = out["pool"]["killed_slice"]
    expected = [
        "lend 0,1,2,3,4 to low",
        "reclaim 2,3,4 from low for high",
        "lend 2,3,4 to high",
        f"slice {killed} failed (held by high); reclaim 1 from low for high",
        "lend 1 to high",
        f"slice {killed} returned; lend {killed} to low",
        "job high left",
        "job low left",
    ]
    at = 0
    for text in expected:  # in this order
        at = next((i for i, r in enumerate(reasons) if i >= at and text in r), None)  # type: ignore[assignment]
        assert at is not None, (text, reasons)
