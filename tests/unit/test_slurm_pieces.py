"""The Slurm side's pure pieces: when the job asks for a replacement node (a table), what a task reads of its
allocation, the job dir's records, and the sbatch template the package ships."""

from __future__ import annotations

import pytest

from elastic.errors import ClusterError, ConfigError
from elastic.ops.slurm.allocation import JobDir, SlurmNode
from elastic.ops.slurm.commands import template_text
from elastic.ops.slurm.node import ray_env
from elastic.ops.slurm.regrow import Hold, RegrowPolicy, Submit, decide_regrow

POLICY = RegrowPolicy(grace_s=5.0, max_joins=2)


@pytest.mark.parametrize(
    ("alive", "queued", "submitted", "below_since", "now", "want"),
    [
        (4, 0, 0, None, 100.0, Hold("every node is up")),
        (3, 0, 0, 98.0, 100.0, Hold("below 4 nodes for 2.0s of a 5s grace")),
        (3, 0, 0, 90.0, 100.0, Submit(1, "3 of 4 nodes up for 10.0s, 0 queued: ask for 1")),
        (3, 1, 1, 90.0, 100.0, Hold("1 join job(s) queued for 1 missing node(s)")),
        (2, 1, 1, 90.0, 100.0, Submit(1, "2 of 4 nodes up for 10.0s, 1 queued: ask for 1")),
        (1, 0, 0, 90.0, 100.0, Submit(2, "1 of 4 nodes up for 10.0s, 0 queued: ask for 2")),
        (3, 0, 2, 90.0, 100.0, Hold("2 join job(s) submitted already, the most the policy allows (2)")),
    ],
)
def test_decide_regrow(alive: int, queued: int, submitted: int, below_since: float | None, now: float, want) -> None:
    got = decide_regrow(
        want=4, alive=alive, queued=queued, submitted=submitted, below_since=below_since, now=now, policy=POLICY
    )
    assert got == want


def test_regrow_policy_says_what_to_fix() -> None:
    with pytest.raises(ConfigError, match="max_joins"):
        RegrowPolicy(max_joins=-1)
    with pytest.raises(ConfigError, match="grace_s"):
        RegrowPolicy(grace_s=float("nan"))


def test_slurm_node_from_env() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "4", "SLURMD_NODENAME": "n3"}
    node = SlurmNode.from_env({**env, "SLURM_JOB_NAME": "train", "SLURM_SUBMIT_DIR": "/work"})
    assert (node.job_id, node.job_name, node.node_name, node.node_index, node.num_nodes) == ("7", "train", "n3", 2, 4)
    with pytest.raises(ConfigError, match="not inside a Slurm allocation"):
        SlurmNode.from_env({"SLURMD_NODENAME": "n3"})


def test_job_dir_records(tmp_path) -> None:
    jd = JobDir(tmp_path, "train")
    jd.create()
    assert (jd.path.stat().st_mode & 0o777) == 0o700
    assert (jd.new_token().stat().st_mode & 0o777) == 0o600
    with pytest.raises(ClusterError, match="no running head"):
        jd.wait_head(slurm_job_id="5", timeout_s=0.0)
    jd.write_head(address="10.0.0.1:6379", slurm_job_id="5", num_nodes=4)
    assert jd.wait_head(slurm_job_id="5", timeout_s=0.0)["address"] == "10.0.0.1:6379"
    assert jd.wait_head(slurm_job_id=None, timeout_s=0.0)["num_nodes"] == 4
    assert jd.exit_code("5") is None
    jd.mark_done("5", 3)
    assert jd.exit_code("5") == 3
    with pytest.raises(ClusterError):  # a run that ended has no running head to join
        jd.wait_head(slurm_job_id=None, timeout_s=0.0)
    jd.clear_done("5")  # a requeued run (same job id) starts again
    assert jd.exit_code("5") is None
    with pytest.raises(ConfigError):
        JobDir(tmp_path, "a/b")


def test_ray_env_has_only_the_jobs_cluster(tmp_path) -> None:
    env = ray_env(tmp_path / "tok", {"RAY_ADDRESS": "elsewhere:1", "RAY_AUTH_TOKEN": "x", "HOME": "/h", "PATH": "/b"})
    assert "RAY_ADDRESS" not in env and "RAY_AUTH_TOKEN" not in env and env["HOME"] == "/h"
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "tok")


def test_the_template_keeps_the_job_when_a_node_fails() -> None:
    text = template_text()
    assert text.startswith("#!/bin/bash")
    for line in ("#SBATCH --no-kill", "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "elastic slurm run"):
        assert line in text
    assert "#SBATCH --signal=B:TERM@" in text  # the time limit's warning: the job saves and stops


def test_the_job_dirs_stop_and_leave_requests(tmp_path) -> None:
    job_dir = JobDir(tmp_path, "job")
    job_dir.create()
    assert job_dir.stop_request("7") is None and job_dir.take_leaves() == {}
    job_dir.request_stop("7", "SIGTERM to the batch step")
    job_dir.request_leave("n3", 123.5, "SIGTERM to the task on n3")
    assert job_dir.stop_request("7") == "SIGTERM to the batch step" and job_dir.stop_request("8") is None
    assert job_dir.take_leaves() == {"n3": (123.5, "SIGTERM to the task on n3")}
    assert job_dir.take_leaves() == {}  # each request is taken once
    job_dir.clear_done("7")  # a requeued run (same job id) starts with no stop asked
    assert job_dir.stop_request("7") is None


def test_drained_nodes_from_scontrol_with_their_reasons():
    from elastic.ops.slurm.drains import drained

    lines = [
        "NodeName=n1 Arch=x86_64 CoresPerSocket=1 State=MIXED ThreadsPerCore=1",
        "NodeName=n2 Arch=x86_64 State=MIXED+DRAIN ThreadsPerCore=1 Reason=disk failing [root@2026-12-07T05:00:00]",
        "NodeName=n3 Arch=x86_64 State=IDLE+DRAIN Reason=maintenance",
        "NodeName=n4 State=DOWN+NOT_RESPONDING Reason=elastic-test [root@2026-12-07T05:01:00]",
        "garbage",
    ]
    assert drained(lines) == {"n2": "disk failing", "n3": "maintenance"}
    assert drained([]) == {}


def test_down_nodes_from_scontrol() -> None:
    from elastic.ops.slurm.drains import down

    lines = [
        "NodeName=n1 State=MIXED ThreadsPerCore=1",
        "NodeName=n2 State=MIXED+DRAIN Reason=disk failing",
        "NodeName=n3 State=IDLE+POWERED_DOWN",
        "NodeName=n4 State=DOWN+NOT_RESPONDING Reason=elastic-test [root@2026-12-07T05:01:00]",
        "NodeName=n5 State=DOWN* Reason=Not responding",
        "NodeName=n6 State=FAIL Reason=bad",
    ]
    assert down(lines) == {"n4", "n5", "n6"} and down([]) == set()
