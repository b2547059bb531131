"""A batteries-included trainer built on :class:`ElasticJob`, for the CLI and ``ray job submit``.

``Trainer(init_fn=..., step_fn=..., batch_fn=..., config=...)``: ``batch_fn(step)`` returns the global
batch of ``step`` (host arrays, leading dimension the batch), so the data order is the same on any
mesh and after any restore. ``step_fn`` is either ``elastic.optax_step(loss_fn, optimizer)``, which
keeps the global batch exact on any device count by splitting it into micro-batches with gradient
accumulation, or a plain ``step_fn(state, batch) -> (state, metrics)`` whose batch must divide over
every device count the job may shrink to (checked at the first step, and at construction when
``config.global_batch_size`` is set).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax

import runtime
from elastic.config import ElasticConfig
from elastic.errors import ConfigError
from elastic.faults import Faults
from elastic.job import ElasticJob, JobResult, ShardingsFn, StepCallback
from elastic.run import Run, batch_rows

__all__ = ["OptaxStep", "optax_step", "Trainer"]


@dataclass(frozen=True, kw_only=True)
class OptaxStep:
    """A step defined by a mean loss and an optax optimizer; state is ``{"params", "opt_state"}``."""

    loss_fn: Callable[[Any, Any], jax.Array]
    optimizer: optax.GradientTransformation

    def init(self, params: Any) -> dict[str, Any]:
        return {"params": params, "opt_state": self.optimizer.init(params)}

    def apply(self, state: dict[str, Any], grads: Any) -> dict[str, Any]:
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    def fused(self, state: dict[str, Any], batch: Any) -> tuple[dict[str, Any], jax.Array]:
        loss, grads = jax.value_and_grad(self.loss_fn)(state["params"], batch)
        return self.apply(state, grads), loss


def optax_step(loss_fn: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation) -> OptaxStep:
    """``loss_fn(params, batch)`` must return the *mean* loss over the batch's examples."""
    return OptaxStep(loss_fn=loss_fn, optimizer=optimizer)


def _weighted_sum(weights: tuple[float, ...], trees: list[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *xs: sum(w * x for w, x in zip(weights, xs, strict=True)), *trees)


class Trainer:
    def __init__(self, *, init_fn: Callable[[jax.Array], Any], step_fn: OptaxStep | Callable[..., Any],
                 batch_fn: Callable[[int], Any], config: ElasticConfig, shardings_fn: ShardingsFn | None = None,
                 mesh_fn: runtime.MeshFn | None = None, faults: Faults | None = None,
                 on_step: StepCallback | None = None, agent_nodes: dict[int, str] | None = None) -> None:
        if not callable(batch_fn) or not callable(init_fn):
            raise ConfigError("init_fn and batch_fn must be callables: init_fn(key) -> state, batch_fn(step) -> batch")
        self._batch_fn = batch_fn
        self._step = step_fn
        if isinstance(step_fn, OptaxStep):
            full_init = lambda key: step_fn.init(init_fn(key))  # noqa: E731
            self._fused = jax.jit(step_fn.fused, donate_argnums=0)
            self._grad = jax.jit(jax.value_and_grad(step_fn.loss_fn))
            self._apply = jax.jit(step_fn.apply, donate_argnums=0)
            self._combine = jax.jit(_weighted_sum, static_argnums=0)
        elif callable(step_fn):
            full_init = init_fn
            self._fused = jax.jit(step_fn, donate_argnums=0)
        else:
            raise ConfigError(f"step_fn must be elastic.optax_step(...) or a callable, got {type(step_fn).__name__}")
        self.job = ElasticJob(config, init_fn=full_init, shardings_fn=shardings_fn, mesh_fn=mesh_fn, faults=faults,
                              on_step=on_step, agent_nodes=agent_nodes, microbatched=isinstance(step_fn, OptaxStep))

    def fit(self) -> JobResult:
        """Train to ``config.num_steps``, surviving slice loss; returns the final state and the report."""
        with self.job:
            return self.job.run(self._loop)

    def _loop(self, run: Run) -> Any:
        state = run.state
        fused = run.guard(self._fused)
        for step in run.steps:
            batch = self._batch_fn(step)
            size = batch_rows(batch, what=f"batch_fn({step}) returned")
            if not isinstance(self._step, OptaxStep):  # a plain step needs a batch that splits on every mesh
                state, out = fused(state, run.shard_batch(batch))
            else:
                plan = runtime.plan_microbatches(size, run.num_devices)
                if len(plan) == 1 and plan[0].sharded:
                    state, out = fused(state, run.guard(jax.device_put)(batch, runtime.batch_sharding(run.mesh)))
                else:
                    state, out = self._accumulate(run, state, batch, plan, size)
            run.commit(state, **(out if isinstance(out, dict) else {"loss": out}))
        return state

    def _accumulate(self, run: Run, state: Any, batch: Any, plan: tuple[runtime.Chunk, ...], size: int) -> Any:
        """Gradient of the whole batch's mean loss from micro-batches, then one optimizer update."""
        losses, grads = [], []
        for chunk in plan:
            part = jax.tree_util.tree_map(lambda x, c=chunk: x[c.start : c.stop], batch)
            placed = run.guard(jax.device_put)(
                part, runtime.batch_sharding(run.mesh) if chunk.sharded else runtime.replicated(run.mesh)
            )
            loss, grad = run.guard(self._grad)(state["params"], placed)
            losses.append(loss)
            grads.append(grad)
        weights = tuple(c.size / size for c in plan)
        combine = run.guard(self._combine)
        return run.guard(self._apply)(state, combine(weights, grads)), combine(weights, losses)
