"""The one NNX check the pass runtime makes: ``run.jit``/``run.guard`` refuse NNX code that ``jax.jit`` would run
with its in-place updates dropped (flax is optional: called only once ``flax.nnx`` is imported).
:mod:`elastic.api.flax_nnx` (the adapter) re-exports :func:`check_functional`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax

from elastic.errors import ConfigError

__all__ = ["check_functional"]

_FIX = (
    "use elastic.api.flax_nnx.NnxAdapter(...).step(train_step) with run.jit (it merges, runs and splits the "
    "module inside the jit; further NNX objects the step takes, metrics..., go into the state with "
    "NnxAdapter(extras_fn=...)), or pass the @nnx.jit function to run.guard with every object it takes merged "
    "from run.state in each pass"
)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _nnx_transform(fn: Any) -> Any | None:
    """The NNX-transformed function (``nnx.jit``) ``fn`` is, or wraps (``functools.wraps``, ``jax.jit``)."""
    seen = 0
    while fn is not None and seen < 8:
        if isinstance(fn, (_compilation().JitWrapped, _compilation().SimpleJitWrapped)):
            return fn
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


def _graph_nodes(args: Iterable[Any]) -> list[str]:
    is_node = lambda x: isinstance(x, _nnx().Pytree)  # noqa: E731 - Module, Optimizer, Rngs, streams, metrics
    found = []
    for i, arg in enumerate(args):
        for leaf in jax.tree_util.tree_leaves(arg, is_leaf=is_node):
            if is_node(leaf):
                found.append(f"argument {i}: {type(leaf).__name__}")
    return found


def check_functional(
    fn: Any, args: tuple[Any, ...] | None = None, kwargs: Mapping[str, Any] | None = None, *, where: str = "run.jit"
) -> bool:
    """Refuse (``ConfigError``) NNX code that ``jax.jit`` would run with its in-place updates dropped: ``fn``
    an ``nnx.jit`` function given to ``run.jit`` (``args is None``), or a ``jax.jit`` function called with NNX
    graph nodes (``nn.Module``, ``nnx.Optimizer``, ``nnx.Rngs``...) in ``args``/``kwargs``. True when ``fn`` is
    itself an NNX transform (it keeps its updates: nothing to check)."""
    transform = _nnx_transform(fn)
    if args is None:
        if transform is not None:
            raise ConfigError(
                f"{where} got {_name(fn)}, an nnx.jit function: jax.jit would drop its in-place "
                f"updates to the model and optimizer and silently train nothing; {_FIX}"
            )
        return False
    if transform is not None:
        return True
    nodes = _graph_nodes([*args, *(kwargs or {}).values()])
    if nodes:
        raise ConfigError(
            f"{where}: {_name(fn)} was called with NNX graph nodes ({', '.join(nodes[:4])}): under "
            f"jax.jit their in-place updates are dropped and nothing trains; {_FIX}"
        )
    return False


def _nnx() -> Any:
    from flax import nnx

    return nnx


def _compilation() -> Any:
    from flax.nnx.transforms import compilation

    return compilation
