"""What runs on each Slurm node (``elastic slurm start``) and in the batch step (``elastic slurm run``).

``run`` starts one task per node with ``srun --no-kill``; each task's ``start`` starts the node's Ray node. On
the allocation's first node the Ray head starts, its address going to the job dir as it starts (the other nodes
start theirs meanwhile, and join once it answers), and once every node of the allocation has joined, the entry
point runs there as a Ray driver (``RAY_ADDRESS`` set: the job joins this cluster), its output in Slurm's. While it
runs the head follows the job's node count and, as :class:`~elastic.ops.slurm.regrow.RegrowPolicy` says, submits
one-node jobs that join the cluster (``start --join``) to replace lost nodes. When it ends the head writes its exit
status to the job dir, and every node (joined ones too) stops its Ray node and ends; at once (SIGKILL), as nothing
of the job is left to save, where Ray's own graceful stop takes up to 20 s of a busy host. ``run`` exits with the
entry point's status.

SIGTERM, the first one (a second ends a task at once, its Ray node stopped hard):

- to the batch step (``--signal=B:TERM@secs``: the time limit comes): ``run`` asks the head to stop the job; the
  head sends SIGTERM to the entry point, which saves to the persistent tier at the next step boundary and ends
  (``ElasticJob(stop_signal="SIGTERM")``);
- to a node's task: the node asks the head to drain its Ray node, by ``--drain-deadline`` (a notice: its slice
  leaves at a step boundary), and stops once its Ray node has ended (drained and idle) or the deadline has passed;
- to the head's task: the head's node cannot leave (it runs the driver and the Ray head): the job stops, as above,
  the head passing its SIGTERM on to the entry point from the handler;
- to every task and the batch step at once (``scancel``): the job stops, as above; once it stops the head takes no
  node's request to leave and submits no join job (the nodes are ending with the job, not leaving it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic.errors import ClusterError
from elastic.log import get_logger
from elastic.ops.slurm.allocation import JobDir, SlurmNode, node_address
from elastic.ops.slurm.drains import SlurmDrains
from elastic.ops.slurm.node import HOST_RESOURCE, RayNode, host_resources, ray_env
from elastic.ops.slurm.regrow import Hold, RegrowPolicy, decide_regrow, queued_joins, submit_join

__all__ = ["run_allocation", "start_node"]

POLL_S = 1.0
DRAIN_POLL_S = 2.0  # how often the head asks Slurm which nodes are drained or down
START_ATTEMPTS = 3
log = get_logger("elastic.ops.slurm")


def _temp_dir(node: SlurmNode, joined: bool) -> Path:
    # Short: Ray's unix sockets live under it (107 bytes at most).
    return Path(tempfile.gettempdir()) / f"ej{node.job_id}{'j' if joined else ''}-{node.node_name}"


class _Signals:
    """SIGTERM to this task: the first is recorded (a request to leave or to stop, acted on by the task's loop) and,
    once :meth:`forward_to` named a process, passed on to it at once; a second unwinds at once (Slurm SIGKILLs what
    is left after its ``KillWait``)."""

    def __init__(self) -> None:
        self.count = 0
        self.forwarded = False
        self._to: subprocess.Popen[Any] | None = None
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1:
            raise SystemExit(128 + signum)
        if self._to is not None:
            self.forward()

    def forward_to(self, proc: subprocess.Popen[Any]) -> None:
        """Pass a SIGTERM to this task on to ``proc`` (the entry point) from the handler itself: when Slurm signals
        every process of the task (``scancel``), the entry point has its own copy too, and two copies that close
        together are one request to it (:mod:`elastic.control.stop_signal`), where one forwarded a poll later
        would end it at once."""
        self._to = proc
        if self.count:
            self.forward()

    def forward(self) -> None:
        """SIGTERM to the process named by :meth:`forward_to`, once."""
        if self._to is not None and not self.forwarded:
            self.forwarded = True
            if self._to.poll() is None:
                self._to.send_signal(signal.SIGTERM)

    @property
    def hard(self) -> bool:
        """Stop the Ray node hard: Slurm is ending the task (a process whose parent died first is no longer its)."""
        return self.count > 1


def run_allocation(job_dir: JobDir, cmd: Sequence[str], start_args: Sequence[str]) -> int:
    """In the batch step: one ``start`` task per node, then the entry point's exit status."""
    node = SlurmNode.from_env()
    job_dir.create()
    job_dir.clear_done(node.job_id)
    srun = ["srun", "--no-kill", "--kill-on-bad-exit=0", "--ntasks-per-node=1", f"--nodes={node.num_nodes}"]
    start = [sys.executable, "-m", "elastic.cli", "slurm", "start", "--dir", str(job_dir.path.parent)]
    start += ["--job", job_dir.job_name, *start_args, "--", *cmd]
    signals = _Signals()  # --signal=B:TERM@secs reaches this process alone: the job saves and stops
    proc = subprocess.Popen([*srun, *start])
    asked = False
    while (code := _wait(proc, POLL_S)) is None:
        if signals.count and not asked:
            asked = True
            job_dir.request_stop(node.job_id, "SIGTERM to the batch step")
            log.warning("slurm_stop_requested", job=job_dir.job_name, slurm_job=node.job_id)
    found = job_dir.exit_code(node.job_id)
    return found if found is not None else (code or 1)


def _wait(proc: subprocess.Popen[Any], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def start_node(job_dir: JobDir, *, join: bool, cmd: Sequence[str], options: dict[str, Any]) -> int:
    """This node's part: the head (the allocation's first node), or a node of the job's cluster."""
    node = SlurmNode.from_env()
    job_dir.create()
    ip = node_address(node.node_name)
    bound = log.bind(job=job_dir.job_name, slurm_job=node.job_id, node=node.node_name)
    signals = _Signals()
    if join or node.node_index > 0:
        head = job_dir.wait_head(slurm_job_id=None if join else node.job_id, timeout_s=options["head_timeout_s"])
        leave_by: float | None = None  # the deadline this node asked to leave by (SIGTERM to its task)
        for attempt in range(1, START_ATTEMPTS + 1):  # a Ray node that fails to start (a busy head) starts again
            if signals.count:
                break
            found = job_dir.head()  # the head's newest start: one that failed starts again on other ports
            if found is not None and found.get("slurm_job_id") == head["slurm_job_id"]:
                head = found
            ray_node = RayNode(
                ip=ip,
                temp_dir=_temp_dir(node, join),
                env=ray_env(job_dir.token_path),
                resources=host_resources(node.node_name, node.job_id),
                head_address=head["address"],
                object_store_memory=options.get("object_store_memory"),
                log_path=job_dir.path / f"ray-{node.job_id}-{node.node_name}.log",
            )
            bound.info("slurm_node_started", head=head["address"], joined=join, attempt=attempt)
            try:
                while ray_node.alive() and job_dir.exit_code(head["slurm_job_id"]) is None:
                    if signals.count and leave_by is None:  # a notice for this node's slice, then stop
                        leave_by = time.time() + options.get("drain_deadline_s", 60.0)
                        job_dir.request_leave(node.node_name, leave_by, f"SIGTERM to the task on {node.node_name}")
                        bound.warning("slurm_node_leaving", deadline_s=options.get("drain_deadline_s", 60.0))
                    if leave_by is not None and time.time() > leave_by:
                        bound.warning("slurm_node_leave_deadline_passed")
                        break
                    time.sleep(POLL_S / 2)
            finally:
                # the job has ended: nothing of it is left on this node to save (a node that leaves stops gracefully)
                ray_node.stop(hard=signals.hard or job_dir.exit_code(head["slurm_job_id"]) is not None)
            if leave_by is not None or job_dir.exit_code(head["slurm_job_id"]) is not None:
                break
            bound.warning("slurm_node_exited", attempt=attempt, log=ray_node.log_tail(400))
        bound.info("slurm_node_stopped")
        return 0
    if cmd == []:
        raise ClusterError("the head needs an entry point: elastic slurm start ... -- python train.py")
    token = job_dir.new_token()
    job_dir.take_leaves()  # a previous run's requests
    for attempt in range(1, START_ATTEMPTS + 1):  # ray start gives its raylet 30 s to register: a busy host needs more
        head_node = RayNode(
            ip=ip,
            temp_dir=_temp_dir(node, False),
            env=ray_env(token),
            resources=host_resources(node.node_name, node.job_id),
            object_store_memory=options.get("object_store_memory"),
            log_path=job_dir.path / f"ray-{node.job_id}-{node.node_name}.log",
        )
        # its address is known before it runs: the other nodes start their Ray nodes now, in parallel with it, and
        # connect once its GCS answers (Ray tries for 20 s; a node whose `ray start` gives up starts again)
        job_dir.write_head(address=head_node.address, slurm_job_id=node.job_id, num_nodes=node.num_nodes)
        try:
            head_node.wait_started(options["head_timeout_s"])
            break
        except ClusterError as err:
            head_node.stop(hard=True)
            if attempt == START_ATTEMPTS or signals.count:
                job_dir.mark_done(node.job_id, 1)
                raise
            bound.warning("slurm_head_exited", attempt=attempt, error=str(err)[-400:])
    code = 1
    try:
        bound.info("slurm_head_started", address=head_node.address, nodes=node.num_nodes)
        code = _drive(job_dir, node, head_node, cmd, options, bound, signals)
    finally:
        job_dir.mark_done(node.job_id, code)
        head_node.stop(hard=True)  # the entry point has ended (or never started): nothing of the job is left
        bound.info("slurm_head_stopped", exit_code=code)
    return code


def _drive(
    job_dir: JobDir,
    node: SlurmNode,
    head: RayNode,
    cmd: Sequence[str],
    options: dict[str, Any],
    bound: Any,
    signals: _Signals,
) -> int:
    # before ray's import, which reads RAY_AUTH_MODE
    os.environ.update({k: v for k, v in ray_env(job_dir.token_path, {}).items() if k.startswith("RAY_")})
    import ray

    deadline = time.monotonic() + options["nodes_timeout_s"]
    while True:  # a busy head answers late: ray.init gives up after its own retries
        try:
            ray.init(address=head.address, log_to_driver=False, configure_logging=False, namespace="elastic-slurm")
            break
        except ConnectionError as err:
            if time.monotonic() > deadline or not head.alive():
                raise ClusterError(f"cannot reach the job's Ray head at {head.address}: {err}") from err
            bound.warning("slurm_head_unreachable", error=str(err)[:200])
    try:
        _wait_nodes(node.num_nodes, deadline, head)
        bound.info("slurm_nodes_up", nodes=node.num_nodes)
        env = {
            **ray_env(job_dir.token_path),
            "RAY_ADDRESS": head.address,
            "ELASTIC_JOB_NAME": job_dir.job_name,
            "ELASTIC_SLURM_JOB_DIR": str(job_dir.path),
        }
        proc = subprocess.Popen(list(cmd), env=env)
        policy: RegrowPolicy = options["policy"]
        drains = SlurmDrains(head.address, node.node_name, options.get("drain_deadline_s", 60.0), bound)
        polled = 0.0
        submitted: list[str] = []
        below_since: float | None = None
        last = ""
        stopping = False
        signals.forward_to(proc)
        while proc.poll() is None:
            time.sleep(POLL_S)
            why = job_dir.stop_request(node.job_id) or ("SIGTERM to the head's task" if signals.count else None)
            if why and not stopping:  # the entry point saves to the persistent tier at a step boundary and ends
                stopping = True
                signals.forward()
                bound.warning("slurm_stop_forwarded", reason=why, pid=proc.pid)
                # the job is ending (the time limit, or `scancel`, whose SIGTERM reached every task: their requests
                # to leave are not notices, and a node's Ray node ending is no loss to replace)
                bound.info("slurm_regrow_hold", reason="the job is stopping: no node leaves, no join job")
            if stopping:
                continue
            alive, joined_jobs, nodes = _hosts(drains.down)
            drains.leave(nodes, job_dir.take_leaves())  # a node's task signalled: a notice for its slice
            now = time.monotonic()
            if now - polled >= DRAIN_POLL_S:  # a Slurm drain of a node: a Ray drain, which the job takes as a notice
                polled = now
                drains.poll(nodes)
                alive, joined_jobs, nodes = _hosts(drains.down)  # a node Slurm set down is lost: no Ray timeout
            below_since = (below_since or now) if alive < node.num_nodes else None
            queued = [j for j, _ in queued_joins(job_dir.job_name) if j not in joined_jobs] if below_since else []
            choice = decide_regrow(
                want=node.num_nodes,
                alive=alive,
                queued=len(queued),
                submitted=len(submitted),
                below_since=below_since,
                now=now,
                policy=policy,
            )
            if isinstance(choice, Hold):
                if choice.reason != last:  # once per change, not every poll
                    bound.info("slurm_regrow_hold", nodes=alive, reason=choice.reason)
                    last = choice.reason
                continue
            for _ in range(choice.count):
                job = submit_join(job_dir.job_name, str(job_dir.path.parent), start_args=options["start_args"])
                submitted.append(job)
                bound.info("slurm_join_submitted", join_job=job, nodes=alive, reason=choice.reason)
        return proc.returncode
    finally:
        ray.shutdown()


def _hosts(down: set[str] | frozenset[str] = frozenset()) -> tuple[int, set[str], dict[str, str]]:
    """The job's Ray nodes up (alive, not draining and not on a Slurm node in ``down``: such a node is as good as
    lost), the Slurm job ids they came from, and each alive one's Slurm node name -> Ray node id."""
    import ray

    from elastic.supervision.ray_internals import draining_nodes

    draining = set(draining_nodes())
    alive, jobs, names = 0, set(), {}
    for n in ray.nodes():
        res = n.get("Resources", {})
        if not (n.get("Alive") and res.get(HOST_RESOURCE)):
            continue
        named = {k.removeprefix("slurm_node_") for k in res if k.startswith("slurm_node_")}
        names.update({name: n["NodeID"] for name in named})
        if n["NodeID"] in draining or named & down:
            continue
        alive += 1
        jobs |= {k.removeprefix("slurm_job_") for k in res if k.startswith("slurm_job_")}
    return alive, jobs, names


def _wait_nodes(count: int, deadline: float, head: RayNode) -> None:
    while (have := _hosts()[0]) < count:
        if time.monotonic() > deadline:
            raise ClusterError(f"{have} of the allocation's {count} Ray nodes joined in time (--nodes-timeout)")
        if not head.alive():
            raise ClusterError(f"the Ray head exited:\n{head.log_tail()}")
        time.sleep(0.25)
