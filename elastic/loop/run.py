"""What the user's loop receives: the current mesh, the state restored onto it, and the steps to run.

The loop iterates ``run.steps`` (it resumes at the snapshot's step), computes each step and calls
``run.commit(state)`` once per step. A commit waits for the step's result, so a lost slice surfaces
there at the latest, and asks for the periodic snapshot. The wait is the step watchdog: a result not
ready within ``config.step_timeout_s`` (a pass's first step: ``FIRST_STEP_FACTOR`` times that) raises
``runtime.StepHungError``, and the job recovers as from a lost slice. Step boundaries belong to the
iterator: when the membership view has changed, ``run.steps`` ends the pass before the next step starts
(the code after ``commit`` always runs), and the job re-enters the loop on the new mesh.
"""

from __future__ import annotations

import collections
import copy
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from elastic.config import ElasticConfig, check_batch_splits
from elastic.errors import ConfigError
from elastic.loop.data import DataIterator, Source, open_data, record_positions
from elastic.loop.markers import StepMarkers
from elastic.runtime import batch_sharding, guarded, hangs, held_bytes, release, wait_ready
from elastic.supervision.membership import View

__all__ = ["LiveState", "Run", "RunHost", "Regroup", "batch_rows"]


@dataclass(frozen=True, kw_only=True)
class LiveState:
    """A healthy state at a step boundary, already snapshotted: it can move device to device."""

    state: Any
    next_step: int
    extras: dict[str, Any]


class Regroup(BaseException):
    """Unwinds the user's loop at a step boundary after the view changed (a ``BaseException`` so that a
    broad ``except Exception`` in the loop does not swallow it)."""

    def __init__(self, view: View, live: LiveState | None) -> None:
        super().__init__(f"membership changed to epoch {view.epoch}")
        self.view = view
        self.live = live


class RunHost(Protocol):
    """What a run needs from the controller, and all it may call."""

    config: ElasticConfig
    num_steps: int
    seed: int

    def before_step(self, step: int) -> None: ...

    def committed(self, run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None: ...

    def boundary(self, run: Run, next_step: int) -> Regroup | None: ...

    def record_call(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh) -> None: ...

    def must_confirm(self, step: int) -> bool:
        """Whether ``step``'s commit waits for the step itself (a snapshot is due after it)."""
        ...


@dataclass
class _Unconfirmed:
    """A committed step whose result may still be computing."""

    step: int
    state: Any
    metrics: dict[str, Any]
    batch: int
    extras: dict[str, Any]
    first: bool
    marker: jax.Array | None = None


def _live(tree: Any) -> Any:
    """The arrays of ``tree`` still alive: a leaf donated to a later step is gone (that step's readiness covers it)."""
    return [x for x in jax.tree_util.tree_leaves(tree) if not (isinstance(x, jax.Array) and x.is_deleted())]


class Run:
    """One pass of the user's loop over one membership view. Built by the controller."""

    def __init__(
        self, host: RunHost, *, view: View, mesh: Mesh, state: Any, start_step: int, extras: dict[str, Any]
    ) -> None:
        self._host = host
        self.view = view
        self.mesh = mesh
        self.state = state
        self.start_step = start_step
        self.extras = extras
        self._devices = tuple(mesh.devices.flat)
        self._pending: int | None = None
        self._steps_started = False
        self._data: dict[str, DataIterator] = {}
        self._window = max(1, host.config.in_flight)
        self._unconfirmed: collections.deque[_Unconfirmed] = collections.deque()
        self._unseen: tuple[int, float] | None = None  # steps confirmed unwaited (donated ahead): first, bounds
        self._markers = StepMarkers()
        self._rows_checked: set[int] = set()  # batch sizes checked to split over every device count
        self._outputs: Any = None  # what the newest guarded jitted call returned, until the next commit
        self._donated = False  # whether ``self.state``'s arrays were all donated when it was confirmed
        self._hint = (
            f"step_timeout_s={host.config.step_timeout_s}; raise ElasticConfig.step_timeout_s if a step "
            "can legitimately take longer"
        )

    @property
    def epoch(self) -> int:
        """The membership view's epoch this pass runs on."""
        return self.view.epoch

    @property
    def slices(self) -> tuple[int, ...]:
        """The slices this pass runs on, in index order."""
        return tuple(sorted(self.view.active))

    @property
    def num_devices(self) -> int:
        """Devices in this pass's mesh."""
        return len(self._devices)

    @property
    def num_steps(self) -> int:
        """The job's step count (``ElasticConfig.num_steps``)."""
        return self._host.num_steps

    @property
    def steps(self) -> Iterator[int]:
        """Step numbers from the snapshot's step to the last; each must be committed before the next."""
        if self._steps_started:
            raise ConfigError("run.steps may be iterated once per pass of the loop")
        self._steps_started = True
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        for step in range(self.start_step, self.num_steps):
            if step > self.start_step:  # the previous step's body has finished: a membership change ends the pass
                regroup = self._host.boundary(self, step)
                if regroup is not None:
                    raise regroup
            self._pending = step
            self._host.before_step(step)
            yield step
            if self._pending is not None:
                raise ConfigError(f"step {step} ended without run.commit(state): commit once per step")
        self.settle()  # the last steps: confirmed before the loop goes on past run.steps

    def commit(self, state: Any, *, batch: int | None = None, **metrics: Any) -> None:
        """Commit the current step's new ``state`` (``batch``: the batch it consumed, default the step).

        Returns without waiting for this step while fewer than ``config.in_flight`` steps are unconfirmed
        (the loop dispatches the next step while this one computes); steps are confirmed in order, each once its
        result is ready: recorded in the ledger and, when one is due, snapshotted (the commit of a step a
        snapshot follows waits for it). Raises the slice-loss error if a slice was lost meanwhile, and
        ``runtime.StepHungError`` if a step made no progress within its timeout (``step_timeout_s``).
        """
        step = self._pending
        if step is None:
            raise ConfigError("run.commit() must be called once per step, inside `for step in run.steps`")
        first = step == self.start_step  # the first step on this mesh gets FIRST_STEP_FACTOR x the time
        if self._host.config.step_wait_s(first=first) is None and hangs.blocked():
            raise ConfigError(
                f"step {step} hangs (Faults.hang_step) with the step watchdog off: set "
                "ElasticConfig.step_timeout_s to drill hangs"
            )
        self._pending = None
        record_positions(self.extras, self._data)  # the pipelines' positions after this step's batches
        extras = self.extras if self._window == 1 or not self.extras else copy.deepcopy(self.extras)
        keep = 0 if self._host.must_confirm(step) else self._window - 1
        outputs, self._outputs = self._outputs, None
        self._unconfirmed.append(
            _Unconfirmed(
                step=step,
                state=state,
                metrics=metrics,
                batch=step if batch is None else batch,
                extras=extras,
                first=first,
                marker=self._markers.mark(state, metrics, outputs) if keep else None,  # the next step may donate it
            )
        )
        self._confirm(keep=keep)

    @property
    def newest_state(self) -> Any:
        """The newest committed step's state, confirmed or not (``state`` is the newest confirmed one)."""
        return self._unconfirmed[-1].state if self._unconfirmed else self.state

    def settle(self) -> None:
        """Confirm every committed step (at a step boundary the pass may end at, and after the last step)."""
        self._confirm(keep=0)

    def _confirm(self, *, keep: int) -> None:
        """Confirm the oldest unconfirmed steps, in order, until ``keep`` remain.

        A step whose state was donated to the next one before it was confirmed (and that committed no metrics)
        is waited on through its marker (:mod:`elastic.loop.markers`); one with nothing left to wait on (no marker)
        is covered by the next wait that has something, which gets each step it covers its own ``step_timeout_s``."""
        while len(self._unconfirmed) > keep:
            u = self._unconfirmed[0]
            live = _live(u.state)
            waitable = (live + _live(u.metrics) if u.metrics else live) or _live(u.marker)
            first, earlier = self._unseen or (u.step, 0.0)
            own = self._host.config.step_wait_s(first=u.first)
            bound = None if own is None else earlier + own
            if first == u.step:
                what = f"step {u.step}{' (the first of this pass)' if u.first else ''}"
            else:
                what = f"steps {first}-{u.step} (the loop ran ahead of them)"
            wait_ready(waitable, self._devices, timeout_s=bound, what=what, hint=self._hint)
            self._unseen = None if waitable or bound is None else (first, bound)
            self._unconfirmed.popleft()
            previous, self.state = self.state, u.state
            donated, self._donated = self._donated, not live  # whether ``previous`` holds no live array
            current, self.extras = self.extras, u.extras  # the confirmed step's positions, for its snapshot
            try:
                self._host.committed(self, u.step, u.state, u.batch, u.metrics)
            finally:
                self.extras = current
            # A donated state, the step's metrics and its marker hold little memory, but each free can wait on an
            # allocator's lock: they are dropped on another thread (a state still holding its buffers is not).
            # A state seen donated at its own confirmation holds nothing: only the rest is measured.
            release((previous, u.metrics, u.marker), held=held_bytes((u.metrics, u.marker)) if donated else None)
            u.metrics, u.marker = {}, None
            del previous

    def data(self, source: Source, *, name: str = "data") -> DataIterator:
        """An iterator over ``source`` (a pipeline such as a grain ``DataLoader``/``IterDataset``, or a function
        building an iterator with ``get_state``/``set_state``) positioned where the committed steps left it:
        at the restored snapshot's position, or the last commit's on a live reshard. Call it once per pass and
        ``next()`` it inside each step, before ``commit`` (see :mod:`elastic.loop.data`)."""
        if name in self._data:
            raise ConfigError(f"run.data(name={name!r}) was already opened in this pass: give each pipeline its name")
        self._data[name] = open_data(
            source, name=name, extras=self.extras, start_step=self.start_step, current_step=lambda: self._pending
        )
        return self._data[name]

    def batches(self, source: Source, *, name: str = "data") -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` for each of ``run.steps``, one batch per step from ``run.data(source, name=name)``;
        commit each step as usual."""
        data = self.data(source, name=name)
        return ((step, next(data)) for step in self.steps)

    def jit(self, fn: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
        """``jax.jit(fn)`` dispatched through the runtime's guard on this mesh's devices; its first call
        is recorded so that it is compiled ahead for the meshes the job may move to. Refuses (``ConfigError``)
        in-place NNX code, whose updates ``jax.jit`` would silently drop: an ``nnx.jit`` function, or a call
        with NNX modules among the arguments (use ``elastic.api.flax_nnx.NnxAdapter.step``)."""
        _check_functional(fn, None, None, where="run.jit")
        return self.guard(jax.jit(fn, **jit_kwargs))

    def guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (already compiled or plain) dispatched through the runtime's guard; a ``jax.jit``
        function's first call is recorded for standby compilation (and refused, ``ConfigError``, when given
        NNX modules, whose in-place updates ``jax.jit`` drops; an ``nnx.jit`` function keeps them)."""
        call = guarded(fn, self._devices)
        if not hasattr(fn, "lower"):
            return call  # its outputs may come from several executions: none of them marks the step
        recorded = False

        @functools.wraps(fn)
        def first_call_recorded(*args: Any, **kwargs: Any) -> Any:
            nonlocal recorded
            nnx_transform = not recorded and _check_functional(fn, args, kwargs, where="run.jit/run.guard")
            # one execution's outputs, ready together: the step's other outputs can mark it (markers.py)
            self._outputs = out = call(*args, **kwargs)
            if not recorded:
                recorded = True
                if not kwargs and not nnx_transform:  # standby compiles jax.jit functions only
                    self._host.record_call(fn, args, self.mesh)
            return out

        return first_call_recorded

    def shard_batch(self, batch: Any) -> Any:
        """Place a global host batch on the mesh, its leading dimension split over every device.

        The leading size must split over every device count the job may shrink to, not only this mesh's:
        a batch that would not fails at the first step (``ConfigError`` naming the sizes), not after a shrink.
        In multi-process mode every worker passes the same global batch (each places its own devices' rows; that
        they are the same is not checked across processes).
        """
        rows = batch_rows(batch, what="run.shard_batch got")
        if rows not in self._rows_checked:
            check_batch_splits(rows, self._host.config, what="a batch")
            self._rows_checked.add(rows)
        return self._put_batch(batch)

    @functools.cached_property
    def _put_batch(self) -> Callable[[Any], Any]:
        """One sharding and one guarded transfer per pass, not one per step. Across processes each places its own
        devices' rows of a host array (``jax.make_array_from_callback``): ``jax.device_put`` would first check that
        every process passed the same value, an all-gather each step whose failure when a peer dies is a
        ``ValueError``, not a runtime error the failure path knows."""
        sharding = batch_sharding(self.mesh)
        if jax.process_count() == 1:
            return functools.partial(self.guard(jax.device_put), device=sharding)

        def place(leaf: Any) -> Any:
            if isinstance(leaf, jax.Array):
                return jax.device_put(leaf, sharding)
            rows = np.asarray(leaf)
            return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

        return self.guard(lambda batch: jax.tree_util.tree_map(place, batch))

    def key(self, step: int) -> jax.Array:
        """The RNG key of ``step``: derived from the job's seed, the same on every mesh and after restore."""
        return jax.random.fold_in(jax.random.key(self._host.seed), step)


def _check_functional(fn: Any, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None, *, where: str) -> bool:
    """``elastic.loop.nnx_check.check_functional`` once NNX is imported (flax is optional); else nothing to check."""
    if "flax.nnx" not in sys.modules:
        return False
    from elastic.loop.nnx_check import check_functional

    return check_functional(fn, args, kwargs, where=where)


def batch_rows(batch: Any, *, what: str) -> int:
    """The leading (batch) size shared by every leaf of ``batch``; ``ConfigError`` when there is none.
    ``what`` starts the message (e.g. ``"batch_fn(3) returned"``)."""
    shapes = [np.shape(leaf) for leaf in jax.tree_util.tree_leaves(batch)]
    if shapes and shapes[0] and all(shape and shape[0] == shapes[0][0] for shape in shapes):
        return int(shapes[0][0])  # every step's case: the paths below only name what is wrong
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ConfigError(f"{what} no array leaves: a batch is a pytree of arrays whose leading dimension is the batch")
    sizes: dict[int, str] = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ConfigError(
                f"{what} a leaf {jax.tree_util.keystr(path)} of shape () with no leading (batch) "
                "dimension: give every leaf the batch as its first dimension"
            )
        sizes.setdefault(shape[0], jax.tree_util.keystr(path))
    if len(sizes) != 1:
        named = ", ".join(f"{n} at {p or 'the root'}" for n, p in sorted(sizes.items()))
        raise ConfigError(
            f"{what} leaves with different leading sizes {sorted(sizes)} ({named}): every leaf's "
            "leading dimension is the batch"
        )
    (rows,) = sizes
    return rows
