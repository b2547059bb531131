"""Ray connection: ``connect`` joins the cluster named by ``RAY_ADDRESS`` (as ``ray job submit`` sets for its entry
point) or starts an embedded one with ``ray.init(address="local")``, and a reaper that ends the embedded cluster's
processes if this process dies without ``ray.shutdown()``."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import ray

from elastic import quiet

__all__ = ["REAPERS", "connect", "workers_start_niced"]


_AT_NORMAL_PRIORITY: set[str] = set()  # the GCS addresses of the clusters connect started: workers at nice 0


def connect(address: str | None = None) -> bool:
    """Make sure this process is a Ray driver; True if this call started an embedded cluster."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    common: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    quiet.route_ray_loggers()
    if address and address != "auto" and "://" not in address.removeprefix("gcs://"):
        from elastic.control.reach import probe

        probe(address)  # a clear ClusterError within seconds, not ray.init's 20-40 s of retries
    with quiet.starting_ray():
        if address:
            ray.init(address=address, **common)
        else:
            # Ray's workers start at nice 15, below any busy neighbour: the job's processes start at 0 instead (on a
            # cluster of your own, start Ray with RAY_worker_niceness=0; see elastic.priority)
            context = ray.init(
                address="local", include_dashboard=False, _system_config={"worker_niceness": 0}, **common
            )
    quiet.route_ray_errors()
    if address:
        return False
    _AT_NORMAL_PRIORITY.add(context.address_info["gcs_address"])  # type: ignore[attr-defined]  # a RayContext
    _start_reaper(context.address_info["session_dir"])  # type: ignore[attr-defined]
    return True


def workers_start_niced() -> bool:
    """Whether the cluster this process drives may start its worker processes below an ordinary priority (Ray's
    nice 15): any cluster but an embedded one :func:`connect` started."""
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a Ray Client connection may not say: assume Ray's default
        return True
    return address not in _AT_NORMAL_PRIORITY


REAPERS: list[int] = []  # the pids of the reapers started here


def _start_reaper(session_dir: str) -> None:
    """Start ``elastic.control.reaper``: it ends the embedded cluster's processes if this process dies without
    ``ray.shutdown()`` (SIGKILL included), and exits by itself after a normal shutdown. Spawned with
    ``posix_spawn`` in its own session: no at-fork hook runs here, and no ``Popen`` is left to warn at exit."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    pid = os.posix_spawn(
        sys.executable,
        [sys.executable, "-m", "elastic.control.reaper", "--pid", str(os.getpid()), "--session-dir", session_dir],
        env,
        file_actions=devnull,
        setsid=True,
    )
    REAPERS.append(pid)
    threading.Thread(target=os.waitpid, args=(pid, 0), name="reaper-wait", daemon=True).start()  # no zombie
