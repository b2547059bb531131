"""Flax Linen as an elastic job's state: a ``TrainState`` with BatchNorm statistics and its RNG key.

Linen is functional already; what a job needs is one pytree holding everything a step changes, so that
the snapshot and a reshard carry all of it::

    adapter = LinenAdapter(
        module=CNN(), tx=optax.adam(1e-3), sample_input=jnp.zeros((1, 28, 28, 1)), train_kwargs={"train": True}
    )
    job = elastic.ElasticJob(config, init_fn=adapter.init_fn, shardings_fn=adapter.shardings_fn)
    step_fn = run.jit(adapter.step(loss_fn))  # loss_fn(outputs, *targets) -> loss | (loss, metrics)
    state, metrics = step_fn(state, x, y)  # metrics: {"loss": ..., **yours}

Needs flax (``pip install 'jax-elastic[flax]'``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from elastic.errors import ConfigError

try:
    import flax.linen as nn
    from flax.core import meta as flax_meta
    from flax.training import train_state
except ImportError as err:  # flax is optional
    raise ConfigError("elastic.api.flax_linen needs flax: pip install 'jax-elastic[flax]' (flax>=0.12.8)") from err

from elastic.api.flax_nnx import AxisRules, check_rules, mesh_spec

__all__ = ["LinenAdapter", "TrainState"]

_COLLECTIONS = ("params", "batch_stats")


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus what a Linen step also changes: ``batch_stats`` (BatchNorm
    running statistics, ``{}`` without BatchNorm) and ``key``, the RNG stream that step ``n``'s dropout
    keys derive from (``fold_in(key, n)``: the same numbers on any mesh and after a restore)."""

    batch_stats: Any = None
    key: Any = None


@dataclass(frozen=True, kw_only=True, eq=False)
class LinenAdapter:
    """A Linen ``module`` trained with ``tx`` as a job's state (:class:`TrainState`).

    ``sample_input``: the module's input (arrays or ``jax.ShapeDtypeStruct``; one row is enough) for
    ``module.init``. ``init_kwargs``/``train_kwargs``: keyword arguments of the module's ``__call__`` at
    init and in the training step (e.g. ``{"train": True}``). ``rng_streams``: RNG collections the step
    provides (``"dropout"``). ``axis_rules`` maps ``nn.with_partitioning``/``nn.with_logical_partitioning``
    names onto mesh axes. Variables besides ``params`` and ``batch_stats`` are not supported.
    """

    module: nn.Module
    tx: optax.GradientTransformation
    sample_input: Any
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)
    train_kwargs: Mapping[str, Any] = field(default_factory=dict)
    rng_streams: tuple[str, ...] = ("dropout",)
    axis_rules: AxisRules = ()

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise ConfigError(f"LinenAdapter(module=...) must be a flax.linen Module, got {type(self.module).__name__}")
        if not (callable(getattr(self.tx, "init", None)) and callable(getattr(self.tx, "update", None))):
            raise ConfigError(f"LinenAdapter(tx=...) must be an optax.GradientTransformation, got {self.tx!r}")
        object.__setattr__(self, "axis_rules", check_rules(self.axis_rules))

    def _boxed(self, key: jax.Array) -> TrainState:
        """The state with its partitioning boxes (``nn.Partitioned``) still on."""
        k_params, k_streams, k_state = jax.random.split(key, 3)
        rngs = {"params": k_params, **self._stream_keys(k_streams)}
        inputs = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), self.sample_input)
        variables = self.module.init(rngs, inputs, **self.init_kwargs)
        extra = sorted(set(variables) - set(_COLLECTIONS))
        if extra:
            raise ConfigError(
                f"{type(self.module).__name__} has variable collections {extra}: LinenAdapter keeps "
                f"only {list(_COLLECTIONS)}"
            )
        return TrainState.create(
            apply_fn=self.module.apply,
            params=variables["params"],
            tx=self.tx,
            batch_stats=variables.get("batch_stats", {}),
            key=k_state,
        )

    def _stream_keys(self, key: jax.Array) -> dict[str, jax.Array]:
        return {name: jax.random.fold_in(key, i) for i, name in enumerate(self.rng_streams)}

    def init_fn(self, key: jax.Array) -> TrainState:
        """The job's ``init_fn``: a :class:`TrainState` of plain arrays (annotations apply via ``shardings_fn``)."""
        return flax_meta.unbox(self._boxed(key))

    @functools.cached_property
    def _abstract_boxed(self) -> TrainState:
        return jax.eval_shape(self._boxed, jax.random.key(0))

    def shardings_fn(self, mesh: Mesh) -> TrainState:
        """The job's ``shardings_fn``: one ``PartitionSpec`` per state leaf, from the partitioning annotations
        (the optimizer's moments follow their parameters); replicated where there is none."""

        def spec(path: Any, leaf: Any) -> PartitionSpec:
            if not isinstance(leaf, flax_meta.Partitioned):
                return PartitionSpec()
            rules = [*self.axis_rules, *(getattr(leaf, "rules", None) or ())]
            return mesh_spec(PartitionSpec(*leaf.names), rules, mesh, where=f"state leaf {jax.tree_util.keystr(path)}")

        return jax.tree_util.tree_map_with_path(
            spec, self._abstract_boxed, is_leaf=lambda x: isinstance(x, flax_meta.AxisMetadata)
        )

    def variables(self, state: TrainState) -> dict[str, Any]:
        """``state``'s variables for ``module.apply`` (e.g. to evaluate with ``train=False``)."""
        return {"params": state.params, **({"batch_stats": state.batch_stats} if state.batch_stats else {})}

    def step(self, loss_fn: Callable[..., Any]) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
        """``step(state, inputs, *targets) -> (state, metrics)``: applies the module to ``inputs`` (with
        ``train_kwargs``, fresh keys for ``rng_streams``, ``batch_stats`` mutable), takes the gradient of
        ``loss_fn(outputs, *targets)`` (a scalar, or ``(loss, metrics_dict)``) and applies it with ``tx``.
        ``metrics`` is ``{"loss": loss, **metrics_dict}``."""
        train_kwargs = dict(self.train_kwargs)

        def functional(state: TrainState, inputs: Any, *targets: Any) -> tuple[TrainState, dict[str, Any]]:
            rngs = self._stream_keys(jax.random.fold_in(state.key, state.step))
            mutable = ["batch_stats"] if state.batch_stats else False

            def compute(params: Any) -> tuple[jax.Array, tuple[Any, dict[str, Any]]]:
                variables = self.variables(state.replace(params=params))
                outputs = state.apply_fn(variables, inputs, rngs=rngs, mutable=mutable, **train_kwargs)
                outputs, updates = outputs if mutable else (outputs, {})
                result = loss_fn(outputs, *targets)
                loss, aux = result if isinstance(result, tuple) else (result, {})
                return loss, (updates, dict(aux))

            (loss, (updates, aux)), grads = jax.value_and_grad(compute, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads, batch_stats=updates.get("batch_stats", state.batch_stats))
            return state, {"loss": loss, **aux}

        functional.__name__ = functional.__qualname__ = f"functional_{getattr(loss_fn, '__name__', 'loss')}"
        return functional
