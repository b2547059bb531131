"""Test set-up: 8 forced CPU devices (set before jax is imported) and an embedded Ray for integration tests; the
helpers every test uses to wait (bounded, with a diagnostic), to draw a replayable random case, to run on a Ray
cluster of its own, and to count compilations."""

from __future__ import annotations

import os
import random
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
if "ELASTIC_HOME" not in os.environ:  # job tokens and run records of the tests stay out of the user's home
    import atexit
    import shutil
    import tempfile

    os.environ["ELASTIC_HOME"] = tempfile.mkdtemp(prefix="elastic-home-")  # pytest-xdist's workers inherit it
    atexit.register(shutil.rmtree, os.environ["ELASTIC_HOME"], ignore_errors=True)  # gone with the session

import pytest

T = TypeVar("T")
SEED_ENV = "ELASTIC_TEST_SEED"


def pytest_configure(config) -> None:
    """One seed for the session's random cases: ``ELASTIC_TEST_SEED`` when set, else a fresh one, put in the
    environment (so pytest-xdist's workers draw the same) and shown in the report's header."""
    os.environ.setdefault(SEED_ENV, str(secrets.randbelow(2**31)))


def pytest_report_header(config) -> str:
    return f"random cases: {SEED_ENV}={os.environ[SEED_ENV]} (set it to replay them)"


def session_seed() -> int:
    return int(os.environ[SEED_ENV])


def case_rng(name: str) -> random.Random:
    """The random source of the case ``name``: seeded from the session's seed and the name, so that
    ``ELASTIC_TEST_SEED=<seed>`` replays it; the seed is printed (pytest shows it with a failure)."""
    print(f"{SEED_ENV}={session_seed()} replays the random case {name!r}")
    return random.Random(f"{session_seed()}:{name}")


@pytest.fixture
def rng(request) -> random.Random:
    """:func:`case_rng` of this test."""
    return case_rng(request.node.nodeid)


def replay_hint() -> str:
    """For an assertion's message: how to draw this run's random cases again."""
    return f"replay with {SEED_ENV}={session_seed()}"


def until(predicate: Callable[[], T], bound_s: float, what: str, *, every_s: float = 0.05) -> T:
    """Poll ``predicate`` until it returns a true value (returned), for at most ``bound_s`` seconds; past that an
    AssertionError names ``what`` and the last value seen."""
    deadline = time.monotonic() + bound_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {bound_s}s (last value: {value!r})")
        time.sleep(every_s)
    return value


def bounded(call: Callable[[], T], bound_s: float, what: str) -> T:
    """``call()`` for a product method that takes no timeout: run in a daemon thread, its result (or its
    exception) returned within ``bound_s`` seconds; past that an AssertionError names ``what`` and shows where
    the call was stuck (the thread is left behind: it cannot be stopped)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread as it is
            out["error"] = err

    thread = threading.Thread(target=run, name=f"bounded: {what}", daemon=True)
    thread.start()
    thread.join(bound_s)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
        raise AssertionError(f"{what} did not return within {bound_s}s; stuck at:\n{where}")
    if "error" in out:
        raise out["error"]
    return out["value"]


@contextmanager
def fresh_cluster(head_cpus: int, nodes: Sequence[dict[str, Any]] = ()) -> Iterator[tuple[Any, list[Any]]]:
    """Leave the shared embedded Ray and run on a ``ray.cluster_utils.Cluster`` of its own: a head of
    ``head_cpus`` CPUs and one node per ``nodes`` entry (``Cluster.add_node``'s arguments); this driver is
    connected and every node is up when it yields ``(cluster, added_nodes)``. Both are shut down after; the next
    ``ray_local`` starts the shared one again."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    try:
        added = [cluster.add_node(**node) for node in nodes]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextmanager
def compile_events() -> Iterator[list[float]]:
    """The durations of the backend compilations in this process while it is open (a jax.monitoring listener,
    removed at the end: none is left installed for the tests after)."""
    import jax

    seen: list[float] = []

    def listen(name: str, secs: float, **_: Any) -> None:
        if name == COMPILE_EVENT:
            seen.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.fixture
def compiles() -> Iterator[list[float]]:
    """:func:`compile_events` for the whole test."""
    with compile_events() as seen:
        yield seen


@pytest.fixture
def ray_local():
    """A Ray driver connection: the embedded local cluster, started once and shared."""
    import ray

    from elastic.control.cluster import connect

    connect()
    yield ray


# The longest files first: `make test` hands whole files to two workers (pytest-xdist, --dist loadfile) in
# collection order, so starting with the long ones keeps one worker from finishing a long file alone at the end.
_LONG_FIRST = (
    "test_slurm.py",
    "test_chaos.py",
    "test_isolation.py",
    "test_processes_faults.py",
    "test_demo_cli.py",
    "test_flax.py",
    "test_supervision_holes.py",
    "test_submit_own_script.py",
    "test_data_pipeline.py",
    "test_processes.py",
    "test_operator_cli.py",
    "test_tiers.py",
)


# The files whose tests leave the shared embedded Ray for a cluster of their own (``fresh_cluster``) come last, each
# such test last in its file: the shared Ray they shut down is then not started again for the tests after them.
_FRESH_LAST = ("test_events.py", "test_keeper.py", "test_ray_drain.py", "test_supervisor.py")


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        name = item.path.name
        if name in _FRESH_LAST:
            return len(_LONG_FIRST) + 1
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and among the rest, is kept
