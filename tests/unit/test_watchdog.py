"""The step watchdog's runtime side: bounded waits, simulated hangs that really block, bounded probes."""

from __future__ import annotations

import os
import pickle
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic import runtime
from elastic.runtime import FailureKind, StepHungError, classify_failure, hangs, is_recoverable, simulated
from elastic.runtime.topology import simulated_topology

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def topo():
    simulated.reset()
    hangs.release_all()
    yield simulated_topology(4, 2)
    hangs.release_all()  # never leave a blocked callback or an armed hang to other tests
    simulated.reset()


def state_on(topo):
    devices = [d for s in topo.slices for d in s.devices]
    mesh = Mesh(np.array(devices).reshape(4, 2), ("replica", "local"))
    x = jax.device_put(jnp.arange(16, dtype=jnp.float32), NamedSharding(mesh, P(("replica", "local"))))
    return {"x": x, "w": jax.device_put(jnp.ones((3,)), NamedSharding(mesh, P()))}, tuple(devices)


step = jax.jit(lambda s: {"x": s["x"] + 1, "w": s["w"] * 2})


def test_wait_ready_returns_a_ready_tree_without_waiting(topo):
    state, devices = state_on(topo)
    out = runtime.guarded(step, devices)(state)
    assert runtime.wait_ready(out, devices, timeout_s=5.0, what="step 0") is out
    np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(16) + 1)


def test_a_hung_step_raises_within_its_bound_and_is_aborted(topo):
    state, devices = state_on(topo)
    hangs.arm()
    out = runtime.guarded(step, devices)(state)  # dispatch returns: the hang is on the devices, not here
    assert not out["x"].is_ready() and hangs.blocked() == 1
    t0 = time.monotonic()
    with pytest.raises(StepHungError, match=r"step 7 made no progress in 0.3s: 2 of 2 result arrays") as info:
        runtime.wait_ready(out, devices, timeout_s=0.3, what="step 7", hint="raise step_timeout_s")
    assert 0.3 <= time.monotonic() - t0 < 3.0
    assert "raise step_timeout_s" in str(info.value)
    assert classify_failure(info.value) is FailureKind.HUNG and is_recoverable(info.value)
    assert not runtime.is_slice_loss(info.value)
    # The watchdog aborted it: the computation completes (its results are discarded by the controller) and
    # every slice answers its probe again (a transient hang).
    assert hangs.blocked() == 0
    jax.block_until_ready(out)
    assert runtime.probe_slices(topo.slices, timeout_s=10.0) == frozenset()


def test_a_hang_on_one_slice_leaves_it_wedged(topo):
    state, devices = state_on(topo)
    hangs.arm(topo.slice(2))
    out = runtime.guarded(step, devices)(state)
    with pytest.raises(StepHungError):
        runtime.wait_ready(out, devices, timeout_s=0.2, what="step 3")
    assert runtime.probe_slices(topo.slices, timeout_s=10.0) == frozenset({2})


def test_a_hang_for_a_slice_outside_the_computation_does_nothing(topo):
    devices = [d for s in topo.select([0, 1]) for d in s.devices]
    x = jax.device_put(jnp.ones((4,)), NamedSharding(Mesh(np.array(devices), ("d",)), P("d")))
    hangs.arm(topo.slice(3))
    out = runtime.guarded(jax.jit(lambda a: a * 3), devices)(x)
    runtime.wait_ready(out, devices, timeout_s=10.0)
    assert hangs.blocked() == 0


def test_only_compiled_calls_hang(topo):
    state, devices = state_on(topo)
    hangs.arm()
    placed = runtime.guarded(jax.device_put, devices)(state["w"], state["w"].sharding)
    runtime.wait_ready(placed, devices, timeout_s=10.0)  # device_put is not the step: still armed
    out = runtime.guarded(step, devices)(state)
    assert hangs.blocked() == 1 and not out["w"].is_ready()


def test_release_all_frees_blocked_callbacks(topo):
    state, devices = state_on(topo)
    hangs.arm()
    out = runtime.guarded(step, devices)(state)
    hangs.arm()  # armed, never fired
    hangs.release_all()
    runtime.wait_ready(out, devices, timeout_s=10.0)
    assert hangs.blocked() == 0
    again = runtime.guarded(step, devices)(state)  # nothing armed any more
    runtime.wait_ready(again, devices, timeout_s=10.0)


def test_probe_of_a_wedged_device_is_bounded(topo):
    """A device stuck behind a computation nothing can abort (real hardware): every probe behind it goes
    unanswered and counts as dead, within the bound, instead of blocking the controller forever."""
    release = threading.Event()
    devices = [d for s in topo.slices for d in s.devices]
    mesh = Mesh(np.array(devices), ("d",))

    def stuck(x):
        token = io_callback(lambda t: (release.wait(120), t)[1], jax.ShapeDtypeStruct((), jnp.int32), jnp.int32(0))
        return jax.lax.optimization_barrier((token, x))[1]

    x = jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P("d")))
    try:
        wedged = jax.jit(stuck)(x)
        t0 = time.monotonic()
        assert runtime.probe_slices(topo.slices, timeout_s=0.5) == frozenset({0, 1, 2, 3})
        assert time.monotonic() - t0 < 5.0
    finally:
        release.set()
    jax.block_until_ready(wedged)


def test_a_lost_slice_is_named_before_the_survivors_answer_their_probes(topo):
    """``probe_slices(early=...)``: a lost slice's probe fails at dispatch and is handed to ``early`` at once,
    while the survivors' probes still wait behind the computation in flight on their devices (here one that
    only ``early`` releases: called after the survivors' answers, it would come too late, every probe would
    wait out its bound, and every slice would count as dead)."""
    release = threading.Event()
    survivors = [d for s in topo.select([0, 2, 3]) for d in s.devices]
    mesh = Mesh(np.array(survivors), ("d",))

    def held(x):  # bounded: a probe that never released it still ends the test
        token = io_callback(lambda t: (release.wait(30), t)[1], jax.ShapeDtypeStruct((), jnp.int32), jnp.int32(0))
        return jax.lax.optimization_barrier((token, x))[1]

    busy = jax.jit(held)(jax.device_put(jnp.ones((6,)), NamedSharding(mesh, P("d"))))
    simulated.kill_slice(topo.slice(1))
    heard = []

    def early(dead):
        heard.append((dead, busy.is_ready()))
        release.set()

    try:
        assert runtime.probe_slices(topo.slices, timeout_s=5.0, early=early) == frozenset({1})
    finally:
        release.set()
    assert heard == [(frozenset({1}), False)]  # once, the lost slice only, while the survivors were busy
    jax.block_until_ready(busy)
    heard.clear()
    assert runtime.probe_slices(topo.select([0, 2]), timeout_s=5.0, early=early) == frozenset()
    assert heard == []  # nobody lost: not called


def test_step_hung_error_pickles_with_its_fields():
    err = StepHungError("step 3", 1.5, pending=1, total=4, hint="raise it")
    back = pickle.loads(pickle.dumps(err))
    assert (back.what, back.timeout_s, back.pending, back.total, back.hint) == ("step 3", 1.5, 1, 4, "raise it")
    assert str(back) == str(err) and isinstance(back, TimeoutError)


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.logged = threading.Event()

    def error(self, event: str, **fields) -> None:
        self.events.append((event, fields))
        self.logged.set()


def test_a_loop_stalled_outside_commit_is_reported_once_with_its_stack():
    from elastic.control.report import Timeline
    from elastic.control.stall import StallReporter

    log, timeline = _Log(), Timeline()
    reporter = StallReporter(0.2, log=log, timeline=timeline)
    reporter.start()
    try:
        reporter.progress(5)
        assert log.logged.wait(10.0)  # this thread "stalls" here, in a wait the reporter can see
        log.logged.clear()
        assert not log.logged.wait(0.5)  # once per stall
        reporter.progress(6)
        assert log.logged.wait(10.0)  # a new stall after progress is reported again
    finally:
        reporter.stop()
    (event, fields), _ = log.events
    assert event == "loop_stalled" and fields["step"] == 5 and fields["seconds"] >= 0.2
    assert "test_a_loop_stalled_outside_commit_is_reported_once_with_its_stack" in fields["where"]
    assert [e["step"] for e in timeline.events if e["event"] == "stalled"] == [5, 6]


def test_an_idle_loop_is_not_a_stall():
    from elastic.control.report import Timeline
    from elastic.control.stall import StallReporter

    log = _Log()
    reporter = StallReporter(0.1, log=log, timeline=Timeline())
    reporter.start()
    try:
        reporter.progress(1)
        reporter.idle()  # between passes: the controller's own waits are bounded
        assert not log.logged.wait(0.5)
    finally:
        reporter.stop()


def _waiter_threads() -> int:
    return sum(t.name == "elastic-ready-waiter" for t in threading.enumerate())


def held(devices, release: threading.Event):
    """A computation over ``devices`` (2 of them: it runs on the devices' threads, not inline) whose result is
    ready once ``release`` is set."""
    mesh = Mesh(np.array(devices), ("d",))

    def fn(x):
        token = io_callback(
            lambda t: (release.wait(30), t)[1],
            jax.ShapeDtypeStruct((), jnp.int32),
            jnp.int32(0),
            sharding=jax.sharding.SingleDeviceSharding(devices[0]),
        )
        return jax.lax.optimization_barrier((token, x))[1] + 1

    x = jax.device_put(jnp.zeros((len(devices),)), NamedSharding(mesh, P("d")))
    return jax.jit(fn), x


def test_a_bounded_wait_sleeps_instead_of_polling_and_reuses_its_waiter_thread(topo):
    """The loop's thread waits on an event while a waiter thread blocks on the arrays: a wait of 1/3 s costs it
    under 2 ms of CPU (polling readiness every 5 ms cost 4.7 ms), and waits one after another share one waiter."""
    devices = tuple(jax.devices()[:2])
    release = threading.Event()
    fn, x = held(devices, release)
    release.set()
    jax.block_until_ready(fn(x))  # compiled
    before = _waiter_threads()
    for _ in range(3):
        release.clear()
        out = fn(x)
        assert not out.is_ready()  # dispatched, not computed inline
        threading.Timer(1.0 / 3, release.set).start()
        cpu = time.thread_time()
        runtime.wait_ready(out, devices, timeout_s=10.0, what="a held step")
        assert time.thread_time() - cpu < 2e-3
    assert _waiter_threads() - before <= 1


class _Blocking:
    """A stand-in leaf for the waiter pool's logic: ``jax.block_until_ready`` calls its ``block_until_ready``."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def block_until_ready(self):
        self.event.wait(30)
        return self


def test_a_waiter_blocked_past_its_bound_is_not_handed_the_next_wait():
    """A wait past its bound leaves its waiter thread blocked (a hung computation); the next wait gets another
    thread instead of queueing behind it, and the blocked one serves again once its arrays are ready."""
    from elastic.runtime.guard import _waiters

    stuck, ready = threading.Event(), threading.Event()
    ready.set()
    assert not _waiters.wait([_Blocking(stuck)], 0.2)
    t0 = time.monotonic()
    assert _waiters.wait([_Blocking(ready)], 10.0)
    assert time.monotonic() - t0 < 5.0
    stuck.set()
    assert _waiters.wait([_Blocking(ready)], 10.0)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child runs no jax computation
def test_a_forked_child_starts_its_own_waiters():
    """The parent's idle waiters are threads the child lacks: a bounded wait in a forked child still returns."""
    from elastic.runtime.guard import _waiters

    ready = threading.Event()
    ready.set()
    assert _waiters.wait([_Blocking(ready)], 10.0)  # the parent now has an idle waiter
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _waiters.wait([_Blocking(ready)], 5.0) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
