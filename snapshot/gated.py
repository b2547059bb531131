"""Actor classes whose every method Ray can reach is gated, and whose private methods it cannot reach at all.

Ray makes every function of an actor's class callable by anyone holding a handle, private ones included (a handle
is one ``ray.get_actor`` away for any driver on the cluster). :func:`gated_actor` (applied before ``ray.remote``)
turns each private method (``_name``, not a dunder) into an :class:`internal` descriptor: the actor's own code
calls it as before (``self._observe(...)``), but Ray's reflection (``inspect.getmembers`` with its
function-or-method test, on the caller's side and in the actor's worker alike) does not see a function there, so
no handle offers it and no task can run it. Each public method must take ``token`` (its gate: the body refuses a
call without the credential); a class with an ungated public method is refused at import.

Ray adds three methods of its own to every actor class. ``__ray_call__`` would run any caller's function inside the
actor (its state, its call keys, the images it holds): a gated class brings its own, which refuses every call
(:class:`ActorAccessError`): no method of a job's actor runs a caller's function (Ray's unpickling of a call's
arguments is another way in, outside what the job promises: ``docs/guides/operating.md``). ``__ray_ready__`` (True)
and ``__ray_terminate__`` (ends the actor, as ``ray.kill`` by any handle's holder would) stay as Ray defines them.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import KeeperAccessError

__all__ = ["ActorAccessError", "gated_actor", "internal", "reachable"]


class ActorAccessError(KeeperAccessError):
    """A call that a gated actor refuses whoever makes it (Ray's ``__ray_call__``)."""


T = TypeVar("T", bound=type)


class internal:
    """A method the actor's own code calls but Ray cannot: not a function on the class, a bound method on an
    instance."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self.fn, obj)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ray_ready(self: Any) -> bool:
    return True


def _ray_call(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Ray's way to run a caller's function inside the actor: refused, whoever calls."""
    raise ActorAccessError(f"{type(self).__name__}.__ray_call__ refused: no code from outside runs in a job's actor")


def _ray_terminate(self: Any) -> None:
    import ray

    ray.actor.exit_actor()


def gated_actor(cls: T) -> T:
    """Hide ``cls``'s private methods from Ray, check that each public method takes ``token``, and make the class
    its own Ray actor class (Ray then adds none of its methods: ``__ray_call__`` here refuses every call)."""
    for name, value in list(vars(cls).items()):
        if not inspect.isfunction(value):
            continue
        if _is_private(name):
            setattr(cls, name, internal(value))
        elif not name.startswith("__") and "token" not in inspect.signature(value).parameters:
            raise TypeError(f"{cls.__name__}.{name} takes no token: every public method of an actor is gated")
    own = {  # what ray.actor._modify_class would have made (it leaves a class that has __ray_actor_class__ alone)
        "__ray_actor_class__": cls,
        "__ray_ready__": _ray_ready,
        "__ray_call__": _ray_call,
        "__ray_terminate__": _ray_terminate,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls)(cls.__name__, (cls,), own)


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
