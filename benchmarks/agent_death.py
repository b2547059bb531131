"""How soon the supervisor publishes a view without a dead agent's slices, for an agent of many slices against an
agent of one (the baseline, in the same run). Prints one JSON object.

    .venv/bin/python benchmarks/agent_death.py --json [--slices 32] [--runs 5]

Each run starts one supervisor and two :class:`elastic.supervision.agent.SliceGroupAgent` actors of ``--slices``
slices each (then of one slice each, for the baseline), kills one agent with ``ray.kill`` and times, from the kill,
until ``wait_for_epoch`` returns the view without its slices. The heartbeat timeout (5 s) is far off: the agent's
lifeline call is what fails.

* ``many_seconds`` / ``one_seconds``: per run, for the agent of ``--slices`` slices and for the agent of one.
* ``ratio``: the median of the first over the median of the second. Before the supervisor wrote a dead agent's
  records together (two per slice), each slice added a round trip to the GCS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray

from elastic.config import Policy
from elastic.control.cluster import connect
from elastic.log import configure_logging
from elastic.supervision import events
from elastic.supervision.agent import SliceGroupAgent
from elastic.supervision.supervisor import SUPERVISOR_NAME, Supervisor

TIMEOUT_S, INTERVAL_S = 5.0, 0.2


def once(slices: int) -> float:
    """Seconds from killing an agent of ``slices`` slices to the view without them."""
    job = f"agent-death-{uuid.uuid4().hex[:8]}"
    namespace = f"elastic-{job}"
    sup = Supervisor.options(name=SUPERVISOR_NAME, namespace=namespace).remote(
        job, Policy(min_slices=1), TIMEOUT_S, INTERVAL_S / 2, events.new_run(job)
    )
    agents = [
        SliceGroupAgent.options(namespace=namespace).remote(
            {s: 0 for s in range(a, 2 * slices, 2)}, sup, INTERVAL_S, job
        )
        for a in range(2)
    ]
    try:
        ray.get([agent.start.remote() for agent in agents], timeout=60)
        view = ray.get(sup.start.remote(), timeout=60)
        ray.get(sup.wait_for_epoch.remote(view.epoch, 2 * INTERVAL_S), timeout=30)  # a few beats in: steady
        started = time.monotonic()
        ray.kill(agents[0], no_restart=True)
        view = ray.get(sup.wait_for_epoch.remote(view.epoch, 4 * TIMEOUT_S), timeout=4 * TIMEOUT_S + 30)
        took = time.monotonic() - started
        if view.active != frozenset(range(1, 2 * slices, 2)):
            raise RuntimeError(f"unexpected view after the kill: {view}")
        return took
    finally:
        ray.get(sup.close.remote(), timeout=30)
        for actor in [*agents, sup]:
            ray.kill(actor, no_restart=True)
        events.delete(job)


def main() -> None:
    configure_logging(logging.WARNING)  # events on stderr: stdout is the JSON object
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=32, help="slices of the agent that dies")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the JSON object only (the default too)")
    args = parser.parse_args()
    if args.slices < 1 or args.runs < 1:
        parser.error("--slices and --runs must be at least 1")
    connect()
    many, one = [], []
    for _ in range(args.runs):  # alternated: the machine's drift touches both alike
        many.append(once(args.slices))
        one.append(once(1))
    out = {
        "slices": args.slices,
        "runs": args.runs,
        "many_seconds": [round(x, 4) for x in many],
        "one_seconds": [round(x, 4) for x in one],
        "ratio": round(statistics.median(many) / statistics.median(one), 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
