"""Actor classes whose every method Ray can reach is gated, and whose private methods it cannot reach at all.

Ray makes every function of an actor's class callable by anyone holding a handle, private ones included (a handle
is one ``ray.get_actor`` away for any driver on the cluster). :func:`gated_actor` (applied before ``ray.remote``)
turns each private method (``_name``, not a dunder) into an :class:`internal` descriptor: the actor's own code
calls it as before (``self._observe(...)``), but Ray's reflection (``inspect.getmembers`` with its
function-or-method test, on the caller's side and in the actor's worker alike) does not see a function there, so
no handle offers it and no task can run it. Each public method must take ``token`` (its gate: the body refuses a
call without the credential); a class with an ungated public method is refused at import.

Ray's own methods (``__ray_call__``, ``__ray_ready__``, ``__ray_terminate__``) stay: ``__ray_call__`` runs the
caller's code inside the actor, which is outside what a job boundary promises (see the operating guide).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["gated_actor", "internal", "reachable"]

T = TypeVar("T", bound=type)


class internal:  # noqa: N801 - used like ``staticmethod``
    """A method the actor's own code calls but Ray cannot: not a function on the class, a bound method on an
    instance."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self.fn, obj)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def gated_actor(cls: T) -> T:
    """Hide ``cls``'s private methods from Ray and check that each public method takes ``token``."""
    for name, value in list(vars(cls).items()):
        if not inspect.isfunction(value):
            continue
        if _is_private(name):
            setattr(cls, name, internal(value))
        elif not name.startswith("__") and "token" not in inspect.signature(value).parameters:
            raise TypeError(f"{cls.__name__}.{name} takes no token: every public method of an actor is gated")
    return cls


def reachable(actor_class: Any) -> list[str]:
    """The methods of a Ray actor class that a handle offers (Ray's own reflection), Ray's own ``__ray_*__``
    excluded."""
    from ray._private.inspect_util import is_function_or_method

    modified = actor_class.__ray_metadata__.modified_class
    return sorted(
        name
        for name, _ in inspect.getmembers(modified, is_function_or_method)
        if not (name.startswith("__ray") or name == "__init__")
    )
