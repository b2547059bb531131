"""What another job on the same Ray cluster can do without the victim's credential, for the isolation tests: squat
an actor name the victim expects with an actor that records every call (and the credentials they carry) and
answers with a pickle that runs code wherever it is unpickled."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

__all__ = ["Payload", "Squatter", "squat"]


def _mark(path: str) -> None:
    """What the payload runs when unpickled: a file naming the process that unpickled it."""
    Path(path).write_text(str(os.getpid()))


class Payload:
    """A reply whose unpickling writes ``path`` (code of the attacker's choosing run in the reader)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_mark, (self.path,))


@ray.remote(num_cpus=0)
class Squatter:
    """Answers any method of a supervisor or keeper with :class:`Payload`, and records what it was sent."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._received: list[tuple[str, dict[str, Any]]] = []

    def _got(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Payload:
        self._received.append((method, {"args": repr(args)[:200], **{k: str(v) for k, v in kwargs.items()}}))
        return Payload(self._marker)

    def received(self) -> list[tuple[str, dict[str, Any]]]:
        return list(self._received)

    # a keeper's methods
    def node_id(self, *a: Any, **k: Any) -> Payload:
        return self._got("node_id", a, k)

    def latest(self, *a: Any, **k: Any) -> Payload:
        return self._got("latest", a, k)

    def put(self, *a: Any, **k: Any) -> Payload:
        return self._got("put", a, k)

    def steps(self, *a: Any, **k: Any) -> Payload:
        return self._got("steps", a, k)

    def held_bytes(self, *a: Any, **k: Any) -> Payload:
        return self._got("held_bytes", a, k)

    def drop(self, *a: Any, **k: Any) -> Payload:
        return self._got("drop", a, k)

    # a supervisor's methods
    def run_id(self, *a: Any, **k: Any) -> Payload:
        return self._got("run_id", a, k)

    def client_idle_s(self, *a: Any, **k: Any) -> Payload:
        return self._got("client_idle_s", a, k)

    def inject(self, *a: Any, **k: Any) -> Payload:
        return self._got("inject", a, k)

    def close(self, *a: Any, **k: Any) -> Payload:
        return self._got("close", a, k)

    def view(self, *a: Any, **k: Any) -> Payload:
        return self._got("view", a, k)

    def events(self, *a: Any, **k: Any) -> Payload:
        return self._got("events", a, k)

    def wait_for_epoch(self, *a: Any, **k: Any) -> Payload:
        return self._got("wait_for_epoch", a, k)


def squat(name: str, namespace: str, marker: Path) -> Any:
    """A detached :class:`Squatter` under ``name`` in ``namespace`` (as another driver would create it)."""
    actor = Squatter.options(name=name, namespace=namespace, lifetime="detached").remote(str(marker))
    ray.get(actor.__ray_ready__.remote(), timeout=60)
    return actor
