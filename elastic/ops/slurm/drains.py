"""A Slurm drain as a notice: ``scontrol update nodename=N state=drain`` on a node of the job's allocation becomes a
Ray drain of that node's Ray node (with a deadline), which the job's supervisor already reads as a notice for the
slices whose workers run there (:mod:`elastic.supervision.drains`). So a drained node is left at a step boundary,
nothing recomputed, its worker exiting 0; the head (:mod:`elastic.ops.slurm.launch`) no longer counts it as up and
asks for a one-node job to replace it, as for a lost node.

Slurm's drain has no deadline (running jobs go on, no new one starts there): ``deadline_s`` (``elastic slurm run
--drain-deadline``) is the warning the job takes. The head's own node cannot leave (it runs the driver and the Ray
head): its drain is logged, not forwarded.

A SIGTERM to a node's task (``elastic slurm start``) takes the same path: the node asks for it in the job dir
(:meth:`~elastic.ops.slurm.allocation.JobDir.request_leave`, with its deadline) and :meth:`SlurmDrains.leave`
drains its Ray node.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["SlurmDrains", "down", "drained"]

_NODE = re.compile(r"NodeName=(\S+)")
_STATE = re.compile(r"\bState=(\S+)")
_REASON = re.compile(r"\bReason=(.*?)(?: \[|$)")


def drained(scontrol_lines: Iterable[str]) -> dict[str, str]:
    """The nodes ``scontrol -o show node`` lists as draining or drained, each with its reason. Pure."""
    out = {}
    for line in scontrol_lines:
        node, state = _NODE.search(line), _STATE.search(line)
        if node is None or state is None or "DRAIN" not in state.group(1).upper():
            continue
        reason = _REASON.search(line)
        out[node.group(1)] = reason.group(1).strip() if reason else "drained"
    return out


def down(scontrol_lines: Iterable[str]) -> set[str]:
    """The nodes ``scontrol -o show node`` lists as down or failed (``scontrol update state=down``, a slurmd that
    stopped answering): lost to the job before Ray's own health checks say so. Pure."""
    out = set()
    for line in scontrol_lines:
        node, state = _NODE.search(line), _STATE.search(line)
        base = state.group(1).upper().split("+")[0].rstrip("*~#!%$@^-") if state else ""
        if node is not None and base in ("DOWN", "FAIL"):  # its base state (POWERED_DOWN is a flag: not lost)
            out.add(node.group(1))
    return out


class SlurmDrains:
    """Forwards each Slurm drain of a node of the job's Ray cluster (once per node) as a Ray drain."""

    def __init__(self, gcs_address: str, head_node: str, deadline_s: float, log: Any) -> None:
        self._address = gcs_address
        self._head = head_node
        self._deadline_s = deadline_s
        self._log = log
        self.forwarded: dict[str, str] = {}  # Slurm node -> the Ray node drained for it
        self.down: set[str] = set()  # the job's nodes Slurm said were down at the last poll

    def poll(self, nodes: dict[str, str]) -> list[str]:
        """``nodes``: Slurm node name -> its Ray node id, for the job's Ray nodes alive. Returns the Slurm nodes newly
        forwarded; notes those Slurm says are down (``down``). A failing ``scontrol`` is logged and tried again at the
        next poll."""
        fresh = {n: i for n, i in nodes.items() if n not in self.forwarded}
        if not nodes:
            return []
        try:
            found = subprocess.run(
                ["scontrol", "-o", "show", "node", ",".join(sorted(nodes))],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.splitlines()
        except (OSError, subprocess.SubprocessError) as err:
            self._log.warning("slurm_drain_poll_failed", error=str(err)[:200])
            return []
        self.down = down(found)
        done = []
        for node, reason in sorted(drained(found).items()):
            if node not in fresh:
                continue
            if node == self._head:
                self._log.warning("slurm_drain_of_head", node=node, why="the head's node runs the driver: not left")
                self.forwarded[node] = ""
                continue
            if self._drain(fresh[node], f"slurm drain of {node}: {reason}"):
                self.forwarded[node] = fresh[node]
                done.append(node)
                self._log.info("slurm_drain_forwarded", node=node, reason=reason, deadline_s=self._deadline_s)
        return done

    def leave(self, nodes: dict[str, str], requests: dict[str, tuple[float, str]]) -> list[str]:
        """Drain the Ray node of each Slurm node asked to leave (``requests``: node -> (deadline, reason)) by its
        deadline; ``nodes`` as for :meth:`poll`. Returns the nodes drained."""
        done = []
        for node, (deadline, reason) in sorted(requests.items()):
            if node not in nodes or self.forwarded.get(node):
                self._log.info("slurm_leave_skipped", node=node, why="not a Ray node of the job, or drained already")
                continue
            if self._drain(nodes[node], f"{reason} ({node})", deadline=deadline):
                self.forwarded[node] = nodes[node]
                done.append(node)
                self._log.info(
                    "slurm_leave_forwarded", node=node, reason=reason, deadline_s=round(deadline - time.time(), 1)
                )
        return done

    def _drain(self, node_id: str, reason: str, deadline: float | None = None) -> bool:
        from ray.core.generated import autoscaler_pb2

        from elastic.supervision.ray_internals import gcs_client

        gcs = gcs_client(self._address)
        accepted, why = gcs.drain_node(
            node_id,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),  # type: ignore[attr-defined]
            reason,
            int((deadline or time.time() + self._deadline_s) * 1000),
        )
        if not accepted:
            self._log.warning("slurm_drain_refused_by_ray", node_id=node_id, why=str(why)[:200])
        return bool(accepted)
