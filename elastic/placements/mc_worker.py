"""The worker of a multi-controller job: one Ray actor, hence one process, per slice.

The driver (:mod:`elastic.placements.mc_driver`) hands every member of a group a :class:`GroupPlan` through
``run_group``. The worker joins that group's ``jax.distributed`` runtime (leaving the previous one in place:
same process, no restart), builds the mesh over all the group's devices, restores the state (fresh from
``init_fn``, or from the host snapshot at ``plan.start_step``: its own shards, missing ones asked from the peers
that hold them), and runs the user's loop SPMD with an :class:`elastic.placements.mc_run.McRun`. Every ``snapshot_every``
steps (and at each pass's start and boundary) it copies its shards into host memory and sends that generation
to its buddy, the next member of the group, worker to worker (an actor call: the copy lives in the buddy's
process, never in the driver, and the receiver copies it out of the object store, whose object dies with its
sender). A collective broken by a dead peer (:func:`runtime.distributed.is_peer_loss`) ends the pass with status
``failed``: the worker leaves the group and waits for the driver's next plan. The actor is threaded, so the
driver's progress polls, stop requests and the peers' buddy copies are served while the loop runs.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import ray
from jax.sharding import NamedSharding, PartitionSpec

from elastic.placements.mc_run import Aborted, Boundary, McRun
from elastic.placements.mc_snapshots import Generation, HostSnapshots, Region, region_of, take
from elastic.placements.mc_store import NodeStore
from elastic.control.report import Ledger
from runtime import distributed
from runtime.mesh import default_mesh

__all__ = ["GroupPlan", "SliceWorker"]

FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Group ``epoch``: ``members`` (slices, in process order) served at ``address``; start fresh
    (``start_step`` None) or from the host snapshot at ``start_step``; ``peers``: every member's actor."""

    epoch: int
    address: str
    members: tuple[int, ...]
    start_step: int | None
    peers: dict[int, Any]
    rendezvous_timeout_s: int = 5


class SliceWorker:
    """One slice's process. Wrapped by the driver with ``ray.remote(max_concurrency=...)``."""

    def __init__(self, slice_index: int, *, init_fn: Callable[[jax.Array], Any], loop: Callable[[McRun], Any],
                 num_steps: int, snapshot_every: int, seed: int = 0,
                 shardings_fn: Callable[[Any], Any] | None = None, store_root: str | None = None) -> None:
        self.slice = slice_index
        self._init_fn, self._loop, self._shardings_fn = init_fn, loop, shardings_fn
        self._num_steps, self._every, self._seed = num_steps, snapshot_every, seed
        # With a node store, generations live in files on this node that outlive this process; a new process
        # for this slice on this node takes over what its predecessor left there.
        self._snaps = HostSnapshots(keep=2, store=NodeStore(store_root, slice_index) if store_root else None)
        self._snaps.adopt()
        self._lock = threading.Lock()
        self._epoch = -1
        self._aborted = threading.Event()  # set when the driver aborted the current pass
        self._ended: threading.Event | None = None  # set when the current pass ended or was aborted
        self._stop_at: dict[int, int] = {}  # epoch -> the step the group stops before
        self._next_step = 0
        self._snapshot_seconds = 0.0
        self._snapshots = 0

    # -- served while the loop runs -----------------------------------------------------------------
    def where(self) -> tuple[int, str]:
        """This worker's process id and Ray node id."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def progress(self) -> dict[str, int]:
        return {"epoch": self._epoch, "next_step": self._next_step, "pid": os.getpid()}

    def request_stop(self, epoch: int, step: int) -> bool:
        """Stop group ``epoch`` before ``step`` (a step boundary). False if this worker is past it already."""
        with self._lock:
            self._stop_at[epoch] = step
            return not (self._epoch == epoch and self._next_step > step)

    def hold(self, slice_index: int, gen: Generation) -> None:
        self._snaps.add_buddy(slice_index, gen)

    def held(self) -> dict[int, dict[str, Any]]:
        return self._snaps.held()

    def piece(self, step: int, leaf: int, region: Region) -> np.ndarray | None:
        return self._snaps.find(step, leaf, region)

    def meta(self, step: int) -> dict[str, Any] | None:
        return self._snaps.meta(step)

    # -- one pass of the loop over one group ---------------------------------------------------------
    def run_group(self, plan: GroupPlan) -> dict[str, Any]:
        out: dict[str, Any] = {"slice": self.slice, "pid": os.getpid(), "epoch": plan.epoch, "executed": 0}
        with self._lock:
            self._epoch = plan.epoch
            self._aborted = aborted = threading.Event()  # this pass's: an abandoned thread keeps seeing its own
            self._ended = ended = threading.Event()
        index = plan.members.index(self.slice)
        out["snapshots"], out["snapshot_seconds"] = self._snapshots, self._snapshot_seconds
        try:
            out["reform_seconds"] = distributed.reform(plan.address, len(plan.members), index,
                                                       timeout_s=plan.rendezvous_timeout_s)
        except Exception as err:  # noqa: BLE001 - a member died before the group formed: this one lives on
            out.update(status="failed", step=self._next_step, failed_at=time.time(), reform_seconds=None,
                       error=f"the rendezvous of group {plan.epoch} failed: {type(err).__name__}: {str(err)[:200]} "
                             f"{distributed.GROUP_ERRORS[-1:]}",
                       traceback=traceback.format_exc()[-2000:], leave_seconds=distributed.leave())
            return out
        failure: dict[str, Any] = {}

        def body() -> None:
            try:
                self._pass(plan, index, out, aborted)
            except Aborted:
                pass
            except Exception as err:  # noqa: BLE001 - classified: a dead peer is recovered, the rest reported
                failure.update(status="failed" if distributed.is_peer_loss(err) else "error", step=self._next_step,
                               failed_at=time.time(), error=f"{type(err).__name__}: {str(err)[:400]}",
                               traceback=traceback.format_exc()[-2000:])
            finally:
                ended.set()

        # The pass runs on its own thread so that abort() can end it while a collective is stuck on a dead peer
        # (gloo notices only on its timeout): that thread is abandoned, and ends by itself on the timeout.
        thread = threading.Thread(target=body, name=f"pass-{plan.epoch}", daemon=True)
        thread.start()
        ended.wait()
        if aborted.is_set():
            out.update(status="failed", step=self._next_step, failed_at=time.time(), aborted=True,
                       error="aborted: the driver saw a member of the group lost")
        else:
            thread.join()
            out.update(failure)
        # Unless abandoned, the pass's arrays and executables are unreachable now, so leave() destroys the
        # backend at once; an abandoned pass keeps its backend until its collective times out.
        out["leave_seconds"] = distributed.leave()
        out["snapshots"], out["snapshot_seconds"] = self._snapshots, self._snapshot_seconds
        return out

    def abort(self, epoch: int) -> bool:
        """End group ``epoch``'s pass now (a member was lost): ``run_group`` returns ``failed`` at once, and the
        pass's thread records nothing more. False if this worker is not in that group's pass."""
        with self._lock:
            if self._epoch != epoch or self._ended is None or self._ended.is_set():
                return False
            self._aborted.set()
            self._ended.set()
            return True

    def _pass(self, plan: GroupPlan, index: int, out: dict[str, Any], aborted: threading.Event) -> None:
        """One pass over the group: restore, run the user's loop, fill ``out``. Raises what broke it."""
        start = time.monotonic()
        mesh = self._mesh(len(plan.members))
        state, ledger = self._restore(plan, mesh)
        out["restore_seconds"] = time.monotonic() - start
        first = plan.start_step or 0
        self._next_step = first
        self._snapshot(first, state, ledger, plan)
        commits: list[float] = []

        def on_commit(step: int, new_state: Any, metrics: dict[str, Any]) -> None:
            with self._lock:  # abort() waits for a commit in progress; none starts after it
                if aborted.is_set():
                    raise Aborted(f"group {plan.epoch} was aborted at step {step}")
                self._commit(step, new_state, metrics, ledger, commits, out, plan)

        run = McRun(mesh=mesh, state=state, start_step=first, num_steps=self._num_steps, seed=self._seed,
                    epoch=plan.epoch, on_commit=on_commit, stop_before=lambda s: self._stops_before(plan, s),
                    aborted=aborted.is_set)
        del state
        try:
            result = self._loop(run)
            out.update(status="finished", step=self._num_steps, ledger=ledger.to_meta())
            if index == 0:
                out["params"] = _host_copy(result if result is not None else run.state)
        except Boundary as boundary:
            with self._lock:
                if aborted.is_set():
                    raise Aborted(f"group {plan.epoch} was aborted at its boundary") from None
                self._snapshot(boundary.step, run.state, ledger, plan)
            out.update(status="regroup", step=boundary.step)
        out["first_commit_at"] = commits[0] if commits else None

    def _commit(self, step: int, new_state: Any, metrics: dict[str, Any], ledger: Ledger, commits: list[float],
                out: dict[str, Any], plan: GroupPlan) -> None:
        ledger.commit(step, step)
        commits.append(time.time())
        out["executed"] += 1
        if "loss" in metrics:
            out["final_loss"] = float(metrics["loss"])
        self._next_step = step + 1
        if (step + 1) % self._every == 0 and step + 1 < self._num_steps:
            self._snapshot(step + 1, new_state, ledger, plan)

    def _stops_before(self, plan: GroupPlan, step: int) -> bool:
        with self._lock:
            stop = self._stop_at.get(plan.epoch)
        return stop is not None and step >= stop

    def _mesh(self, num_processes: int) -> Any:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        return default_mesh([[d for d in devices if d.process_index == p] for p in range(num_processes)])

    def _shardings(self, mesh: Any, abstract: Any) -> Any:
        if self._shardings_fn is None:
            return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract)
        specs = self._shardings_fn(mesh)
        return jax.tree_util.tree_map(
            lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, s), specs,
            is_leaf=lambda s: isinstance(s, (PartitionSpec, NamedSharding)))

    def _restore(self, plan: GroupPlan, mesh: Any) -> tuple[Any, Ledger]:
        key = jax.random.key(self._seed)
        abstract = jax.eval_shape(self._init_fn, key)
        shardings = self._shardings(mesh, abstract)
        ledger = Ledger()
        if plan.start_step is None:
            return jax.jit(self._init_fn, out_shardings=shardings)(key), ledger
        step = plan.start_step
        meta = self._snaps.meta(step) or self._ask(plan, lambda peer: peer.meta.remote(step), f"meta of step {step}")
        ledger.steps, ledger.batches = Ledger.expand(meta["ledger"])
        leaves, treedef = jax.tree_util.tree_flatten(abstract)
        arrays = []
        for i, (leaf, sharding) in enumerate(zip(leaves, treedef.flatten_up_to(shardings), strict=True)):
            def part(index: tuple[slice, ...], i: int = i, shape: tuple[int, ...] = leaf.shape) -> np.ndarray:
                region = region_of(index, shape)
                got = self._snaps.find(step, i, region)
                if got is None:
                    got = self._ask(plan, lambda peer: peer.piece.remote(step, i, region), f"leaf {i} {region}")
                return np.array(got, copy=True)  # the runtime's own buffer, never a view of a snapshot

            arrays.append(jax.make_array_from_callback(leaf.shape, sharding, part))
        return jax.tree_util.tree_unflatten(treedef, arrays), ledger

    def _ask(self, plan: GroupPlan, call: Callable[[Any], Any], what: str) -> Any:
        """The first answer that is not None from the group's other members (bounded per peer)."""
        for slice_index, peer in plan.peers.items():
            if slice_index == self.slice:
                continue
            try:
                got = ray.get(call(peer), timeout=FETCH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a peer gone meanwhile: ask the next
                continue
            if got is not None:
                return got
        raise RuntimeError(f"no member of group {plan.epoch} holds the {what} of step {plan.start_step}")

    def _snapshot(self, step: int, state: Any, ledger: Ledger, plan: GroupPlan) -> None:
        start = time.monotonic()
        gen = take(step, state, {"ledger": ledger.to_meta()})
        self._snaps.add_own(gen)
        members = plan.members
        if len(members) > 1:  # the buddy: the next member; the call returns at once, the copy is its own
            buddy = members[(members.index(self.slice) + 1) % len(members)]
            plan.peers[buddy].hold.remote(self.slice, gen)
        self._snapshots += 1
        self._snapshot_seconds += time.monotonic() - start


def _host_copy(state: Any) -> Any:
    """The fully replicated leaves of ``state`` as numpy (for checking against a reference)."""
    return jax.tree_util.tree_map(
        lambda x: np.array(x.addressable_shards[0].data) if x.is_fully_replicated else None, state)
