"""Flax NNX as an elastic job's state: ``init_fn``, ``shardings_fn`` and a functional step from NNX code.

NNX updates modules in place; ``jax.jit`` (hence ``run.jit``) keeps only what a function *returns*, so
an in-place ``train_step(model, optimizer, batch)`` under ``jax.jit`` silently trains nothing.
:class:`NnxAdapter` turns the model and its optimizer into a pure pytree (an ``nnx.State`` holding the
parameters, the optimizer state, every RNG stream and the BatchNorm statistics: all of it snapshotted and
resharded) and the in-place step into ``step(state, *batch) -> (state, out)``::

    adapter = NnxAdapter(
        model_fn=lambda rngs: CNN(rngs=rngs),
        optimizer_fn=lambda model: nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
    )
    job = elastic.ElasticJob(config, init_fn=adapter.init_fn, shardings_fn=adapter.shardings_fn)
    step_fn = run.jit(adapter.step(train_step))  # train_step: the tutorial's, @nnx.jit or not
    state, loss = step_fn(state, x, y)
    model = adapter.module(state)  # the module back, e.g. for eval

Needs flax (``pip install 'jax-elastic[flax]'``). ``run.jit`` calls :func:`check_functional` to refuse the
trap (only once ``flax.nnx`` is imported).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from elastic.errors import ConfigError
from elastic.loop.nnx_check import check_functional

try:
    from flax import nnx
    from flax.core import spmd as flax_spmd
except ImportError as err:  # flax is optional
    raise ConfigError("elastic.api.flax_nnx needs flax: pip install 'jax-elastic[flax]' (flax>=0.12.8)") from err

__all__ = ["AxisRules", "NnxAdapter", "check_functional", "check_rules", "mesh_spec"]

AxisRules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]
"""Annotation axis name -> mesh axis (or axes, or None: replicated), as flax's logical axis rules."""


def check_rules(rules: AxisRules) -> tuple[tuple[str, Any], ...]:
    """``rules`` as a tuple of ``(name, mesh axis or axes or None)`` pairs; ``ConfigError`` otherwise."""
    pairs: tuple[Any, ...] = tuple(tuple(r) if isinstance(r, (tuple, list)) else r for r in rules)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ConfigError(
                f"axis_rules entry {pair!r}: give (annotation name, mesh axis or None) pairs, e.g. [('model', 'local')]"
            )
    return pairs


def mesh_spec(spec: PartitionSpec, rules: AxisRules, mesh: Mesh, *, where: str) -> PartitionSpec:
    """``spec`` with its names mapped through ``rules`` (names without a rule stay), trailing ``None`` dropped
    (``P('x', None)`` and ``P('x')`` would compile twice); ``ConfigError`` for a name ``mesh`` lacks."""
    table = dict(rules)
    entries = [table.get(e, e) if isinstance(e, str) else e for e in spec]
    for entry in entries:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(name, str) and name not in mesh.axis_names:
                raise ConfigError(
                    f"{where} is annotated with axis {name!r}, which the mesh {tuple(mesh.axis_names)} "
                    f"lacks: map it with axis_rules=[({name!r}, 'local'), ...] (or None to replicate)"
                )
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


@dataclass(frozen=True, kw_only=True, eq=False)
class NnxAdapter:
    """An ``nnx.Module`` and its ``nnx.Optimizer`` as a job's state.

    ``model_fn(rngs: nnx.Rngs) -> nnx.Module`` builds the model (``rngs`` is seeded from the job's key:
    streams stored in the model, e.g. by ``nnx.Dropout(rate, rngs=rngs)``, become part of the state);
    ``optimizer_fn(model) -> nnx.Optimizer``. Both must build the same structure on every call.
    ``axis_rules`` maps the names of ``nnx.with_partitioning`` annotations onto mesh axes.
    ``extras_fn(model)``: further NNX objects the step takes after the optimizer (one, or a tuple), e.g. the
    tutorial's ``nnx.MultiMetric``: they are carried in the state too (snapshotted, resharded, restored), and
    ``train_step(model, optimizer, *extras, *args)`` updates them in place like the others.
    """

    model_fn: Callable[[nnx.Rngs], nnx.Module]
    optimizer_fn: Callable[[nnx.Module], nnx.Optimizer]
    axis_rules: AxisRules = ()
    extras_fn: Callable[[nnx.Module], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("model_fn", "optimizer_fn") + (("extras_fn",) if self.extras_fn is not None else ()):
            if not callable(getattr(self, name)):
                raise ConfigError(f"NnxAdapter({name}=...) must be a callable, got {getattr(self, name)!r}")
        object.__setattr__(self, "axis_rules", check_rules(self.axis_rules))

    def _build(self, key: jax.Array) -> tuple[Any, ...]:
        # Annotations are applied by the job when it places the state (jit out_shardings), not eagerly:
        # eager sharding would need a mesh here, and the mesh changes with the healthy slices.
        with nnx.use_eager_sharding(False):
            model = self.model_fn(nnx.Rngs(key))
            if not isinstance(model, nnx.Module):
                raise ConfigError(f"model_fn(rngs) returned {type(model).__name__}: return an nnx.Module")
            optimizer = self.optimizer_fn(model)
            extras = self.extras_fn(model) if self.extras_fn is not None else ()
        if not isinstance(optimizer, nnx.Pytree):
            raise ConfigError(
                f"optimizer_fn(model) returned {type(optimizer).__name__}: return an nnx.Optimizer "
                "(e.g. nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))"
            )
        extras = extras if isinstance(extras, tuple) else (extras,)
        for extra in extras:
            if not isinstance(extra, nnx.Pytree):
                raise ConfigError(
                    f"extras_fn(model) returned {type(extra).__name__}: return NNX objects (an "
                    "nnx.MultiMetric, a module...), one or a tuple"
                )
        return (model, optimizer, *extras)

    @functools.cached_property
    def _abstract(self) -> tuple[nnx.GraphDef, nnx.State]:
        return nnx.split(nnx.eval_shape(lambda: self._build(jax.random.key(0))))

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The static structure of ``(model, optimizer)``: what ``nnx.merge`` pairs with a state."""
        return self._abstract[0]

    def init_fn(self, key: jax.Array) -> nnx.State:
        """The job's ``init_fn``: the ``nnx.State`` of ``(model, optimizer)`` built from ``key``."""
        return nnx.split(self._build(key))[1]

    def shardings_fn(self, mesh: Mesh) -> nnx.State:
        """The job's ``shardings_fn``: one ``PartitionSpec`` per state leaf, from the variables' partitioning
        annotations (``nnx.with_partitioning``, ``sharding_rules`` metadata, ``axis_rules``; the optimizer's
        moments follow their parameters); replicated where there is none."""
        with flax_spmd.logical_axis_rules(tuple(self.axis_rules)):
            specs = nnx.get_partition_spec(self._abstract[1])
        paths = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        fixed = [
            mesh_spec(spec, (), mesh, where=f"state leaf {jax.tree_util.keystr(path)}")  # rules applied above
            for path, spec in paths
        ]
        treedef = jax.tree_util.tree_structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return jax.tree_util.tree_unflatten(treedef, fixed)

    def merge(self, state: nnx.State) -> tuple[Any, ...]:
        """``(model, optimizer, *extras)`` over ``state``'s arrays (new objects; updating them does not change
        ``state``)."""
        return tuple(nnx.merge(self.graphdef, state))

    def extras(self, state: nnx.State) -> tuple[Any, ...]:
        """The ``extras_fn`` objects over ``state``'s arrays (e.g. the metrics, to ``compute()`` them)."""
        return self.merge(state)[2:]

    def module(self, state: nnx.State) -> nnx.Module:
        """The model over ``state``'s arrays, in the mode it was built in (call ``.eval()`` to evaluate)."""
        return self.merge(state)[0]

    def step(self, train_step: Callable[..., Any]) -> Callable[..., tuple[nnx.State, Any]]:
        """``step(state, *args, **kwargs) -> (new_state, out)`` from an in-place
        ``out = train_step(model, optimizer, *extras, *args, **kwargs)`` (plain or ``@nnx.jit``): merge, run, split.
        Pure, so fit for ``run.jit``; ``out`` (e.g. the loss) must hold arrays, not modules."""
        graphdef = self.graphdef

        def functional(state: nnx.State, *args: Any, **kwargs: Any) -> tuple[nnx.State, Any]:
            objects = tuple(nnx.merge(graphdef, state))  # model, optimizer, *extras
            out = train_step(*objects, *args, **kwargs)
            new_graphdef, new_state = nnx.split(objects)
            if new_graphdef != graphdef:
                raise ConfigError(
                    f"{_name(train_step)} changed the structure of the model or optimizer (added or "
                    "removed attributes, or switched train/eval mode): a step may only update values"
                )
            return new_state, out

        # named after train_step, but no ``__wrapped__``: jax must see this signature, not the in-place one's
        functional.__name__ = functional.__qualname__ = f"functional_{getattr(train_step, '__name__', 'step')}"
        return functional


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
