"""Step markers: a donated step's result can still be waited on, and a pass on other devices compiles nothing."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic.loop import markers
from elastic.loop.markers import StepMarkers


def _mesh(devices) -> Mesh:
    return Mesh(np.array(devices).reshape(len(devices)), ("d",))


def _state(mesh: Mesh) -> dict:
    rep = NamedSharding(mesh, P())
    return {
        "w": jax.device_put(jnp.ones((len(mesh.devices.flat) * 4, 16)), NamedSharding(mesh, P("d"))),
        "count": jax.device_put(jnp.zeros((), jnp.int32), rep),
    }


def _held_step(gate: threading.Event):
    """A jitted step whose every output waits, on the device, until ``gate`` is set."""

    def held(x):
        gate.wait(60)
        return x

    def step(s):
        c = io_callback(held, jax.ShapeDtypeStruct((), jnp.float32), s["w"].sum())
        return {"w": s["w"] * 2 + 0 * c, "count": s["count"] + 1 + 0 * c.astype(jnp.int32)}

    return step


def test_a_marker_outlives_the_donation_and_is_ready_only_once_its_step_is():
    mesh = _mesh(jax.devices()[:4])
    gate = threading.Event()
    step = _held_step(gate)
    state = _state(mesh)
    jax.block_until_ready(state)
    marks = StepMarkers()
    first = jax.jit(step, donate_argnums=0)(state)
    marker = marks.mark(first, {})
    assert marker is not None and marker.shape == (1,)
    second = jax.jit(step, donate_argnums=0)(first)  # donates the marked step's state
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(first))
    assert not marker.is_ready()  # its step is held in the callback: the marker waits with it
    gate.set()
    jax.block_until_ready(marker)
    assert int(marker[0]) == 1  # one element of the smallest leaf being computed: the count after one step
    jax.block_until_ready(second)


def test_no_marker_where_the_metrics_hold_an_array_or_the_step_is_computed():
    mesh = _mesh(jax.devices()[:2])
    state = _state(mesh)
    jax.block_until_ready(state)
    assert StepMarkers().mark(state, {}) is None  # every leaf computed: nothing to mark
    busy = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))(state)
    assert StepMarkers().mark(busy, {"loss": busy["count"]}) is None
    jax.block_until_ready(busy)


def test_the_marker_program_is_compiled_ahead_for_every_local_device(compiles):
    mesh = _mesh(jax.devices()[:2])
    state = _state(mesh)
    jax.block_until_ready(state)
    gate = threading.Event()
    busy = jax.jit(_held_step(gate))(state)
    StepMarkers().mark(busy, {})
    gate.set()
    assert markers.wait_warm(60)
    before = len(compiles)
    other = jax.devices()[7]  # a device outside the marked mesh: a pass after a recovery or a grow
    x = jax.device_put(jnp.zeros((), jnp.int32), other)
    jax.block_until_ready(markers._tap(x))
    assert compiles[before:] == []


def test_the_step_s_other_output_marks_it_without_a_program_of_its_own(monkeypatch):
    """``state, loss = step(state)``: the loss is the marker (no tap dispatched), outlives the donation, and is
    ready only once the step is; a call that did not compute the state, or a computed output, marks nothing."""
    mesh = _mesh(jax.devices()[:4])
    gate = threading.Event()
    held = _held_step(gate)
    state = _state(mesh)
    jax.block_until_ready(state)

    def step(s):
        new = held(s)
        return new, new["w"].mean()

    fn = jax.jit(step, donate_argnums=0)
    outputs = fn(state)
    first, loss = outputs
    monkeypatch.setattr(markers, "_tap", None)  # no marker program: calling it would fail
    marker = StepMarkers().mark(first, {}, outputs)
    assert marker is loss
    assert markers.sibling(first, (jnp.zeros(2), loss)) is None  # another call's outputs: not this state's
    second = fn(first)  # donates the marked step's state
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(first))
    assert not marker.is_deleted() and not marker.is_ready()  # held with its step
    gate.set()
    jax.block_until_ready(second)
    assert float(marker) == 2.0  # the loss: the mean of the weights after one step
    assert markers.sibling(second[0], second) is None  # computed already: nothing to mark
    keyed = jax.jit(lambda s, k: (s + 1, jax.random.split(k)[0]))(jnp.zeros(4), jax.random.key(0))
    assert markers.sibling(keyed[0], keyed) is None  # a typed PRNG key is not waited on


def test_a_run_marks_each_step_by_the_loss_its_jitted_step_returned(monkeypatch):
    """Through ``run.jit``: each commit's marker is the step's own loss, and no marker program runs."""
    from elastic import ElasticConfig, Policy
    from tests.unit.test_data import _Host, _run

    config = ElasticConfig(
        simulated=True, job_name="mark", num_slices=4, devices_per_slice=2, num_steps=4, policy=Policy(min_slices=2)
    )
    run = _run(_Host(config), 0, {})
    monkeypatch.setattr(markers, "_tap", None)  # no marker program: calling it would fail
    turns = threading.Semaphore(0)  # step k computes once its commit has let it

    def held(x):
        turns.acquire(timeout=60)
        return x

    def step(s):
        c = io_callback(held, jax.ShapeDtypeStruct((), jnp.float32), s["w"].sum())
        new = {"w": s["w"] * 2 + 0 * c, "count": s["count"] + 1}
        return new, new["w"].mean()

    fn = run.jit(step, donate_argnums=0)
    rep = NamedSharding(run.mesh, P())
    state = {"w": jax.device_put(jnp.ones((16, 4)), rep), "count": jax.device_put(jnp.zeros((), jnp.int32), rep)}
    losses, marks = [], []
    for step_number in run.steps:
        state, loss = fn(state)
        losses.append(loss)
        run.commit(state)
        marks.extend(u.marker for u in run._unconfirmed if u.step == step_number)
        turns.release()
    assert len(marks) == 4  # every step ran ahead (this host asks for no snapshot), each marked by its loss
    assert all(m is loss for m, loss in zip(marks, losses, strict=True))
