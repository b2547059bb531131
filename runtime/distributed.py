"""The seam around ``jax.distributed`` for multi-controller jobs: one coordination service per group, hosted
outside the workers, and workers that join, leave and re-form in place.

A multi-controller job runs one process per slice, joined by ``jax.distributed``. Two facts shape this module
(measured with jax 0.10.2 on CPU, see ``FACTS.md``):

- The process that hosts the coordination service must outlive every worker: if it dies, the service aborts
  every other process. ``jax.distributed.initialize(process_id=0)`` hosts it in worker 0, so workers here never
  start it. :class:`CoordinationService` hosts it in the calling process (the job's driver), through the
  private ``jaxlib._jax.get_distributed_runtime_service`` (pinned by ``tests/integration/test_multi_controller.py``).
  A group has a fixed size, so every re-formation gets a new service on a new port.
- A collective whose peer was SIGKILLed raises (gloo: "Timed out waiting" after
  ``--xla_cpu_collective_timeout_seconds``, or "Connection reset by peer") instead of hanging; the survivors
  then :func:`leave` (client shutdown, backends cleared) and :func:`join` the next group, in the same process.

:func:`join` is the client half of ``jax.distributed.initialize``: it connects to the service and fills
``jax._src.distributed.global_state`` the way ``initialize`` does, without starting a service and without the
preemption sync manager (whose SIGTERM handler would keep a worker stuck in a collective alive: stop workers
with SIGKILL / ``ray.kill``).

What would differ off CPU: on GPU the collectives are NCCL (set ``NCCL_TIMEOUT``-like bounds; a NCCL
communicator broken by a dead peer must be aborted, and ``clear_backends`` re-creates the CUDA client, which
costs seconds); on TPU without Pathways a lost host takes its slice with it and the ICI topology fixes which
subsets can form a mesh. Only this module and :func:`is_peer_loss`'s patterns know such things.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.backend

from .classify import FailureKind, classify_failure

__all__ = [
    "CoordinationService",
    "collective_env",
    "disconnect",
    "free_port",
    "is_peer_loss",
    "join",
    "joined",
    "leave",
    "reform",
    "setup_process",
]

# Errors a gloo collective raises when a peer process went away (its socket broke, or it stopped answering).
_PEER_LOSS = re.compile(
    r"(gloo .*(failed|timed out)|timed out waiting \d+ ?ms|connection reset by peer|connection refused"
    r"|broken pipe|connection closed by peer|socket closed)",
    re.IGNORECASE,
)


def collective_env(devices_per_process: int, *, collective_timeout_s: int = 5) -> dict[str, str]:
    """The environment a worker process needs before jax starts: its CPU devices, and collectives that fail
    within ``collective_timeout_s`` when a peer is gone instead of hanging."""
    return {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process} "
        f"--xla_cpu_collective_timeout_seconds={collective_timeout_s}",
        "JAX_PLATFORMS": "cpu",
    }


def setup_process(env: dict[str, str]) -> None:
    """Apply ``env`` (see :func:`collective_env`) to this process before its jax backend starts: XLA reads its
    flags when the backend is created, and ``JAX_PLATFORMS`` is passed on to jax's config, which read the variable
    at import. So a process that imported jax already (a reused Ray worker) is set up all the same, without a
    fresh process per environment. Raises ``RuntimeError`` when the backend exists already (too late)."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "this process's jax backend started before its environment was set up: run the worker "
            "in a fresh process (its devices and collective timeout come from XLA_FLAGS)"
        )
    os.environ.update(env)
    if "JAX_PLATFORMS" in env:
        jax.config.update("jax_platforms", env["JAX_PLATFORMS"])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class CoordinationService:
    """The coordination service of one group of ``num_processes`` workers, hosted in this process."""

    def __init__(
        self,
        num_processes: int,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        heartbeat_timeout_s: int = 30,
        shutdown_timeout_s: int = 5,
    ) -> None:
        from jax._src.lib import _jax  # private: the function jax.distributed.initialize calls for process 0

        if num_processes < 1:
            raise ValueError(f"a group needs at least one process, got {num_processes}")
        self.num_processes = num_processes
        self.port = port or free_port(host)
        self.address = f"{host}:{self.port}"
        self._service = _jax.get_distributed_runtime_service(
            f"[::]:{self.port}",
            num_processes,
            heartbeat_timeout=heartbeat_timeout_s,
            shutdown_timeout=shutdown_timeout_s,
            recoverable=True,
        )

    def stop(self) -> None:
        if self._service is not None:
            self._service.shutdown()
            self._service = None

    @property
    def running(self) -> bool:
        return self._service is not None


def _state() -> Any:  # jax's private State object
    from jax._src import distributed

    return distributed.global_state


def joined() -> bool:
    """Whether this process is in a group (its backend is the group's: see :func:`leave`)."""
    return _state().client is not None or _in_group[0]


_in_group = [False]  # a group's backend lives here (after disconnect(), until leave())


def join(
    address: str, num_processes: int, process_id: int, *, timeout_s: int = 60, heartbeat_timeout_s: int = 10
) -> None:
    """Connect this process to the group served at ``address`` as ``process_id`` of ``num_processes``.

    Must run before this process's backend starts (or after :func:`leave`). Raises if already joined.

    A rendezvous that fails (a member never came) raises here, in Python: jax's default handler for the client's
    errors would abort the process, so a handler of ours is installed. Once joined, though, the process lives and
    dies with the group's service: when the service is gone for ``heartbeat_timeout_s`` (its host, the job's
    driver, died), the client reports it through that handler with a status that has no Python conversion, and
    the process aborts (``std::bad_cast``; measured with jax 0.10.2). That is what a worker should do when its
    driver is gone; a driver stops a service only once every member has left it."""
    from jax._src.lib import _jax

    state = _state()
    if state.client is not None:
        raise RuntimeError("this process already joined a group: leave() first")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} not in 0..{num_processes - 1}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    client = _jax.get_distributed_runtime_client(
        address,
        process_id,
        init_timeout=timeout_s,
        use_compression=True,
        heartbeat_timeout=heartbeat_timeout_s,
        missed_heartbeat_callback=_client_error,
    )
    client.connect()
    state.coordinator_address = address
    state.process_id = process_id
    state.num_processes = num_processes
    state.partition_index = None
    state.client = client


def _client_error(*status: object) -> None:
    """The client's error handler (see :func:`join`): reached only for errors after the rendezvous."""


LEAVE_TIMES: dict[str, float] = {}  # the last leave's phases (seconds): backend, caches, gc, client


def disconnect() -> None:
    """Shut this process's coordination client down but keep its backend: a thread still waiting on the group
    (an Orbax save at a barrier with members that are gone) fails now instead of at its timeout, while the
    backend it may still query stays. :func:`leave` then drops the backend. Bounded by the shutdown timeout."""
    state = _state()
    client, state.client = state.client, None
    if client is not None:
        try:
            client.shutdown()
        except Exception:  # noqa: BLE001 - a broken group cannot shut down cleanly; its service goes anyway
            pass


def leave() -> float:
    """Leave the current group (bounded by the client's shutdown timeout) and drop this process's backends and
    compiled executables, so that the next :func:`join` builds them for the new group. Seconds it took."""
    start = time.monotonic()
    state = _state()
    client, state.client = state.client, None
    # The backend first: once nothing else holds it (the caller dropped its arrays), it is destroyed here and its
    # collectives' sockets close, which makes peers still waiting on this process fail at once.
    jax.extend.backend.clear_backends()
    LEAVE_TIMES["backend"] = time.monotonic() - start
    jax.clear_caches()
    LEAVE_TIMES["caches"] = time.monotonic() - start - LEAVE_TIMES["backend"]
    gc.collect()
    LEAVE_TIMES["gc"] = time.monotonic() - start - LEAVE_TIMES["backend"] - LEAVE_TIMES["caches"]
    if client is not None:
        try:
            client.shutdown()
        except Exception:  # noqa: BLE001 - a broken group cannot shut down cleanly; its service goes anyway
            pass
    LEAVE_TIMES["client"] = time.monotonic() - start - sum(LEAVE_TIMES[k] for k in ("backend", "caches", "gc"))
    state.process_id, state.num_processes = 0, 1
    _in_group[0] = False
    return time.monotonic() - start


def reform(
    address: str,
    num_processes: int,
    process_id: int,
    *,
    timeout_s: int = 60,
    phases: dict[str, float] | None = None,
    on_joined: Callable[[], None] | None = None,
) -> float:
    """Leave the current group (if any) and join a new one, in this process; seconds it took (until the new
    group's devices are visible). ``phases`` (if given) receives ``leave``, ``join`` and ``backend`` seconds;
    ``on_joined`` is called between the rendezvous and the backend's start.

    The backend's start exchanges the members' topologies through the service and waits for every member's
    (jax's own bound: minutes). A member that died after the rendezvous leaves the others waiting there until
    :func:`disconnect` is called from another thread: then this raises, and so does any failure of the start,
    with this process left as after :func:`leave` (no client, no backend), ready for the next group."""
    start = time.monotonic()
    times = phases if phases is not None else {}
    if joined():
        leave()
    times["leave"] = time.monotonic() - start
    join(address, num_processes, process_id, timeout_s=timeout_s)
    times["join"] = time.monotonic() - start - times["leave"]
    try:
        if on_joined is not None:
            on_joined()
        jax.devices()  # the backend starts here: its rendezvous waits for the whole group
    except BaseException:
        leave()  # the failed start's client (if not disconnected already) and its cached failure go
        raise
    _in_group[0] = True
    _write_own_cache_entries()
    times["backend"] = time.monotonic() - start - times["leave"] - times["join"]
    return time.monotonic() - start


def _write_own_cache_entries() -> None:
    """On CPU, let every process of the group write JAX's persistent compilation cache, not process 0 only.

    JAX writes the cache from process 0 alone, assuming every process computes the same key. On CPU the key
    differs by process (the compile options and the topology fingerprint carry the process index; measured with
    jax 0.10.2), so processes 1..n-1 would never find an entry and compile every time, standby compiles
    included. Each process writes its own key (no contention), once its backend exists (the process id named the
    backend's node; nothing else of jax's reads it afterwards but the cache writer). On GPU the keys are shared
    (jax strips the device assignment there), so process 0's entry serves every process, as jax intends.
    """
    if jax.default_backend() == "cpu":
        _state().process_id = 0


def is_peer_loss(err: BaseException) -> bool:
    """Whether ``err`` (or an error in its cause/context chain) means a peer process of the group is gone:
    ``runtime.classify``'s slice-loss codes, or a collective broken by a dead peer (gloo reports those as
    UNKNOWN, which ``classify_failure`` rightly leaves alone in a single-controller job)."""
    if classify_failure(err) is FailureKind.SLICE_LOSS:
        return True
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jax.errors.JaxRuntimeError) and _PEER_LOSS.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False
