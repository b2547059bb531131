"""The supervisor under many slices' heartbeats, with hung hosts injected. Prints one JSON object.

    .venv/bin/python benchmarks/supervisor_scale.py --json [--slices 1024] [--agents 8] [--failures 20]
        [--interval 0.5] [--timeout 3] [--window 10] [--seed 0] [--per-slice]

One supervisor (``Policy(min_slices=1)``) watches ``--slices`` slices held by ``--agents`` multiplexing
agents (:class:`elastic.supervision.agent.SliceGroupAgent`: one registration and one heartbeat call per interval
for all of its slices). At seeded random times within ``--window`` seconds, ``--failures`` slices stop
heartbeating while their agent lives on (a hung host: only the heartbeat timeout can find it).

* ``detect_*_seconds``: from the moment a slice fell silent to the supervisor's ``health`` event
  marking it unhealthy (both wall clocks of this machine).
* ``supervisor_cpu_fraction``: CPU seconds of the supervisor's process over wall seconds, from the
  first heartbeat round after start-up until every failure was detected.
* ``false_detections``: slices marked unhealthy that never stopped heartbeating (an overloaded
  supervisor reads late heartbeats as silence).

``--per-slice`` sends the per-slice protocol instead (one ``register`` and one ``heartbeat`` call per
slice and interval, what as many :class:`elastic.supervision.agent.SliceAgent` actors would send), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray

from elastic.config import Policy
from elastic.control.cluster import connect
from elastic.log import configure_logging
from elastic.supervision import events
from elastic.supervision.agent import SliceGroupAgent
from elastic.supervision.supervisor import SUPERVISOR_NAME, Supervisor


@ray.remote(num_cpus=0)
class PerSliceMux:
    """The per-slice protocol from one actor: one ``register`` and one ``heartbeat`` call per slice."""

    def __init__(self, slices: dict[int, int], supervisor: Any, interval_s: float, job: str) -> None:
        del job
        self._slices = dict(slices)
        self._supervisor = supervisor
        self._interval_s = interval_s
        self._silent: set[int] = set()
        self._task: asyncio.Task | None = None

    async def start(self) -> list[int]:
        me = ray.get_runtime_context().current_actor
        await asyncio.gather(*(self._supervisor.register.remote(s, i, me) for s, i in self._slices.items()))
        self._task = asyncio.get_running_loop().create_task(self._beat())
        return sorted(self._slices)

    async def _beat(self) -> None:
        while True:
            beats = [(s, i) for s, i in self._slices.items() if s not in self._silent]
            await asyncio.gather(*(self._supervisor.heartbeat.remote(s, i) for s, i in beats), return_exceptions=True)
            await asyncio.sleep(self._interval_s)

    async def lifeline(self, token: str | None = None) -> None:
        await asyncio.Event().wait()

    async def silence(self, slices: list[int] | None = None) -> float:
        self._silent.update(self._slices if slices is None else slices)
        return time.time()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated between the closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def wait_until_lost(supervisor: Any, victims: set[int], deadline: float) -> bool:
    """Long-poll the supervisor's views until none of ``victims`` is active (bounded by ``deadline``)."""
    view = ray.get(supervisor.view.remote(), timeout=30)
    while view.active & victims:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        view = ray.get(supervisor.wait_for_epoch.remote(view.epoch, left), timeout=left + 30)
    return True


@dataclass
class Actors:
    """What this benchmark started, to end it whatever happens."""

    supervisor: Any = None
    agents: list[Any] = field(default_factory=list)

    def kill(self) -> None:
        if self.supervisor is not None:  # it stops logging and removes its log before anything dies
            try:
                ray.get(self.supervisor.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass
        quiet = [agent.silence.remote() for agent in self.agents]  # no heartbeat into a dead supervisor
        ray.wait(quiet, num_returns=len(quiet), timeout=5)
        for actor in [*self.agents, self.supervisor]:
            try:
                if actor is not None:
                    ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass


def run(args: argparse.Namespace, job: str, actors: Actors, run_id: str) -> dict[str, Any]:
    namespace = f"elastic-{job}"
    supervisor = Supervisor.options(name=SUPERVISOR_NAME, namespace=namespace).remote(
        job, Policy(min_slices=1), args.timeout, args.interval / 2, run_id
    )
    actors.supervisor = supervisor
    owner = {s: s % args.agents for s in range(args.slices)}
    kind = PerSliceMux if args.per_slice else SliceGroupAgent
    agents = actors.agents
    for a in range(args.agents):
        slices = {s: 0 for s in range(a, args.slices, args.agents)}
        agents.append(
            kind.options(name=f"agent-{a}", namespace=namespace).remote(slices, supervisor, args.interval, job)
        )
    t0 = time.monotonic()
    ray.get([agent.start.remote() for agent in agents], timeout=120)
    view = ray.get(supervisor.start.remote(), timeout=60)
    startup_s = time.monotonic() - t0
    if len(view.active) != args.slices:
        raise RuntimeError(f"{len(view.active)} of {args.slices} slices active after start-up: {view.reason[:200]}")

    rng = random.Random(args.seed)
    victims = rng.sample(range(args.slices), args.failures)
    offsets = sorted(rng.uniform(0.5, args.window) for _ in victims)
    time.sleep(args.interval)  # one heartbeat round on every agent before the measurement starts
    before = ray.get(supervisor.usage.remote(), timeout=30)
    start = time.monotonic()
    stopped_refs = {}
    for s, offset in zip(victims, offsets, strict=True):
        time.sleep(max(0.0, start + offset - time.monotonic()))
        stopped_refs[s] = agents[owner[s]].silence.remote([s])
    stopped = dict(zip(stopped_refs, ray.get(list(stopped_refs.values()), timeout=30), strict=True))
    all_lost = wait_until_lost(supervisor, set(victims), time.monotonic() + 3 * args.timeout + 10)
    after = ray.get(supervisor.usage.remote(), timeout=30)
    measured_s = time.monotonic() - start
    events = ray.get(supervisor.events.remote(), timeout=60)

    detected: dict[int, float] = {}
    false_detections = set()
    for e in events:
        if e["kind"] != "health" or e["healthy"]:
            continue
        s = e["slice"]
        if s in stopped and e["wall"] >= stopped[s]:
            detected.setdefault(s, e["wall"] - stopped[s])
        elif s not in stopped:
            false_detections.add(s)
    delays = list(detected.values())

    def stat(q: float) -> float | None:  # None (JSON null) when nothing was detected
        return round(percentile(delays, q), 3) if delays else None

    out = {
        "slices": args.slices,
        "agents": args.agents,
        "protocol": "per-slice" if args.per_slice else "batched",
        "failures": args.failures,
        "detected": len(detected),
        "false_detections": len(false_detections),
        "heartbeat_interval_seconds": args.interval,
        "heartbeat_timeout_seconds": args.timeout,
        "monitor_tick_seconds": args.interval / 2,
        "detect_p50_seconds": stat(50),
        "detect_p99_seconds": stat(99),
        "detect_max_seconds": stat(100),
        "supervisor_cpu_fraction": round((after["cpu_s"] - before["cpu_s"]) / measured_s, 4),
        "measured_seconds": round(measured_s, 2),
        "startup_seconds": round(startup_s, 2),
        "events": len(events),
    }
    out["checks"] = {
        "detect_p99<=2*timeout": bool(delays) and out["detect_p99_seconds"] <= 2 * args.timeout,
        "all_failures_detected": all_lost and len(detected) == args.failures,
        "no_false_detections": not false_detections,
    }
    return out


def main() -> None:
    configure_logging(logging.WARNING)  # events on stderr: stdout is the JSON object
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=1024)
    parser.add_argument("--agents", type=int, default=8, help="multiplexing agent actors holding the slices")
    parser.add_argument("--failures", type=int, default=20, help="slices that stop heartbeating")
    parser.add_argument("--interval", type=float, default=0.5, help="heartbeat interval, seconds")
    parser.add_argument("--timeout", type=float, default=3.0, help="heartbeat timeout, seconds")
    parser.add_argument("--window", type=float, default=10.0, help="failures happen within this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-slice", action="store_true", help="one call per slice instead of batched calls")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args()
    if not 0 < args.failures <= args.slices or not 0 < args.agents <= args.slices:
        parser.error("need 0 < --failures <= --slices and 0 < --agents <= --slices")
    if args.timeout <= args.interval:
        parser.error("--timeout must exceed --interval")

    job = f"bench-scale-{uuid.uuid4().hex[:8]}"
    actors = Actors()
    connect()
    try:
        out = run(args, job, actors, events.new_run(job))
    finally:
        actors.kill()
        events.delete(job)
        ray.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
