"""The loop's thread hands the states it lets go of to a release thread, which frees them
(``elastic.runtime.freeing``)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic import ElasticConfig, Policy
from elastic.runtime import flush_releases, release, wait_ready
from elastic.runtime.freeing import BACKLOG, SMALL, WAKE_AT, _releaser, held_bytes, wake
from tests.unit.test_data import _Host, _run
from tests.unit.test_watchdog import held


class _Log(list[str]):
    """The names of the threads drops ran on, in order; ``wait_for(n)`` waits until there are ``n``."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def add(self) -> None:
        with self.changed:
            self.append(threading.current_thread().name)
            self.changed.notify_all()

    def wait_for(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self) >= n, 30)


class _Dropped:
    """Records the thread it was dropped on; ``gate`` (when given) holds that thread in the drop until set, and
    ``entered`` tells when the drop has begun."""

    def __init__(self, log: _Log, gate: threading.Event | None = None, entered: threading.Event | None = None) -> None:
        self.log, self.gate, self.entered = log, gate, entered

    def __del__(self) -> None:
        if self.entered is not None:
            self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        self.log.add()


def test_a_released_object_is_dropped_on_the_release_thread_once_woken():
    log = _Log()
    release(_Dropped(log))
    wake()
    log.wait_for(1)
    assert log == ["elastic-release"]


def test_enough_handovers_wake_the_release_thread_without_a_wait():
    """A loop whose commits never wait for the devices still has its handovers dropped."""
    log = _Log()
    for _ in range(WAKE_AT):
        release(_Dropped(log))
    log.wait_for(WAKE_AT)
    assert log == ["elastic-release"] * WAKE_AT


def test_a_wait_for_the_devices_wakes_the_release_thread():
    """The drops run while the loop's thread waits for a step (here one held in a host callback), not before."""
    devices = tuple(jax.devices()[:2])
    gate = threading.Event()
    fn, x = held(devices, gate)
    gate.set()
    jax.block_until_ready(fn(x))  # compiled: the next call is dispatched, not computed inline
    gate.clear()
    log = _Log()
    try:
        out = fn(x)
        assert not out.is_ready()
        release(_Dropped(log))
        waiting = threading.Thread(target=wait_ready, args=(out, devices), kwargs={"timeout_s": 60.0})
        waiting.start()
        log.wait_for(1)  # dropped while the step is still held: the wait woke the release thread
        assert not out.is_ready()
        assert log == ["elastic-release"]
    finally:
        gate.set()
    waiting.join(60)


def test_flush_returns_once_everything_released_before_it_is_dropped():
    """One drop holds the release thread: flush drops the waiting ones itself and waits for the one held."""
    log = _Log()
    gate, entered = threading.Event(), threading.Event()
    release(_Dropped(log, gate, entered))
    wake()
    assert entered.wait(30)  # the release thread is inside that drop
    release(_Dropped(log))
    results: list[bool] = []
    flusher = threading.Thread(target=lambda: results.append(flush_releases(60)), name="flusher")
    flusher.start()
    deadline = time.monotonic() + 30
    while _releaser._queue and time.monotonic() < deadline:  # until the flusher has taken the waiting one
        time.sleep(0.001)
    assert not _releaser._queue and flusher.is_alive()  # the held drop has not finished: flush waits for it
    assert flush_releases(0.05) is False  # ... within its bound: a stuck drop cannot hang the caller
    gate.set()
    flusher.join(30)
    assert not flusher.is_alive()
    assert results == [True]
    assert sorted(log) == ["elastic-release", "flusher"]


def test_past_the_backlog_the_caller_drops_its_own():
    """Memory never piles up behind a slow free: with ``BACKLOG`` handovers waiting, the next is dropped at once."""
    log = _Log()
    gate, entered = threading.Event(), threading.Event()
    release(_Dropped(log, gate, entered))
    wake()
    assert entered.wait(30)  # the release thread is inside that drop: the queue is empty
    for _ in range(BACKLOG):
        release(_Dropped(log))
    assert log == []
    release(_Dropped(log))
    assert log == [threading.current_thread().name]
    gate.set()
    log.wait_for(BACKLOG + 2)
    assert log.count("elastic-release") == BACKLOG + 1


def test_a_reference_holding_a_state_s_memory_is_dropped_by_the_caller():
    """Memory is freed when it was without the release thread: an object holding more than ``SMALL`` bytes of live
    arrays is not handed over; a donated jax array holds none."""
    log = _Log()
    release((np.zeros(SMALL + 1, np.uint8), _Dropped(log)))
    assert log == [threading.current_thread().name]
    x = jnp.zeros(SMALL // 4 + 1)
    assert held_bytes({"w": x}) == x.nbytes > SMALL
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    assert held_bytes({"w": x}) == 0


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child runs no jax computation
def test_a_forked_child_starts_its_own_release_thread():
    log = _Log()
    release(_Dropped(log))
    wake()
    log.wait_for(1)  # the parent's release thread exists now
    pid = os.fork()
    if pid == 0:
        child = _Log()
        release(_Dropped(child))
        wake()
        child.wait_for(1)
        os._exit(0 if child == ["elastic-release"] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@jax.tree_util.register_pytree_node_class
class _State:
    """A training state whose drops are recorded once ``tracked`` (each step's output is a new object; jax's own
    rebuilt copies are not tracked)."""

    drops = _Log()  # shared by every instance, read by the test

    def __init__(self, w: Any) -> None:
        self.w, self.tracked = w, False

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple[Any]) -> _State:
        return cls(*children)

    def __del__(self) -> None:
        if self.tracked:
            _State.drops.add()


def test_run_frees_the_states_it_confirms_past_off_the_loop_thread():
    """A commit that confirms a step replaces the run's confirmed state: the previous one is dropped on the release
    thread, never on the loop's (where a free could wait on the allocator's lock)."""
    config = ElasticConfig(
        simulated=True, job_name="free", num_slices=4, devices_per_slice=2, num_steps=6, policy=Policy(min_slices=2)
    )
    run = _run(_Host(config), 0, {})
    state = run.state = _State(jnp.zeros(4))
    state.tracked = True
    _State.drops.clear()
    step = jax.jit(lambda s: _State(s.w + 1), donate_argnums=0)
    for _ in run.steps:
        state = step(state)
        state.tracked = True
        run.commit(state)
    del state
    wake()  # these steps never waited for the devices (each was ready at its commit)
    _State.drops.wait_for(6)
    assert _State.drops == ["elastic-release"] * 6  # the initial state's and steps 0-4's, as steps 0-5 were confirmed
    assert float(run.state.w[0]) == 6.0


def test_run_drops_the_states_that_still_hold_their_buffers_itself():
    """A loop that does not donate: each confirmed-past state still holds its buffers (more than ``SMALL``), so it
    is freed where it was before, on the loop's thread, as soon as it is confirmed past."""
    config = ElasticConfig(
        simulated=True, job_name="keep", num_slices=4, devices_per_slice=2, num_steps=4, policy=Policy(min_slices=2)
    )
    run = _run(_Host(config), 0, {})
    state = run.state = _State(jnp.zeros(SMALL // 4 + 1))
    state.tracked = True
    _State.drops.clear()
    step = jax.jit(lambda s: _State(s.w + 1))
    for _ in run.steps:
        state = step(state)
        state.tracked = True
        run.commit(state)
    del state
    assert _State.drops == [threading.current_thread().name] * 4  # the initial state's and steps 0-2's
    assert float(run.state.w[0]) == 4.0
