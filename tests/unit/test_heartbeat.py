"""The one heartbeat of every agent, against a fake supervisor (no Ray)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from elastic.supervision import heartbeat
from elastic.supervision.heartbeat import Heartbeat


class Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeSupervisor:
    """Answers ``forgotten`` slices unknown until they register again; ``failing``: every call fails."""

    def __init__(self, *, asynchronous: bool, forgotten: frozenset[int] = frozenset(), failing: bool = False) -> None:
        self.beats: list[list[tuple[int, int]]] = []
        self.registered: list[tuple[list[tuple[int, int]], Any]] = []
        self.forgotten, self.failing, self.asynchronous = set(forgotten), failing, asynchronous
        self.heartbeats, self.register_slices = Call(self._heartbeats), Call(self._register)

    def _answer(self, value: Any) -> Any:
        if self.failing:
            raise ConnectionError("the supervisor is restarting")
        if not self.asynchronous:
            return value

        async def answer() -> Any:
            return value

        return answer()

    def _heartbeats(self, pairs: list[tuple[int, int]]) -> Any:
        self.beats.append(list(pairs))
        return self._answer(sorted(s for s, _ in pairs if s in self.forgotten))

    def _register(self, pairs: list[tuple[int, int]], agent: Any) -> Any:
        self.registered.append((list(pairs), agent))
        self.forgotten -= {s for s, _ in pairs}
        return self._answer(None)


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


@pytest.fixture(autouse=True)
def _me(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat, "_me", lambda: "me")


def test_a_beat_sends_what_is_due_and_registers_what_the_supervisor_forgot() -> None:
    sup, silenced = FakeSupervisor(asynchronous=True, forgotten={2}), {1}
    beat = Heartbeat(sup, lambda: [(s, 7) for s in (0, 1, 2) if s not in silenced], 0.01, Log())
    asyncio.run(beat.beat())
    assert sup.beats == [[(0, 7), (2, 7)]] and sup.registered == [([(2, 7)], "me")]
    asyncio.run(beat.beat())
    assert sup.registered == [([(2, 7)], "me")]  # known again: no second registration


def test_nothing_due_sends_nothing_and_a_failure_is_logged_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat.ray, "get", lambda value, timeout=None: value)
    sup, log = FakeSupervisor(asynchronous=False, failing=True), Log()
    Heartbeat(sup, lambda: [], 0.01, log).beat_blocking()
    assert sup.beats == [] and log.warnings == []
    Heartbeat(sup, lambda: [(0, 0)], 0.01, log).beat_blocking()
    assert [event for event, _ in log.warnings] == ["heartbeat_failed"]


def test_an_async_heartbeat_beats_on_its_interval_and_stops() -> None:
    sup = FakeSupervisor(asynchronous=True)

    async def run() -> int:
        beat = Heartbeat(sup, lambda: [(0, 0)], 0.01, Log())
        beat.start()
        beat.start()  # once only
        await asyncio.sleep(0.2)
        beat.stop()
        await asyncio.sleep(0.05)
        stopped = len(sup.beats)
        await asyncio.sleep(0.1)
        assert beat.stopped and len(sup.beats) == stopped
        return stopped

    assert asyncio.run(run()) >= 3


def test_a_threaded_heartbeat_beats_on_its_interval_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat.ray, "get", lambda value, timeout=None: value)  # the fake answers plain values
    sup = FakeSupervisor(asynchronous=False, forgotten={0})
    beat = Heartbeat(sup, lambda: [(0, 3)], 0.01, Log())
    beat.start_thread()
    deadline = time.monotonic() + 30
    while len(sup.beats) < 3:
        assert time.monotonic() < deadline, "no beats"
        time.sleep(0.01)
    beat.stop()
    time.sleep(0.1)
    stopped = len(sup.beats)
    time.sleep(0.1)
    assert len(sup.beats) == stopped and sup.registered == [([(0, 3)], "me")]
    assert not [t for t in threading.enumerate() if t.name == "heartbeat" and t.is_alive()]
