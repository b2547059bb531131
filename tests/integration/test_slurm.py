"""The elastic job on a real Slurm (``tests/integration/slurm_cluster.py``: slurmctld and six slurmd on this
machine), submitted with the sbatch template the package ships (``elastic slurm template``), running the demo's
model (``python -m elastic.demos.slurm``) as a multi-process job, one worker per Slurm node. One job, submitted
three times under the same name (``sbatch -N4``), each run with its part of Slurm's events:

1. A SIGTERM to one node's task (what ``--signal=TERM@secs`` delivered to that node's step is): a notice, the slice
   left at a step boundary, nothing recomputed; a one-node join job grows the job back to 4. A Slurm drain of
   another node: a notice too. Then the batch step signalled as the time limit comes (``--signal=B:TERM@secs``): the
   job saves to the Orbax tier at a step boundary and ends.
2. Submitted again: it resumes from exactly that step; once it saved a newer step to the Orbax tier, the whole
   allocation is cancelled (``scancel``).
3. Submitted again: it resumes from the newest step on disk. A node set down mid-run (``scontrol update
   state=down``): Slurm kills that node's processes, the job shrinks to 3 in place, a join job grows it back to 4;
   the final parameters match a failure-free run.

The workers carry the allocation's ``SLURM_*`` variables, yet their ``jax.distributed`` group is the job's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic.ops.slurm.commands import template_text
from tests.integration import slurm_cluster
from tests.integration.ray_cluster import VENV_BIN, json_lines, processes_titled

pytestmark = pytest.mark.integration

ELASTIC = VENV_BIN / "elastic"
START_TIMEOUT_S = 240  # submit -> the first steps: 4 Ray nodes and 4 workers started on a busy 2-core machine
END_TIMEOUT_S = 360  # from the node loss to the job's end: recovery, a join job's Ray node and worker, the rest
STEP_LINE = re.compile(r"\bstep (\d+) committed on (\d+) slices\b")


@pytest.fixture(scope="module")
def slurm():
    try:
        why = slurm_cluster.unavailable()
    except (RuntimeError, subprocess.SubprocessError) as err:
        pytest.fail(f"installing Slurm failed: {err}")
    if why:
        pytest.skip(why)
    try:
        cluster = slurm_cluster.start()
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        yield cluster
    finally:
        slurm_cluster.stop(cluster)


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(prefix="es-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _submit(
    slurm: slurm_cluster.Slurm,
    work: Path,
    short_tmp: Path,
    name: str,
    nodes: int,
    *demo_args: str,
    slurm_args: str = "",
) -> str:
    template = work / "elastic.sbatch"
    if not template.exists():
        template.write_text(template_text())  # what `elastic slurm template` prints
    env = {
        **slurm.env,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "TMPDIR": str(short_tmp),  # the Ray nodes' temp dirs: this test's own, short (Ray's unix sockets)
        "ELASTIC_SLURM_ARGS": f"--object-store-memory 100000000 --regrow-grace 1 {slurm_args}".strip(),
    }
    cmd = ["sbatch", "--parsable", f"-N{nodes}", f"--job-name={name}", str(template)]
    # no keepers: fewer processes to start on a 2-core machine (recoveries read the survivors' host snapshots)
    cmd += [sys.executable, "-m", "elastic.demos.slurm", "--simulated", "--verify", "--keeper-every", "0", *demo_args]
    out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def _output(work: Path, name: str, job_id: str) -> str:
    try:
        return (work / f"{name}-{job_id}.out").read_text(errors="replace")
    except OSError:
        return ""


def _wait(what: str, check: Callable[[], Any], timeout_s: float, context: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s}s:\n{context()[-6000:]}")
        time.sleep(0.25)
    return found


def _ended(slurm: slurm_cluster.Slurm, job_id: str) -> bool:
    return slurm.job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT")


def _report(text: str) -> dict[str, Any]:
    reports = [r for r in json_lines(text) if "steps_committed" in r]
    assert reports, f"no report in the job's output:\n{text[-6000:]}"
    return reports[-1]


def _steps(text: str) -> list[tuple[int, int]]:
    """(step, slices) of each ``step N committed on K slices`` line, in order."""
    return [(int(m[1]), int(m[2])) for m in STEP_LINE.finditer(text)]


def _changes(text: str) -> list[int]:
    """The slice counts the run went through, in order (each change once)."""
    out: list[int] = []
    for _, k in _steps(text):
        if not out or out[-1] != k:
            out.append(k)
    return out


def _saved(orbax: Path) -> set[int]:
    """The steps the Orbax tier holds finished (a save still writing is a temp dir of another name)."""
    try:
        return {int(p.name) for p in orbax.iterdir() if p.name.isdigit()}
    except OSError:
        return set()


def _workers(job: str) -> dict[int, dict[str, str]]:
    """The job's slice workers (their environments): one per Slurm node, each with the allocation's SLURM_*."""
    workers = {pid: env for pid, env in processes_titled("ray::SliceWorker").items() if env.get("SLURM_JOB_ID") == job}
    for env in workers.values():
        assert {"SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"} <= set(env)
    return workers


def _common(report: dict[str, Any]) -> None:
    assert report["mode"] == "multi-process", report
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0, report
    assert report["max_abs_param_diff_vs_reference"] <= 1e-4, report  # a failure-free run of as many steps


@pytest.mark.timeout(900)
def test_a_job_through_slurms_events_warned_nodes_the_time_limit_scancel_and_a_node_down(
    slurm, tmp_path: Path, short_tmp: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    name = f"ej-{secrets.token_hex(3)}"
    orbax = work / ".elastic-slurm" / name / "orbax"
    steps = ("--steps", "100", "--slices", "4", "--min-slices", "1", "--persistent-every", "10")
    # Each step takes 0.2 s at least, 2.5 s on fewer slices: time for a join job's node and worker to come. One join
    # job at most: the drained node is not replaced (the job stops right after it left). The run's one Orbax save is
    # the stop's (a slice that leaves at a step whose periodic save is being written waits for the save to end).
    first = _submit(
        slurm, work, short_tmp, name, 4, *steps, "--persistent-every", "1000", "--pace", "0.2", "--pace-degraded",
        "2.5", slurm_args="--drain-deadline 8 --max-joins 1",
    )  # fmt: skip
    text = lambda: _output(work, name, first)  # noqa: E731
    out = lambda: text() + slurm.log()  # noqa: E731
    started = time.monotonic()
    _wait("step 3 on 4 slices", lambda: "step 3 committed on 4 slices" in text(), START_TIMEOUT_S, out)
    reached_s = time.monotonic() - started
    # The workers have the allocation's SLURM_* (jax's own Slurm detection would find them), one per node.
    assert sorted(env["SLURMD_NODENAME"] for env in _workers(first).values()) == ["n1", "n2", "n3", "n4"]

    # 1. n4 warned: a SIGTERM to its task (its `elastic slurm start`), what a scheduler's warning to one node is.
    (task,) = [pid for pid, cmd in slurm_cluster.processes_of(first, "n4").items() if "slurm start" in cmd]
    try:
        os.kill(task, signal.SIGTERM)
        _wait("the job on 3 slices", lambda: _changes(text())[:2] == [4, 3], 60, out)
        _wait("the job back on 4 slices", lambda: len(_changes(text())) >= 3, END_TIMEOUT_S, out)
        slurm.run("scontrol", "update", "nodename=n3", "state=drain", "reason=elastic-test-drain")
        _wait("the job on 3 slices again", lambda: len(_changes(text())) >= 4, 60, out)
        slurm.run("scancel", "--batch", "--signal=TERM", first)  # the time limit's warning
        _wait("the stopped job's end", lambda: _ended(slurm, first), 120, out)
    finally:
        slurm.run("scontrol", "update", "nodename=n3", "state=resume")
    r1 = text()
    # submitted at once (Slurm starts it on nodes as they come free); paced, so that it still runs when cancelled
    second = _submit(slurm, work, short_tmp, name, 4, *steps, "--pace", "0.2")
    info = slurm.job(first)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, r1[-6000:])
    report = _report(r1)
    _common(report)
    assert _changes(r1) == [4, 3, 4, 3], _steps(r1)
    assert (report["notices"], report["recoveries"], report["planned_shrinks"]) == (2, 0, 2), report
    assert report["min_slices_seen"] == 3 and report["grows"] == 1 and report["slices_final"] == 3, report
    assert list(report["leaving_exit_codes"].values()) == [0, 0], report
    details = report["notice_details"]
    assert [d["source"] for d in details] == ["ray_drain", "ray_drain"], details
    assert all(d["planned"] and d["steps_recomputed"] == 0 for d in details), details
    for what, node in (("slurm_leave_forwarded", "n4"), ("slurm_drain_forwarded", "n3")):
        lines = [line for line in r1.splitlines() if what in line]
        assert len(lines) == 1 and f"node={node}" in lines[0], (what, lines)
    assert "slurm_node_leaving" in r1 and "slurm_stop_requested" in r1 and "slurm_stop_forwarded" in r1
    assert "the most the policy allows" in r1  # the drained node's replacement, not asked for
    at = report["stopped"]["at_step"]
    assert report["stopped"]["persisted_step"] == at and at < 100, report
    assert report["steps_committed"] == at and report["steps_recomputed"] == 0, report
    (join,) = slurm.jobs_named(f"{name}-join")
    assert join["NodeList"] == "n5", join
    _wait("the join job's end", lambda: _ended(slurm, join["JobId"]), 60, out)  # it stops once the job ended
    assert slurm.job(join["JobId"])["ExitCode"] == "0:0", slurm.job(join["JobId"])

    # 2. The same name again: it resumes from exactly the step saved at the stop. Once it saved a step of its own to
    # the Orbax tier, the whole allocation is cancelled: SIGTERM to every process of every step, SIGKILL 5 s later.
    text = lambda: _output(work, name, second)  # noqa: E731
    out = lambda: text() + slurm.log()  # noqa: E731
    own = (at // 10 + 1) * 10  # its first periodic save
    _wait(f"step {own} in the Orbax tier", lambda: own in _saved(orbax), START_TIMEOUT_S + 60, out)
    slurm.run("scancel", second)
    _wait("the cancelled job's end", lambda: _ended(slurm, second) and not slurm_cluster.processes_of(second), 60, out)
    r2 = text()
    assert slurm.job(second)["JobState"] == "CANCELLED", slurm.job(second)
    done = [s for s, _ in _steps(r2)]
    assert done and done == list(range(at, at + len(done))), done  # from exactly the stop's step, none twice
    newest = max(_saved(orbax))  # the newest save that finished: a periodic one, or the stop's if it made one
    assert newest >= own and newest <= at + len(done), (newest, done)
    assert len(slurm.jobs_named(f"{name}-join")) == 1, "the cancelled run asked for a join job"
    assert "slurm_join_submitted" not in r2, r2[-3000:]

    # 3. The same name again: it resumes from the newest step on disk. A node goes down: Slurm removes it from the
    # allocation and kills what ran there; the job shrinks to 3 and a join job on a spare node grows it back to 4.
    third = _submit(slurm, work, short_tmp, name, 4, *steps, "--pace", "0.2", "--pace-degraded", "2")
    text = lambda: _output(work, name, third)  # noqa: E731
    out = lambda: text() + slurm.log()  # noqa: E731
    _wait("2 steps on 4 slices", lambda: sum(k == 4 for _, k in _steps(text())) >= 2, START_TIMEOUT_S, out)
    nodes = sorted(env["SLURMD_NODENAME"] for env in _workers(third).values())
    assert len(nodes) == 4, nodes
    lost = nodes[-1]  # not the head's (the allocation's first node)
    try:
        slurm.run("scontrol", "update", f"nodename={lost}", "state=down", "reason=elastic-test")
        _wait(f"end of {lost}'s processes", lambda: not slurm_cluster.processes_of(third, lost), 60, out)
        _check_status(slurm, work, name, third)
        _wait("the job's end", lambda: _ended(slurm, third), END_TIMEOUT_S, out)
    finally:
        slurm.run("scontrol", "update", f"nodename={lost}", "state=resume")
    r3 = text()
    info = slurm.job(third)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, r3[-6000:])
    assert lost not in info["NodeList"] and info["NodeList"] != "", info  # Slurm shrank the allocation too
    report = _report(r3)
    _common(report)
    assert report["resumed_from_tier"] == "persistent", report
    assert report["restores"][0] == {**report["restores"][0], "step": newest, "tier": "persistent"}, report
    assert _steps(r3)[0][0] == newest, _steps(r3)[:3]
    assert report["steps_committed"] == 100 and report["slices_final"] == 4, report
    # The job shrank to 3; on a loaded machine a survivor's process may die too as its group breaks (the runtime
    # counts it in survivors_lost and replaces it on its own node): then it went to 2 before it grew back.
    lowest = report["min_slices_seen"]
    assert lowest == 3 or (lowest == 2 and report["survivors_lost"] >= 1), report
    assert _changes(r3)[0] == 4 and _changes(r3)[-1] == 4 and lowest in _changes(r3), _changes(r3)
    assert report["recoveries"] >= 1 and report["grows"] >= 1, report
    assert report["steps_recomputed"] <= 5, report  # at most the steps since the newest snapshot
    joins = [j for j in slurm.jobs_named(f"{name}-join") if j["JobId"] != join["JobId"]]
    assert len(joins) == 1 and joins[0]["NodeList"] not in nodes, joins  # a spare node
    _wait("the join job's end", lambda: _ended(slurm, joins[0]["JobId"]), 60, out)
    assert slurm.job(joins[0]["JobId"])["ExitCode"] == "0:0", slurm.job(joins[0]["JobId"])
    gone = lambda: not any(slurm_cluster.processes_of(j) for j in (first, third, joins[0]["JobId"]))  # noqa: E731
    _wait("end of the runs' processes", gone, 60, out)
    print(
        f"step 3 after {reached_s:.1f}s, stopped at {at}, cancelled after saving {newest}, all done after "
        f"{time.monotonic() - started:.1f}s; lowest {lowest} slices, survivors_lost {report['survivors_lost']}"
    )


def _check_status(slurm: slurm_cluster.Slurm, work: Path, name: str, job: str) -> None:
    """The job's status from outside the allocation, while it runs: its Slurm job and head, then the operator's
    view through the variables ``elastic slurm status`` printed."""
    found = subprocess.run(
        [str(ELASTIC), "slurm", "status", "--job", name, "--dir", str(work / ".elastic-slurm"), "--json"],
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    status = json.loads(found.stdout)
    # the job's own row (a join job may be queued already, and squeue may list it first)
    assert status["running"] and [job, name] in [row[:2] for row in status["squeue"]], status
    found = subprocess.run(
        [str(ELASTIC), "status", "--job", name, "--json"],
        env={**slurm.env, **status["env"], "ELASTIC_CONNECT_TIMEOUT_S": "30"},  # a busy head answers late
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0 and json.loads(found.stdout)["job"] == name, found.stdout + found.stderr


@pytest.mark.timeout(120)
def test_jax_in_a_slurm_step_joins_the_jobs_group_not_slurms(slurm, tmp_path: Path) -> None:
    """Two Slurm tasks (SLURM_NTASKS=2, SLURM_PROCID 0 and 1), each joining a group of its own of one process
    through the job's seam (``runtime.distributed.join``): jax sees the job's group, not Slurm's."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os\n"
        "os.environ.update(JAX_PLATFORMS='cpu', XLA_FLAGS='--xla_force_host_platform_device_count=2')\n"
        "import jax\n"
        "from jax._src.clusters import SlurmCluster\n"
        "from elastic.runtime import distributed\n"
        "service = distributed.CoordinationService(1)\n"
        "distributed.join(service.address, 1, 0)\n"
        "print(json.dumps({'slurm': SlurmCluster.is_env_present(), 'procid': os.environ['SLURM_PROCID'],\n"
        "    'count': jax.process_count(), 'index': jax.process_index(), 'devices': len(jax.devices())}))\n"
        "distributed.leave()\n"
        "service.stop()\n"
    )
    done = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", sys.executable, str(script)],
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    rows = json_lines(done.stdout)
    assert done.returncode == 0 and len(rows) == 2, (done.stdout, done.stderr[-3000:])
    assert sorted(r["procid"] for r in rows) == ["0", "1"], rows
    for r in rows:
        assert r["slurm"] and r["count"] == 1 and r["index"] == 0 and r["devices"] == 2, r
