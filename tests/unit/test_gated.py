"""``gated_actor``: private methods are not functions Ray's reflection sees; an ungated public method is refused."""

from __future__ import annotations

import inspect

import pytest
from ray._private.inspect_util import is_function_or_method

from elastic.snapshot.gated import gated_actor, internal


@gated_actor
class Shell:
    def __init__(self) -> None:
        self.seen: list[str] = []
        self._note("init")

    def ask(self, token: str | None = None) -> list[str]:
        self._note("ask")
        return self.seen

    def _note(self, what: str) -> None:
        self.seen.append(what)


def test_private_methods_are_hidden_from_reflection_and_work_inside():
    visible = {name for name, _ in inspect.getmembers(Shell, is_function_or_method)}
    assert "ask" in visible and "_note" not in visible
    assert isinstance(vars(Shell.__ray_actor_class__)["_note"], internal)
    assert Shell().ask() == ["init", "ask"]


def test_rays_call_is_refused_and_ray_adds_no_method_of_its_own():
    from ray.actor import _modify_class

    from elastic.snapshot.gated import ActorAccessError

    assert _modify_class(Shell) is Shell  # Ray takes the class as its actor class: its own __ray_call__ is not added
    with pytest.raises(ActorAccessError, match="__ray_call__ refused"):
        Shell().__ray_call__(lambda self: self.seen)
    assert Shell().__ray_ready__() is True and Shell.__name__ == "Shell" and Shell.__qualname__ == "Shell"


def test_a_public_method_without_a_token_is_refused_at_import():
    class Open:
        def peek(self) -> int:
            return 1

    with pytest.raises(TypeError, match="takes no token"):
        gated_actor(Open)
