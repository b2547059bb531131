"""A batteries-included trainer built on :class:`ElasticJob`, for the CLI and ``ray job submit``.

``Trainer(init_fn=..., step_fn=..., batch_fn=..., config=...)``: ``batch_fn(step)`` returns the global
batch of ``step`` (host arrays, leading dimension the batch), so the data order is the same on any
mesh and after any restore. ``step_fn`` is either ``elastic.optax_step(loss_fn, optimizer, ...)``, which
keeps the global batch on any device count by splitting it into micro-batches with gradient accumulation,
or a plain ``step_fn(state, batch) -> (state, metrics)`` whose batch must divide over every device count
the job may shrink to (checked at the first step, and at construction when ``config.global_batch_size`` is set).

``optax_step`` options: ``aux_init(params) -> aux`` carries auxiliary state (BatchNorm statistics, an EMA
of the params) in ``state["aux"]``; ``rng=True`` gives the loss one key per example, ``keys[i] ==
jax.random.fold_in(run.key(step), i)`` for the batch's global row ``i`` (:func:`example_keys`): the same
on any mesh, however the batch is split, and after any restore.

Micro-batching (a batch of B rows on n devices, B % n != 0: a sharded chunk of B - B % n rows, then the
remaining rows replicated, ``runtime.plan_microbatches``) gives the update of the whole batch when

* the loss is the *mean* of per-example terms, each depending only on its example (and its key): the
  size-weighted chunk gradients sum to the full-batch gradient, equal up to float summation order;
* per-example randomness comes from ``keys`` (a key shared by the batch would give each chunk the same
  masks). Measured (tests/unit/test_trainer_aux.py, float32): 8-device full batch against 6-device
  30 + 2 micro-batches, max |grad difference| ~1e-7 (limit 1e-6) with and without dropout.

It is not exact when the loss couples the examples, as BatchNorm's batch statistics do: each micro-batch
is normalised with its own statistics. So an ``aux_init`` step refuses micro-batches by default
(``microbatch_aux="refuse"``: ``ConfigError`` at construction when ``config.global_batch_size`` is set,
else at the first step, for a batch that does not split over every device count the job may run on).
``microbatch_aux="weighted_mean"`` accepts them: each chunk's ``new_aux`` is computed from the same
incoming aux, and the merged aux is their size-weighted mean (leaves that are not floats: the first
chunk's). That is exact for aux that is affine in per-example means (running means, running second
moments, an EMA of the params); a running *variance* misses the between-chunk term, and the loss and
gradients use per-chunk statistics.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from elastic import runtime
from elastic.api.job import ElasticJob, FaultPlan, JobResult, ShardingsFn, StepCallback
from elastic.config import ElasticConfig, check_batch_splits
from elastic.errors import ConfigError
from elastic.loop.run import Run, batch_rows

__all__ = ["MicrobatchAux", "OptaxStep", "StepRunner", "Trainer", "TrainerLoop", "example_keys", "optax_step"]

MicrobatchAux = Literal["refuse", "weighted_mean"]
_MICROBATCH_AUX = ("refuse", "weighted_mean")
Guard = Callable[[Callable[..., Any]], Callable[..., Any]]


def example_keys(key: jax.Array, start: int | jax.Array, rows: int) -> jax.Array:
    """Keys of the batch rows ``start .. start + rows - 1``: ``fold_in(key, row)`` for each (global) row."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, start + jnp.arange(rows, dtype=jnp.int32))


@dataclass(frozen=True, kw_only=True)
class OptaxStep:
    """A step defined by a mean loss and an optax optimizer (build it with :func:`optax_step`).

    State is ``{"params", "opt_state"}``, plus ``"aux"`` when ``aux_init`` is set.
    """

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    aux_init: Callable[[Any], Any] | None = None
    rng: bool = False
    microbatch_aux: MicrobatchAux = "refuse"

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise ConfigError(f"loss_fn must be a callable, got {self.loss_fn!r}")
        if not (hasattr(self.optimizer, "init") and hasattr(self.optimizer, "update")):
            raise ConfigError(f"optimizer must be an optax.GradientTransformation, got {type(self.optimizer).__name__}")
        if self.aux_init is not None and not callable(self.aux_init):
            raise ConfigError(f"aux_init must be a callable aux_init(params) -> aux, got {self.aux_init!r}")
        if not isinstance(self.rng, bool):
            raise ConfigError(f"rng must be True or False, got {self.rng!r}")
        if self.microbatch_aux not in _MICROBATCH_AUX:
            raise ConfigError(f"microbatch_aux must be one of {_MICROBATCH_AUX}, got {self.microbatch_aux!r}")

    @property
    def has_aux(self) -> bool:
        """The state carries ``aux`` (``aux_init`` was given)."""
        return self.aux_init is not None

    @property
    def refuses_microbatches(self) -> bool:
        """An ``aux`` step that may not be split into micro-batches (``microbatch_aux="refuse"``)."""
        return self.has_aux and self.microbatch_aux == "refuse"

    def init(self, params: Any) -> dict[str, Any]:
        """The initial state: ``{"params", "opt_state"}``, plus ``"aux"`` with ``aux_init``."""
        state = {"params": params, "opt_state": self.optimizer.init(params)}
        if self.aux_init is not None:
            state["aux"] = self.aux_init(params)
        return state

    def objective(
        self, params: Any, batch: Any, aux: Any = None, key: jax.Array | None = None, start: int | jax.Array = 0
    ) -> tuple[jax.Array, Any]:
        """``(loss, new_aux)`` of the rows ``start..`` of the step's batch (``new_aux`` None without aux);
        ``key`` is the step's key (``run.key(step)``), needed when ``rng``."""
        kwargs: dict[str, Any] = {}
        if self.has_aux:
            kwargs["aux"] = aux
        if self.rng:
            if key is None:
                raise ConfigError("optax_step(rng=True) needs the step's key: pass key=run.key(step)")
            kwargs["keys"] = example_keys(key, start, batch_rows(batch, what="the batch has"))
        out = self.loss_fn(params, batch, **kwargs)
        if not self.has_aux:
            return out, None
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ConfigError("optax_step(aux_init=...) needs loss_fn(params, batch, *, aux, ...) -> (loss, new_aux)")
        return out

    def apply(self, state: dict[str, Any], grads: Any, aux: Any = None) -> dict[str, Any]:
        """One optimizer update of ``state`` by ``grads``; ``aux`` becomes the new ``state["aux"]``."""
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        if self.has_aux:
            new["aux"] = aux
        return new

    def fused(
        self, state: dict[str, Any], batch: Any, key: jax.Array | None = None
    ) -> tuple[dict[str, Any], jax.Array]:
        """One step on the whole batch: ``(new state, loss)``."""
        (loss, aux), grads = jax.value_and_grad(self.objective, has_aux=True)(
            state["params"], batch, state.get("aux"), key
        )
        return self.apply(state, grads, aux), loss


def optax_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    aux_init: Callable[[Any], Any] | None = None,
    rng: bool = False,
    microbatch_aux: MicrobatchAux = "refuse",
) -> OptaxStep:
    """A step from a loss and an optax optimizer. ``loss_fn`` returns the *mean* loss over the batch's examples:

    * ``loss_fn(params, batch) -> loss`` (the default);
    * ``aux_init(params) -> aux`` given: ``loss_fn(params, batch, *, aux) -> (loss, new_aux)``, and the state
      carries ``"aux"`` (``new_aux`` is not differentiated through);
    * ``rng=True``: ``loss_fn`` also gets ``keys=``, one key per example (shape ``(rows,)``, row ``i``'s key
      ``fold_in(run.key(step), i)``); use it per example, e.g. ``jax.vmap(dropout)(keys, x)``.

    ``microbatch_aux``: what an ``aux_init`` step does with a batch that does not split over the devices
    (see the module doc): ``"refuse"`` (``ConfigError``) or ``"weighted_mean"`` (merge per-chunk aux).
    """
    return OptaxStep(loss_fn=loss_fn, optimizer=optimizer, aux_init=aux_init, rng=rng, microbatch_aux=microbatch_aux)


def _weighted_sum(weights: tuple[float, ...], trees: list[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *xs: sum(w * x for w, x in zip(weights, xs, strict=True)), *trees)


def _merge_aux(weights: tuple[float, ...], trees: list[Any]) -> Any:
    """Size-weighted mean of float leaves; any other leaf (a counter, a key) from the first chunk."""

    def merge(*xs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(xs[0].dtype, jnp.inexact):
            return xs[0]
        total: Any = sum(w * x for w, x in zip(weights, xs, strict=True))  # an array, though sum() types it int
        return total.astype(xs[0].dtype)

    return jax.tree_util.tree_map(merge, *trees)


def _unguarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


class StepRunner:
    """How the Trainer runs an :class:`OptaxStep` on a mesh: one jitted step on the whole batch when it
    splits over the devices, else micro-batches (``runtime.plan_microbatches``) whose size-weighted
    gradients feed one optimizer update. Jitted once per process (a runner pickled to a worker process jits
    there); ``on_mesh`` places the work on a mesh."""

    def __init__(self, step: OptaxStep) -> None:
        self.step = step
        self._jit()

    def _jit(self) -> None:
        step = self.step
        self._fused = jax.jit(step.fused, donate_argnums=0)
        self._grad = jax.jit(jax.value_and_grad(step.objective, has_aux=True))
        self._apply = jax.jit(step.apply, donate_argnums=0)
        self._combine = jax.jit(_weighted_sum, static_argnums=0)
        self._merge = jax.jit(_merge_aux, static_argnums=0)

    def __getstate__(self) -> dict[str, Any]:
        return {"step": self.step}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self._jit()

    def on_mesh(self, mesh: Mesh, guard: Guard = _unguarded) -> Callable[[Any, Any, jax.Array | None], tuple[Any, Any]]:
        """``run(state, batch, key) -> (state, loss)`` on ``mesh``: ``batch`` is the step's global host batch,
        ``key`` its key (``run.key(step)``, or None without ``rng``). ``guard`` wraps each dispatch
        (``run.guard``). The state passed in is donated."""
        n = mesh.devices.size
        fused, grad, apply, combine, merge = (
            guard(f) for f in (self._fused, self._grad, self._apply, self._combine, self._merge)
        )
        put = guard(jax.device_put)
        sharded, replicated = runtime.batch_sharding(mesh), runtime.replicated(mesh)

        def run(state: Any, batch: Any, key: jax.Array | None) -> tuple[Any, Any]:
            size = batch_rows(batch, what="the batch has")
            placed_key = None if key is None else put(key, replicated)
            plan = runtime.plan_microbatches(size, n)
            if len(plan) == 1 and plan[0].sharded:
                return fused(state, put(batch, sharded), placed_key)
            if self.step.refuses_microbatches:
                raise ConfigError(_refusal(f"a batch of {size} rows does not split over {n} devices"))
            losses, grads, auxes = [], [], []
            for chunk in plan:
                part = jax.tree_util.tree_map(lambda x, c=chunk: x[c.start : c.stop], batch)
                (loss, aux), g = grad(
                    state["params"],
                    put(part, sharded if chunk.sharded else replicated),
                    state.get("aux"),
                    placed_key,
                    chunk.start,
                )
                losses.append(loss)
                grads.append(g)
                auxes.append(aux)
            weights = tuple(c.size / size for c in plan)
            aux = merge(weights, auxes) if self.step.has_aux else None
            return apply(state, combine(weights, grads), aux), combine(weights, losses)

        return run


def _refusal(what: str) -> str:
    return (
        f"optax_step(aux_init=...) refuses micro-batches by default (their batch statistics differ from the "
        f"whole batch's): {what}; use a batch size that splits over every device count the job may run on, "
        "or pass optax_step(..., microbatch_aux='weighted_mean') to merge the micro-batches' aux by a "
        "size-weighted mean (see elastic.api.trainer)"
    )


def _check_splits(rows: int, config: ElasticConfig) -> None:
    """``ConfigError`` for a refusing aux step when ``rows`` does not split over a device count the job may use."""
    counts = config.device_counts
    bad = [n for n in counts if rows % n]
    if bad:
        raise ConfigError(
            _refusal(
                f"a batch of {rows} rows does not split over {bad} devices, and the job may run "
                f"on {list(counts)} (use a multiple of {math.lcm(*counts)})"
            )
        )


class Trainer:
    """A batteries-included loop over ``ElasticJob``: ``fit()`` trains ``num_steps`` steps of ``step_fn`` on
    ``batch_fn(step)``'s batches and returns the ``JobResult``.

    ``step_fn`` is an ``optax_step`` (micro-batches with gradient accumulation where the global batch no
    longer divides over the devices) or a plain ``(state, batch) -> (state, loss)``. The batch size is checked
    against every device count the job may run on when the Trainer is built.
    """

    def __init__(
        self,
        *,
        init_fn: Callable[[jax.Array], Any],
        step_fn: OptaxStep | Callable[..., Any],
        batch_fn: Callable[[int], Any],
        config: ElasticConfig,
        shardings_fn: ShardingsFn | None = None,
        mesh_fn: runtime.MeshFn | None = None,
        faults: FaultPlan | None = None,
        on_step: StepCallback | None = None,
        agent_nodes: dict[int, str] | None = None,
        init_from: str | os.PathLike | None = None,
        save_final_to: str | os.PathLike | None = None,
    ) -> None:
        """``init_from`` / ``save_final_to``: as :class:`ElasticJob`'s (Orbax checkpoints). A step that does not
        split a batch into micro-batches (a plain ``step_fn``, or an ``optax_step`` with ``aux_init`` that refuses
        them) has its batch size checked here against every device count the job may run on: the declared
        ``config.global_batch_size``, else the size of ``batch_fn(0)``."""
        if not callable(batch_fn) or not callable(init_fn):
            raise ConfigError("init_fn and batch_fn must be callables: init_fn(key) -> state, batch_fn(step) -> batch")
        self._batch_fn = batch_fn
        self._step = step_fn
        self._runner: StepRunner | None = None
        whole = not isinstance(step_fn, OptaxStep) or step_fn.refuses_microbatches  # the batch must split as is
        rows = config.global_batch_size
        if whole and rows is None and callable(step_fn):  # learn the batch size from the first batch
            rows = batch_rows(batch_fn(0), what="batch_fn(0) returned")
        if isinstance(step_fn, OptaxStep):
            if step_fn.refuses_microbatches and rows is not None:
                _check_splits(rows, config)
            full_init = lambda key: step_fn.init(init_fn(key))  # noqa: E731
            self._runner = StepRunner(step_fn)
        elif callable(step_fn):
            if rows is not None and config.global_batch_size is None:  # a declared size is checked by the job
                check_batch_splits(rows, config, what="batch_fn(0) returned a batch")
            full_init = init_fn
        else:
            raise ConfigError(f"step_fn must be elastic.optax_step(...) or a callable, got {type(step_fn).__name__}")
        self.job = ElasticJob(
            config,
            init_fn=full_init,
            shardings_fn=shardings_fn,
            mesh_fn=mesh_fn,
            faults=faults,
            on_step=on_step,
            agent_nodes=agent_nodes,
            microbatched=isinstance(step_fn, OptaxStep),
            init_from=init_from,
            save_final_to=save_final_to,
        )

    def fit(self) -> JobResult:
        """Train to ``config.num_steps``, surviving slice loss; returns the final state and the report."""
        with self.job:
            return self.job.run(self._loop)

    @property
    def _loop(self) -> TrainerLoop:
        plain = None if self._runner is not None or isinstance(self._step, OptaxStep) else self._step
        return TrainerLoop(runner=self._runner, plain=plain, batch_fn=self._batch_fn, config=self.job.config)


class TrainerLoop:
    """The Trainer's loop: what ``ElasticJob.run`` runs (in each worker process, in multi-process mode: it pickles
    with the user's functions and the step runner, not the Trainer and its job)."""

    def __init__(
        self,
        *,
        runner: StepRunner | None,
        plain: Callable[..., Any] | None,
        batch_fn: Callable[[int], Any],
        config: ElasticConfig,
    ) -> None:
        self._runner, self._plain, self._batch_fn, self._config = runner, plain, batch_fn, config
        self._fused: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_fused"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _fused=None)

    def __call__(self, run: Run) -> Any:
        state = run.state
        if self._runner is None:  # a plain step needs a batch that splits on every mesh
            if self._fused is None:
                assert self._plain is not None  # a Trainer gives a runner or a plain step
                self._fused = jax.jit(self._plain, donate_argnums=0)
            fused = run.guard(self._fused)
            for step in run.steps:
                state, out = fused(state, run.shard_batch(self._batch_fn(step)))
                run.commit(state, **(out if isinstance(out, dict) else {"loss": out}))
            return state
        opt = self._runner.step
        step_on_mesh = self._runner.on_mesh(run.mesh, run.guard)
        for step in run.steps:
            batch = self._batch_fn(step)
            size = batch_rows(batch, what=f"batch_fn({step}) returned")
            if opt.refuses_microbatches:
                _check_splits(size, self._config)
            state, loss = step_on_mesh(state, batch, run.key(step) if opt.rng else None)
            run.commit(state, loss=loss)
        return state
