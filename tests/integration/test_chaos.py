"""`elastic chaos` and the `elastic_chaos` pytest fixture: seeded fault schedules, every promise checked.

The user target and the user's test file are the chaos guide's own code blocks (docs/guides/chaos.md), written to a
temp dir.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
ELASTIC = Path(sys.executable).parent / "elastic"


def readme_block(first_line: str) -> str:
    """The chaos guide's python block that starts with ``first_line``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guides" / "chaos.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith(first_line + "\n")]
    return block


def chaos(
    *args: str,
    cwd: Path | None = None,
    stderr: list[str] | None = None,
    join: bool = False,
    env: dict[str, str] | None = None,
) -> dict:
    """``elastic chaos --json *args``: its one JSON object. ``join``: on this process's Ray cluster (RAY_ADDRESS, as
    a job submitted to a cluster runs), importing what that cluster's workers import, not on an embedded one started
    for the command (with the installed package only). ``env``: variables set for the command."""
    env = {**os.environ, "PYTHONPATH": "", **(env or {})}
    if join:
        import ray

        env.update(RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [str(ELASTIC), "chaos", "--json", *args],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold one JSON object, got: {proc.stdout[-2000:]}"
    if stderr is not None:
        stderr.extend(line for line in proc.stderr.splitlines() if line.strip())
    return json.loads(lines[0])


def assert_survived(out: dict, schedules: int) -> None:
    assert out["violations"] == [] and out["hangs"] == 0 and out["not_run"] == 0 and out["ok"], out
    assert out["schedules"] == schedules and out["faults_injected"] >= schedules
    assert out["recovered"] + out["gave_up_as_expected"] == schedules
    for run in out["runs"]:
        assert run["replay"].startswith(f"elastic chaos --seed {out['seed']}")
        assert run["replay"].endswith(f"--index {run['index']}")
        assert set(run["promises"].values()) <= {"pass", "n/a"}


@pytest.mark.timeout(300)
def test_chaos_cli_on_the_demo(ray_local):
    out = chaos("--seed", "8", "--schedules", "2", "--steps", "30", join=True)
    assert_survived(out, 2)
    assert out["target"] == "elastic.demos.chaos:demo_target" and out["config_overrides"] == {"num_steps": 30}
    # seed 8 draws a kill as a snapshot is copied, then a corrupt snapshot copy read by a restore
    assert [r["scenario"] for r in out["runs"]] == ["kill", "corrupt"]
    assert [r["faults"][0]["phase"] for r in out["runs"]] == ["snapshot", "step"]
    assert all(r["restores"] for r in out["runs"]) and out["recovered"] == 2


@pytest.mark.timeout(300)
def test_chaos_cli_on_a_user_target(tmp_path, ray_local):
    (tmp_path / "my_train.py").write_text(readme_block("# my_train.py"))
    out = chaos(
        "--target", "my_train:chaos_target", "--seed", "7", "--schedules", "1", "--index", "1", cwd=tmp_path, join=True
    )
    assert_survived(out, 1)
    assert out["target"] == "my_train:chaos_target"
    assert out["runs"][0]["index"] == 1 and "--target my_train:chaos_target" in out["runs"][0]["replay"]


def leaky_cursor_target():
    """A loop whose data cursor lives outside the snapshot: a restore to step 5 feeds it batches 7, 8... again."""
    import jax
    import numpy as np

    from .helpers import config

    cursor = [-1]

    def init(key):
        return {"w": jax.random.normal(key, (8,))}

    @jax.jit
    def step_fn(state, x):
        return {"w": state["w"] * 0.9 + x.mean()}

    def loop(run):
        state = run.state
        if run.start_step == 0:
            cursor[0] = -1
        for _ in run.steps:
            cursor[0] += 1  # the bug: not derived from the step, not restored with the state
            state = run.guard(step_fn)(state, run.shard_batch(np.full((48,), float(cursor[0]), np.float32)))
            run.commit(state, batch=cursor[0])
        return state

    return {"config": config("chaos-leaky", num_steps=20), "init_fn": init, "loop": loop}


@pytest.mark.timeout(300)
def test_the_fixture_catches_a_loop_that_breaks_a_promise(elastic_chaos, ray_local):
    result = elastic_chaos(target=leaky_cursor_target, seed=2, schedules=1, scenarios=["kill"])
    assert not result.ok
    broken = {v.promise: v for v in result.violations}
    assert {"equivalence", "exactly_once"} <= set(broken), result.violations
    v = broken["exactly_once"]
    assert (v.seed, v.index, v.scenario) == (2, 0, "kill") and v.faults == (
        {"kind": "kill", "at_step": 7, "phase": "mid_step", "slice": 2},
    )
    assert "batches consumed differ" in v.detail and v.replay.endswith("--scenarios kill --index 0")
    assert result.to_dict()["runs"][0]["promises"]["bounded_loss"] == "pass"  # 2 steps redone, within 5


@pytest.fixture
def chaos_loaded(ray_local):
    """Ray connected and the chaos modules imported before pytester snapshots sys.modules: it drops what an
    in-process run imports first, and a second `ray` module would not be connected."""
    import importlib

    importlib.import_module("elastic.chaos.runner")


@pytest.mark.timeout(300)
def test_the_pytest_fixture_as_the_readme_shows(chaos_loaded, pytester):
    pytester.makepyfile(my_train=readme_block("# my_train.py"))
    pytester.makepyfile(test_my_train=readme_block("# test_my_train.py"))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")  # this process: jax and Ray already up
    result.assert_outcomes(passed=1)


INSIDE_AND_SUPERVISOR = [
    "kill_during_restore",
    "kill_during_reshard",
    "kill_during_grow",
    "supervisor_restart",
    "supervisor_lost",
]


@pytest.mark.timeout(300)
def test_faults_inside_a_move_and_on_the_supervisor(elastic_chaos, ray_local):
    """A slice killed while a restore's or a move's transfers are in flight, the supervisor restarted (a slice
    lost afterwards is still seen), the supervisor gone for good (a clear SupervisorLostError within its bound)."""
    result = elastic_chaos(seed=1, schedules=5, steps=30, scenarios=INSIDE_AND_SUPERVISOR)
    assert result.ok, result.violations
    runs = {r.schedule.scenario: r for r in result.results}
    assert sorted(runs) == sorted(INSIDE_AND_SUPERVISOR)
    for name, r in runs.items():
        # each fired in its phase; the job may end (SupervisorLostError) before a kill drawn after the supervisor's loss
        fired = (1, len(r.schedule.faults)) if name == "supervisor_lost" else (len(r.schedule.faults),) * 2
        assert fired[0] <= r.injected <= fired[1], (name, r.injected, r.schedule.faults)
        assert {p.status for p in r.verdict.promises} <= {"pass", "n/a"}, (name, r.verdict)
    assert {f.phase for name in INSIDE_AND_SUPERVISOR[:3] for f in runs[name].schedule.faults} >= {
        "restore",
        "reshard",
        "grow",
    }
    for name in INSIDE_AND_SUPERVISOR[:4]:
        assert runs[name].recovered and runs[name].record.restores, name
    lost = runs["supervisor_lost"]
    assert lost.record.outcome == "supervisor_lost" and lost.gave_up_as_expected
    assert "supervisor" in (lost.record.error or "").lower()
    assert lost.record.seconds < 60  # max(5 x heartbeat_timeout_s, 10 s) after the kill, not recovery_timeout_s


def quiet_process_target() -> dict:
    """The demo's multi-process target on 3 slices (down to 1: a kill while the group re-forms takes two) and without
    the standby group (helper processes compiling for the group one slice smaller): recovery then compiles on the
    move, which changes no promise, and each run starts fewer processes."""
    from dataclasses import replace

    from elastic.demos.chaos import process_target

    target = process_target()
    config = target["config"]
    target["config"] = replace(
        config,
        num_slices=3,
        policy=replace(config.policy, min_slices=1),
        processes=replace(config.processes, standby=False),
    )
    return target


PROCESS_SCENARIOS = ["kill_while_forming", "supervisor_restart", "notice_then_kill"]


@pytest.fixture(scope="module")
def process_chaos() -> tuple[dict, list[str]]:
    """One multi-process chaos run for the module, through ``elastic chaos --json`` (its stderr kept): its
    failure-free reference once, then one schedule per scenario of PROCESS_SCENARIOS (seed 7, 20 steps: the process
    faults of the tests below), on this session's Ray. TF_CPP_MIN_LOG_LEVEL=1 is what a parent that imported jax
    passes on (jax's default)."""
    from elastic.control.cluster import connect

    connect()
    err: list[str] = []
    out = chaos(
        *("--mode", "multi-process", "--target", "tests.integration.test_chaos:quiet_process_target"),
        *("--seed", "7", "--schedules", str(len(PROCESS_SCENARIOS)), "--steps", "20"),
        *("--scenarios", ",".join(PROCESS_SCENARIOS)),
        cwd=ROOT,
        stderr=err,
        join=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "1"},
    )
    return out, err


@pytest.mark.timeout(400)
def test_the_fixture_drives_a_multi_process_job_with_real_process_faults(process_chaos):
    """The chaos runner on a multi-process target: a worker process SIGKILLed, then a second one SIGKILLed while
    the group re-forms without the first (a survivor lost during the re-formation is one more loss); the supervisor
    killed by the driver and restarted by Ray, then a worker SIGKILLed (the restarted supervisor sees it)."""
    out, _ = process_chaos
    assert_survived(out, len(PROCESS_SCENARIOS))
    runs = {r["scenario"]: r for r in out["runs"]}
    assert sorted(runs) == sorted(PROCESS_SCENARIOS)
    forming, restart = runs["kill_while_forming"], runs["supervisor_restart"]
    assert [f["phase"] for f in forming["faults"]] == ["step", "forming"] and forming["injected"] == 2, forming
    assert forming["outcome"] == "finished" and forming["restores"], forming
    assert [f["kind"] for f in restart["faults"]] == ["supervisor_restart", "kill"] and restart["injected"] == 2
    assert restart["outcome"] == "finished" and restart["restores"], restart


@pytest.mark.timeout(400)
def test_chaos_cli_in_multi_process_mode_prints_its_progress_and_nothing_native(process_chaos):
    """Each group the driver forms hosts a coordination service, whose native log warned at each one (and logged an
    error for a group a fault kept from forming): a quiet run prints its own progress lines only, one a schedule.
    (The module's multi-process chaos run: its faults re-form the group, once while it forms.)"""
    out, err = process_chaos
    expected = [f"schedule {r['index']} {r['scenario']}: finished" for r in out["runs"]]
    assert len(err) == len(expected) and all(line.startswith(e) for line, e in zip(err, expected, strict=True)), err


NOTICES = [
    "notice_then_kill",
    "notice_early_death",
    "notice_during_restore",
    "staggered_notices",
    "notice_short_deadline",
]


def _details(run) -> dict:
    """The report's figure of each notice the run was given, by the notice's reason."""
    by_reason = {d["reason"]: d for d in run.record.notice_details}
    return {n["reason"]: (n, by_reason.get(n["reason"])) for n in run.record.notices}


def _json_details(run: dict) -> dict:
    """:func:`_details` of a run in ``elastic chaos --json``'s output."""
    by_reason = {d["reason"]: d for d in run["notice_details"]}
    return {n["reason"]: (n, by_reason.get(n["reason"])) for n in run["notices"]}


@pytest.mark.timeout(300)
def test_notices_in_the_catalogue(elastic_chaos, ray_local):
    """Each notice scenario, single-process: a notice with room leaves its slice at a step boundary (nothing
    recomputed, nothing restored), its slice killed at the deadline after the job left it; a slice that dies before
    the job could leave it, or whose deadline is shorter than a step, takes the failure path; a notice in a restore,
    and two notices a step or two apart, leave their slices too. No step lost or repeated, no hang."""
    result = elastic_chaos(seed=3, schedules=5, steps=24, scenarios=NOTICES)
    assert result.ok, result.violations
    runs = {r.schedule.scenario: r for r in result.results}
    assert sorted(runs) == sorted(NOTICES)
    for name, r in runs.items():
        assert r.recovered and {p.status for p in r.verdict.promises} <= {"pass", "n/a"}, (name, r.verdict)
        assert len(r.record.notices) == sum(f.kind == "notice" for f in r.schedule.faults), name

    then = runs["notice_then_kill"]
    ((notice, detail),) = _details(then).values()
    assert notice["refused"] is None and notice["killed_at"] >= notice["deadline"], notice  # struck in the run
    assert detail["planned"] and detail["steps_recomputed"] == 0, detail
    assert then.record.recomputed == 0 and not then.record.restores and then.injected == 2
    assert then.verdict["notices_recompute_nothing"].status == "pass"

    early = runs["notice_early_death"]
    ((notice, detail),) = _details(early).values()
    assert notice["killed_at"] < notice["deadline"] and early.record.restores, early.record  # the failure path
    assert early.verdict["notices_recompute_nothing"].status == "n/a"

    restore = runs["notice_during_restore"]
    ((notice, detail),) = _details(restore).values()
    assert len(restore.record.restores) == 1 and restore.record.min_slices_seen == 2, restore.record
    assert detail["planned"] and detail["steps_recomputed"] == 0, detail  # left live after the restore

    staggered = runs["staggered_notices"]
    both = list(_details(staggered).values())
    assert len(both) == 2 and all(d["planned"] and d["steps_recomputed"] == 0 for _, d in both), both
    assert not staggered.record.restores and staggered.record.min_slices_seen == 2

    short = runs["notice_short_deadline"]
    ((notice, detail),) = _details(short).values()
    assert notice["seconds"] < 0.2 and notice["killed_at"] is not None, notice
    assert short.verdict["notices_recompute_nothing"].status == "n/a"  # no room: the failure path, or a leave


@pytest.mark.timeout(400)
def test_a_notice_then_a_kill_at_its_deadline_in_multi_process_mode(process_chaos):
    """Multi-process: the driver gives the notice from a thread; the leaving worker donates what only it holds and
    exits; the process it ran in is killed at the deadline. Nothing recomputed, nothing restored. (The module's
    multi-process chaos run: its notice_then_kill schedule.)"""
    out, _ = process_chaos
    (run,) = [r for r in out["runs"] if r["scenario"] == "notice_then_kill"]
    assert run["outcome"] == "finished" and set(run["promises"].values()) <= {"pass", "n/a"}, run
    ((notice, detail),) = _json_details(run).values()
    assert notice["refused"] is None and detail is not None, (notice, run["notice_details"])
    assert notice["killed_at"] >= notice["deadline"] and run["injected"] == 2, notice  # the driver's last commit waited
    assert detail["planned"] and detail["steps_recomputed"] == 0, detail
    assert run["recomputed"] == 0 and not run["restores"], run
    assert run["promises"]["notices_recompute_nothing"] == "pass"
