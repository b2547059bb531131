"""The job's actors leave Ray's worker niceness (15) for an ordinary process's (0), every thread of them, and say so
when the host does not allow it. Run in child processes: this test process keeps its own priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import json, os, sys, threading
from elastic import priority
from elastic.log import configure_logging

configure_logging()

def threads():
    return sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))

stop = threading.Event()
early = threading.Thread(target=stop.wait, daemon=True)
early.start()  # a thread older than the call, as Ray's are
priority.set_niceness(priority.BACKGROUND)  # where Ray starts its workers
before = threads()
if sys.argv[1] == "unprivileged":
    os.setuid(65534)  # nobody: no CAP_SYS_NICE, RLIMIT_NICE 0
now = priority.normal("worker", job="j", slice=3)
late = threading.Thread(target=stop.wait, daemon=True)
late.start()  # a thread started after the call inherits it
after = threads()
down = priority.background()
print(json.dumps({"before": before, "now": now, "after": after, "background": down, "end": threads()}))
"""


def _run(mode: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread niceness is Linux's")
@pytest.mark.skipif(os.geteuid() != 0, reason="raising priority needs CAP_SYS_NICE (root here)")
def test_every_thread_leaves_rays_niceness_and_a_helper_goes_back_below() -> None:
    got, _ = _run("privileged")
    assert set(got["before"]) == {15}
    assert got["now"] == 0 and set(got["after"]) == {0}  # the older thread and the newer one too
    assert got["background"] == 15 and set(got["end"]) == {15}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread niceness is Linux's")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to an unprivileged user")
def test_without_the_right_the_actor_carries_on_and_says_how_to_start_ray() -> None:
    got, err = _run("unprivileged")
    assert got["now"] == 15 and set(got["after"]) == {15}  # where Ray put it, and still running
    assert "niceness_kept" in err and "RAY_worker_niceness=0" in err and "role=worker" in err
