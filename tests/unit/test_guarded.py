"""The supervisor's one credential check: ``guarded`` runs the actor's gate on the call's token before the body."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from ray._private.inspect_util import is_function_or_method

from elastic.errors import AccessError
from elastic.snapshot.gated import gated_actor
from elastic.supervision.access import guarded


class Gate:
    def __init__(self) -> None:
        self.checked: list[tuple[Any, str, bool]] = []

    def check(self, token: Any, method: str, *, agents: bool = False, signed_for: str | None = None) -> None:
        self.checked.append((token, signed_for or method, agents))
        if token != "good":
            raise AccessError(f"{method} refused")


@gated_actor
class Guarded:
    def __init__(self) -> None:
        self.gate = Gate()

    @guarded("beat", agents=True)
    async def beat(self, slice_index: int, token: str | None = None) -> int:
        """Beats."""
        return slice_index

    @guarded("close")
    async def close(self, token: str | None = None) -> str:
        return "closed"


def test_guarded_checks_the_token_however_passed_before_the_body_runs() -> None:
    actor = Guarded.__ray_actor_class__()
    assert asyncio.run(actor.beat(3, token="good")) == 3
    assert asyncio.run(actor.beat(4, "good")) == 4  # positional
    with pytest.raises(AccessError, match="close refused"):
        asyncio.run(actor.close())
    assert actor.gate.checked == [("good", "beat", True), ("good", "beat", True), (None, "close", False)]


def test_a_guarded_method_keeps_its_signature_and_stays_a_coroutine_function_for_ray() -> None:
    cls = Guarded.__ray_actor_class__
    assert "token" in inspect.signature(cls.beat).parameters and cls.beat.__doc__ == "Beats."
    assert inspect.iscoroutinefunction(cls.beat)
    assert {"beat", "close"} <= {name for name, _ in inspect.getmembers(cls, is_function_or_method)}
