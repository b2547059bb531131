"""Reap an embedded Ray cluster whose client died: ``python -m elastic.control.reaper --pid P --session-dir D``.

Contract. ``elastic.control.cluster.connect`` starts one reaper (in its own session, so a signal to the client's
process group spares it) for each embedded cluster it starts. The reaper polls every ``POLL_S`` seconds:

* when client ``P`` is gone (exited, SIGKILLed, or a zombie; a reused pid is told apart by its start
  time), it ends every process of Ray session ``D`` (SIGTERM, then SIGKILL after ``GRACE_S``) and exits;
* when the session's core processes (those with ``D`` in their command line: gcs_server, raylet, ...)
  are gone while the client lives (the client called ``ray.shutdown()``), it ends any stragglers the
  same way and exits.

A process belongs to the session when ``D`` is in its command line, when it is a ``ray::...`` process
(Ray's workers and agents rename themselves so) holding a file under ``D`` open (their logs), or when it
descends from such a process (remembered while alive, so one orphaned by a raylet's death is still
found). Only the reaper's own user's processes are looked at; it never ends itself nor the client.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0
_ATTRS = ["pid", "ppid", "cmdline", "create_time", "uids"]


def _alive(proc: psutil.Process) -> bool:
    """True while ``proc`` (the same process: pid and start time) runs and is not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _naming(session_dir: str) -> re.Pattern[str]:
    """Matches ``session_dir`` itself or a path under it (not a sibling whose name merely starts the same)."""
    return re.compile(re.escape(session_dir.rstrip("/")) + r"(?![\w.-])")


def _holds_file_under(pid: int, naming: re.Pattern[str]) -> bool:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if naming.match(os.readlink(f"/proc/{pid}/fd/{fd}")):
                return True
    except OSError:
        pass
    return False


def session_processes(
    session_dir: str,
    known: dict[int, psutil.Process] | None = None,
    *,
    open_files: bool = True,
    spare: int | None = None,
) -> dict[int, psutil.Process]:
    """The live processes of the Ray session in ``session_dir`` (see the module's docstring), by pid; never
    this process nor ``spare`` (the client: a driver holds files under the session dir open too)."""
    naming = _naming(session_dir)
    uid, me = os.getuid(), os.getpid()
    known = {pid: p for pid, p in (known or {}).items() if pid != spare}
    found: dict[int, psutil.Process] = {pid: p for pid, p in (known or {}).items() if _alive(p)}
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(_ATTRS):
        info = proc.info
        if info["pid"] in (me, spare) or (info["uids"] is not None and info["uids"].real != uid):
            continue
        children.setdefault(info["ppid"], []).append(proc)
        cmdline = " ".join(info["cmdline"] or [])
        if naming.search(cmdline) or (
            open_files and cmdline.startswith("ray::") and _holds_file_under(info["pid"], naming)
        ):
            found.setdefault(info["pid"], proc)
    stack = list(found)
    while stack:  # and their descendants
        for child in children.get(stack.pop(), []):
            if child.pid not in found and child.pid not in (me, spare):
                found[child.pid] = child
                stack.append(child.pid)
    return {pid: p for pid, p in found.items() if _alive(p)}


def reap(
    session_dir: str, known: dict[int, psutil.Process] | None = None, rounds: int = 3, spare: int | None = None
) -> int:
    """End every process of the session (SIGTERM, SIGKILL after ``GRACE_S``); return how many were found."""
    total = 0
    for _ in range(rounds):  # again: a raylet may start a worker while it is being ended
        procs = list(session_processes(session_dir, known, spare=spare).values())
        if not procs:
            break
        total += len(procs)
        for proc in procs:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=GRACE_S)
        known = None
    return total


def watch(client_pid: int, session_dir: str, poll_s: float = POLL_S) -> None:
    """Wait until the client is gone or the session ended by itself, then reap the session's remains."""
    try:
        client = psutil.Process(client_pid)
    except psutil.NoSuchProcess:
        reap(session_dir, spare=client_pid)
        return
    naming = _naming(session_dir)
    known = session_processes(session_dir, open_files=False, spare=client_pid)
    ticks = 0
    while _alive(client):
        time.sleep(poll_s)
        ticks += 1
        if ticks % 4 == 0:  # every ~2 s: remember new workers, notice a normal shutdown
            known = session_processes(session_dir, known, open_files=False, spare=client_pid)
            core = [p for p in known.values() if naming.search(" ".join(_cmdline(p)))]
            if not core:
                break
    reap(session_dir, known, spare=client_pid)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic.control.reaper", description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True, help="the client process to watch")
    parser.add_argument("--session-dir", required=True, help="the Ray session directory of its embedded cluster")
    args = parser.parse_args(argv)
    watch(args.pid, os.path.abspath(args.session_dir))


if __name__ == "__main__":
    main()
