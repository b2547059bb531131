"""`elastic demo --scenario drain --json --verify`: a notice, the slice left at a step boundary, killed at its
deadline and revived later; nothing recomputed, no recovery, the same parameters as a run without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ELASTIC = Path(sys.executable).parent / "elastic"


@pytest.mark.timeout(300)
def test_drain_demo_json_verify(tmp_path, ray_local):
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_RECORD_DIR"}
    env["ELASTIC_HOME"] = str(tmp_path / "home")
    # on this process's Ray cluster, as a job submitted to a cluster runs (a demo's own cluster: test_demo_cli.py)
    env["RAY_ADDRESS"] = ray_local.get_runtime_context().gcs_address
    argv = ["demo", "--scenario", "drain", "--json", "--verify", "--no-progress"]
    argv += ["--steps", "60", "--kill-at", "20", "--revive-at", "45", "--notice-deadline", "4"]
    proc = subprocess.run(
        [str(ELASTIC), *argv], capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold one JSON object, got: {proc.stdout[-2000:]}"
    out = json.loads(lines[0])
    got = {k: out[k] for k in ("notices", "planned_shrinks", "recoveries", "steps_recomputed", "grows")}
    assert got == {"notices": 1, "planned_shrinks": 1, "recoveries": 0, "steps_recomputed": 0, "grows": 1}, got
    assert (out["duplicate_steps"], out["skipped_steps"], out["slices_final"]) == (0, 0, 4), out
    assert out["killed_at_deadline"] is True
    assert out["max_abs_param_diff_vs_reference"] <= 1e-4
    assert out["notice_to_n_minus_1_s"] <= out["step_s"] + 0.5, out  # at most one step plus 0.5 s
    (detail,) = out["notice_details"]
    assert detail["planned"] is True and detail["steps_recomputed"] == 0 and detail["lead_s"] == pytest.approx(4.0)
