"""A real Slurm cluster on this machine for the integration tests: one ``munged``, one ``slurmctld`` and a
``slurmd`` per node (``NodeName=n[1-6] NodeHostname=localhost NodeAddr=127.0.0.1``), each with its own port,
spool and pid file under a temp dir of the cluster's own, with a munge socket and key of its own: nothing is
shared with another Slurm on the machine. Debian's ``slurm-wlm`` and ``munge`` are installed with ``apt-get``
when missing and the tests run as root; otherwise :func:`unavailable` says why, in one line, and they skip.

Four nodes hold the job; the other two are the spares one-node join jobs land on once a node is down or left
(``ReturnToService=1``: a node set down by the test stays down).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "squeue", "scontrol", "scancel")
INSTALL_TIMEOUT_S = 420
READY_TIMEOUT_S = 90
RESTART_AFTER_S = 30
NODES = 6

CONF = """\
ClusterName=elastictest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/linear
MpiDefault=none
ReturnToService=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
KillWait=5
MinJobAge=900
SlurmdTimeout=30
NodeName=n[1-{nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 Port={first}-{last} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-{nodes}] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Slurm:
    dir: Path
    env: dict[str, str]  # SLURM_CONF for the client commands
    procs: list[int] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict ({} once Slurm forgot it)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def jobs_named(self, name: str) -> list[dict[str, str]]:
        out = self.run("scontrol", "-o", "show", "job", check=False)
        rows = [dict(w.split("=", 1) for w in line.split() if "=" in w) for line in out.splitlines()]
        return [r for r in rows if r.get("JobName") == name]

    def log(self) -> str:
        try:
            return (self.dir / "slurmctld.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def unavailable() -> str | None:
    """Why a real Slurm cannot run here (None: it can; installs the packages as root when missing)."""
    if not os.path.isdir("/proc") or not hasattr(os, "geteuid"):
        return "a real Slurm needs Linux"
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in BINARIES):
        return None
    if os.geteuid() != 0:
        return f"Slurm is not installed and the tests do not run as root (apt-get install {' '.join(PACKAGES)})"
    if not shutil.which("apt-get"):
        return f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        left = max(1.0, deadline - time.monotonic())
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return None


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(count: int) -> int:
    """The first of ``count`` consecutive free ports."""
    for _ in range(200):
        base = random.randint(20000, 40000)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def start() -> Slurm:
    """Start the cluster and wait (bounded) until every node is idle; :func:`stop` it after."""
    d = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    first = _ports(NODES + 1)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(dir=d, ctld_port=first + NODES, nodes=NODES, first=first, last=first + NODES - 1))
    slurm = Slurm(dir=d, env={**os.environ, "SLURM_CONF": str(conf)})
    subprocess.run([_sbin("mungekey"), "--create", f"--keyfile={d}/munge.key"], check=True, timeout=30)
    munge = [_sbin("munged"), f"--socket={d}/munge.sock", f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid"]
    munge += [f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed", "--force"]
    try:
        subprocess.run(munge, check=True, timeout=30)
        subprocess.run([_sbin("slurmctld"), "-f", str(conf)], check=True, timeout=30, env=slurm.env)
        for i in range(1, NODES + 1):
            _start_slurmd(slurm, conf, f"n{i}")
        started = time.monotonic()
        restart_at = started + RESTART_AFTER_S  # a node not idle by then has its slurmd started again, once
        while True:
            rows = slurm.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).splitlines()
            states = dict(row.split(None, 1) for row in rows if len(row.split()) == 2)
            late = sorted(n for n, state in states.items() if state != "idle")
            if len(states) == NODES and not late:
                return slurm
            if restart_at is not None and time.monotonic() > restart_at:
                restart_at = None
                for node in late:  # on a loaded machine a first slurmd can miss its registration, or die
                    _stop_pid(_pid(slurm.dir / f"slurmd.{node}.pid"))
                    _start_slurmd(slurm, conf, node)
            if time.monotonic() > started + READY_TIMEOUT_S:
                logs = "\n".join(f"--- slurmd {n}:\n{_tail(slurm.dir / f'slurmd.{n}.log')}" for n in late)
                raise RuntimeError(
                    f"Slurm nodes not idle within {READY_TIMEOUT_S}s (their slurmd started again once): {states}\n"
                    f"{slurm.log()}\n{logs}"
                )
            time.sleep(0.25)
    except BaseException:
        stop(slurm)
        raise


def _start_slurmd(slurm: Slurm, conf: Path, node: str) -> None:
    subprocess.run([_sbin("slurmd"), "-f", str(conf), "-N", node], check=True, timeout=30, env=slurm.env)


def _stop_pid(pid: int | None, bound_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL past ``bound_s``; nothing if there is no such process."""
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + bound_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop(slurm: Slurm) -> None:
    """Cancel every job, stop the daemons (by their pid files), remove the cluster's dir."""
    slurm.run("scancel", "--full", "--user", "root", check=False)
    deadline = time.monotonic() + 30
    while slurm.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    pids = [_pid(slurm.dir / f"slurmd.n{i}.pid") for i in range(1, NODES + 1)]
    pids += [_pid(slurm.dir / "slurmctld.pid"), _pid(slurm.dir / "munged.pid")]
    for pid in pids:
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
    deadline = time.monotonic() + 15
    for pid in pids:
        while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid and Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(slurm.dir, ignore_errors=True)


def processes_of(job_id: str, node: str | None = None) -> dict[int, str]:
    """Live processes of a Slurm job (``SLURM_JOB_ID`` in their environment), on one node if named."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == job_id and (node is None or env.get("SLURMD_NODENAME") == node):
            found[int(entry)] = cmd
    return found
