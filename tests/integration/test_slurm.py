"""The elastic job on a real Slurm (``tests/integration/slurm_cluster.py``: slurmctld and five slurmd on this
machine), submitted with the sbatch template the package ships (``elastic slurm template``), running the demo's
model (``python -m elastic.demos.slurm``) as a multi-process job, one worker per Slurm node.

- ``sbatch -N4``; a node set down mid-run (``scontrol update state=down``): Slurm kills that node's processes
  (its Ray node and the slice's worker among them), the job shrinks to 3 in place, asks Slurm for a one-node job,
  which joins, and the job grows back to 4; the final parameters match a failure-free run.
- The workers carry the allocation's ``SLURM_*`` variables, yet their ``jax.distributed`` group is the job's.
- A SIGTERM to one node's task and a Slurm drain of another: notices, each slice left at a step boundary with
  nothing recomputed; join jobs replace both nodes. Then the batch step signalled (``--signal=B:TERM@secs``, the
  time limit coming): the job saves to the Orbax tier at a step boundary and ends; the same job name submitted again
  resumes from exactly that step.
"""

from __future__ import annotations

import json
import os
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


@pytest.mark.timeout(600)
def test_a_node_down_shrinks_the_job_and_a_join_job_grows_it_back(slurm, tmp_path: Path, short_tmp: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    name = f"ej-grow-{secrets.token_hex(3)}"
    # Each step takes 0.2 s at least, 2 s on fewer slices: time for the replacement's node and worker to come.
    args = ("--steps", "45", "--pace", "0.2", "--pace-degraded", "2", "--snapshot-every", "5")
    job = _submit(slurm, work, short_tmp, name, 4, *args)
    out = lambda: _output(work, name, job) + slurm.log()  # noqa: E731
    started = time.monotonic()
    _wait(
        "step 8 on 4 slices", lambda: "step 8 committed on 4 slices" in _output(work, name, job), START_TIMEOUT_S, out
    )
    reached_s = time.monotonic() - started

    # The workers have the allocation's SLURM_* (jax's own Slurm detection would find them), one per node.
    workers = {pid: env for pid, env in processes_titled("ray::SliceWorker").items() if env.get("SLURM_JOB_ID") == job}
    assert len(workers) == 4, workers.keys()
    for env in workers.values():
        assert {"SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"} <= set(env)
    assert sorted(env["SLURMD_NODENAME"] for env in workers.values()) == ["n1", "n2", "n3", "n4"]

    # A node goes down: Slurm removes it from the allocation and kills what ran there.
    slurm.run("scontrol", "update", "nodename=n4", "state=down", "reason=elastic-test")
    _wait("end of n4's processes", lambda: not slurm_cluster.processes_of(job, "n4"), 60, out)

    # The job's status from outside the allocation, while it runs: its Slurm job and head, then the operator's view.
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

    _wait("the job's end", lambda: _ended(slurm, job), END_TIMEOUT_S, out)
    text = _output(work, name, job)
    info = slurm.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-6000:])
    assert info["NodeList"] == "n[1-3]", info  # Slurm shrank the allocation too

    report = _report(text)
    assert report["mode"] == "multi-process" and report["steps_committed"] == 45, report
    # The job shrank to 3; on a loaded machine a survivor's process may die too as its group breaks (the runtime
    # counts it in survivors_lost and replaces it on its own node): then it went to 2 before it grew back.
    lowest = report["min_slices_seen"]
    assert lowest == 3 or (lowest == 2 and report["survivors_lost"] >= 1), report
    assert report["slices_final"] == 4, report
    assert report["recoveries"] >= 1 and report["grows"] >= 1, report
    assert report["steps_recomputed"] <= 5, report  # at most the steps since the newest snapshot
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0, report
    assert report["max_abs_param_diff_vs_reference"] <= 1e-4, report
    low = f"on {lowest} slices"
    assert low in text and text.rfind("on 4 slices") > text.find(low), text[-3000:]

    # The job asked Slurm for the replacement: a one-node job named after it, run on the spare node.
    joins = slurm.jobs_named(f"{name}-join")
    assert len(joins) == 1 and joins[0]["NodeList"] == "n5", joins
    _wait("the join job's end", lambda: _ended(slurm, joins[0]["JobId"]), 60, out)  # it stops once the job ended
    joins = slurm.jobs_named(f"{name}-join")
    assert joins[0]["JobState"] == "COMPLETED" and joins[0]["ExitCode"] == "0:0", joins
    assert not slurm_cluster.processes_of(job) and not slurm_cluster.processes_of(joins[0]["JobId"])
    print(
        f"step 8 after {reached_s:.1f}s, job done after {time.monotonic() - started:.1f}s, "
        f"lowest {lowest} slices, survivors_lost {report['survivors_lost']}"
    )
    slurm.run("scontrol", "update", "nodename=n4", "state=resume")


@pytest.mark.timeout(600)
def test_nodes_warned_leave_at_a_step_boundary_and_the_time_limits_warning_saves_the_job_for_its_resubmission(
    slurm, tmp_path: Path, short_tmp: Path
) -> None:
    """On a 3-node job, a SIGTERM to n3's task (its ``elastic slurm start``), then, once the job left n3,
    ``scontrol update nodename=n2 state=drain``: each a notice for the slice there (a Ray drain of its Ray node,
    ``--drain-deadline`` of warning); the job leaves both at step boundaries, recomputing nothing, their workers
    exiting 0; the head asks for one-node jobs to replace the nodes, and the job grows back onto them. Then the batch
    step is signalled as ``--signal=B:TERM@secs`` does when the time limit comes (``scancel --batch --signal=TERM``):
    the job saves its state to the Orbax tier at the next step boundary and ends; the same job name submitted again
    resumes from exactly that step."""
    work = tmp_path / "work"
    work.mkdir()
    name = f"ej-warn-{secrets.token_hex(3)}"
    # 2.5 s a step below 3 slices: time for the join jobs' nodes and, past the deadline, the new workers
    steps = ("--steps", "80", "--slices", "3", "--min-slices", "1", "--persistent-every", "10")
    args = (*steps, "--pace", "0.2", "--pace-degraded", "2.5")
    job = _submit(slurm, work, short_tmp, name, 3, *args, slurm_args="--drain-deadline 8")
    out = lambda: _output(work, name, job) + slurm.log()  # noqa: E731
    _wait(
        "step 6 on 3 slices", lambda: "step 6 committed on 3 slices" in _output(work, name, job), START_TIMEOUT_S, out
    )
    (task,) = [pid for pid, cmd in slurm_cluster.processes_of(job, "n3").items() if "slurm start" in cmd]
    try:
        os.kill(task, signal.SIGTERM)  # what a scheduler's warning to one node's task is
        _wait("the job on 2 slices", lambda: "on 2 slices" in _output(work, name, job), 60, out)
        slurm.run("scontrol", "update", "nodename=n2", "state=drain", "reason=elastic-test-drain")

        def back_to_3() -> bool:
            text = _output(work, name, job)
            return text.count("left_on_notice") == 2 and text.rfind("on 3 slices") > text.rfind("on 2 slices")

        _wait("the job back on 3 slices", back_to_3, END_TIMEOUT_S, out)
        slurm.run("scancel", "--batch", "--signal=TERM", job)  # the time limit's warning
        _wait("the stopped job's end", lambda: _ended(slurm, job), 120, out)
    finally:
        slurm.run("scontrol", "update", "nodename=n2", "state=resume")
    text = _output(work, name, job)
    info = slurm.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-6000:])
    report = _report(text)
    assert (report["notices"], report["recoveries"], report["planned_shrinks"]) == (2, 0, 2), report
    assert list(report["leaving_exit_codes"].values()) == [0, 0], report
    assert [d["source"] for d in report["notice_details"]] == ["ray_drain", "ray_drain"], report["notice_details"]
    assert all(d["planned"] for d in report["notice_details"]), report["notice_details"]
    for what, node in (("slurm_drain_forwarded", "n2"), ("slurm_leave_forwarded", "n3")):
        lines = [line for line in text.splitlines() if what in line]
        assert len(lines) == 1 and f"node={node}" in lines[0], (what, lines)
    assert "slurm_node_leaving" in text and "slurm_stop_requested" in text and "slurm_stop_forwarded" in text
    assert report["min_slices_seen"] in (1, 2) and report["grows"] >= 1 and report["slices_final"] == 3, report
    at = report["stopped"]["at_step"]
    assert report["stopped"]["persisted_step"] == at and at < 80, report
    assert report["steps_committed"] == at and report["steps_recomputed"] == 0, report
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0, report
    assert report["max_abs_param_diff_vs_reference"] <= 1e-4, report  # a failure-free run of as many steps
    joins = slurm.jobs_named(f"{name}-join")
    assert len(joins) == 2 and sorted(j["NodeList"] for j in joins) == ["n4", "n5"], joins

    # submitted at once (Slurm starts it on nodes as they come free), unpaced: the rest of the run at full speed
    again = _submit(slurm, work, short_tmp, name, 3, *steps)
    out2 = lambda: _output(work, name, again) + slurm.log()  # noqa: E731
    _wait("the resubmitted job's end", lambda: _ended(slurm, again), START_TIMEOUT_S + 60, out2)
    text = _output(work, name, again)
    assert slurm.job(again)["ExitCode"] == "0:0", (slurm.job(again), text[-6000:])
    report = _report(text)
    assert report["resumed_from_tier"] == "persistent" and report["stopped"] is None, report
    assert report["restores"][0]["step"] == at and report["restores"][0]["tier"] == "persistent", report
    assert f"step {at - 1} committed" not in text and f"step {at} committed" in text, text[-3000:]
    assert report["steps_committed"] == 80 and report["steps_recomputed"] == 0, report
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0, report
    assert report["max_abs_param_diff_vs_reference"] <= 1e-4, report
    for j in joins:  # they stopped when the first run ended
        assert _ended(slurm, j["JobId"]) and slurm.job(j["JobId"])["ExitCode"] == "0:0", slurm.job(j["JobId"])
    gone = lambda: not (slurm_cluster.processes_of(job) or slurm_cluster.processes_of(again))  # noqa: E731
    _wait("end of the runs' processes", gone, 60, out2)


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
