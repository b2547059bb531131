"""The one seam between the controller and where a slice's devices live.

The controller (:mod:`elastic.control.controller`) runs the same state machine, decisions, accounting, event
stream and report in both modes. What differs sits behind :class:`Placement`:

* :class:`elastic.placements.local.LocalPlacement`: every slice's devices are in this process (single-process
  mode, as with Pathways; simulated slices on CPU in tests);
* :class:`elastic.placements.processes.ProcessPlacement`: each slice is a worker process on its host, joined
  by ``jax.distributed``; the user's loop runs SPMD in every worker.

A placement forms the mesh (or the group) over a view, puts the state on it (moved, restored from a tier, or
initialised), runs one pass of the user's loop, probes slices after a failure, and hands back the final state.
Everything it learns that the controller accounts for comes back as data (:class:`Placed`, :class:`PassEnd`)
or through the :class:`PlacementHost` the controller gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from elastic import runtime
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.control.report import PlacementFigures
from elastic.supervision.membership import View

__all__ = ["JobMode", "PassEnd", "Placed", "Placement", "PlacementHost", "PrepareHook"]

PrepareHook = Callable[[str, int, View], None]  # (phase: "restore" | "reshard" | "grow", step, view)


@dataclass(frozen=True, kw_only=True)
class Placed:
    """The state is in place over a view, and how it got there.

    ``how``: ``"moved"`` (the live state moved at a step boundary), ``"restored"`` (from a snapshot tier) or
    ``"fresh"`` (initialised: nothing was saved anywhere). A restore names its ``tier``, ``generation``,
    ``source`` (``copies`` or ``staged``), the device shards it kept in place, how long it waited for a snapshot
    in flight, and the snapshot's ``meta`` (the ledger as runs, the loop's extras, the clients' pids).
    """

    how: Literal["moved", "restored", "fresh"]
    step: int
    tier: str | None = None
    generation: int = 0
    source: str = "copies"
    shards_kept: int = 0
    waited_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)  # mode-specific figures, added to the timeline


@dataclass(frozen=True, kw_only=True)
class PassEnd:
    """A pass that ended without an error: the loop returned (``regroup`` None), or it stopped at a step
    boundary because the view changed (``regroup``: the new view; ``live``: the state at the boundary was
    kept, so it moves instead of being restored), or because the job stops (``stopped_at``: the boundary's step,
    the next one to run; ``persisted``: the step saved to the Orbax tier there, None without one)."""

    regroup: View | None = None
    live: bool = False
    value: Any = None  # what the loop returned
    stopped_at: int | None = None
    persisted: int | None = None
    suspended_at: int | None = None  # the job is suspended (``kept``: the step its keepers hold, None: not saved)
    kept: int | None = None


class PlacementHost(Protocol):
    """What a placement may ask of the controller: the job's accounting and its per-step hooks."""

    def on_commit(self, step: int, batch: int, metrics: dict[str, Any], view: View, run: Any) -> None:
        """A step was committed (once per step, in order, in the process that drives the job)."""

    def before_step(self, step: int) -> None:
        """A step is about to start (fault injection, the stall reporter)."""

    def snapshot_meta(self, extras: dict[str, Any]) -> dict[str, Any]:
        """The controller's state for a snapshot taken now: the ledger as runs, ``extras``, the clients' pids."""

    @property
    def stopping(self) -> str | None:
        """Why the job stops at the next step boundary it can reach (``ElasticJob.stop``); None while it runs on."""

    @property
    def suspending(self) -> str | None:
        """Why the job is suspended at the next step boundary (its pool took every slice; single-process mode)."""

    @property
    def view(self) -> View:
        """The newest membership view (no remote call)."""


class Placement(Protocol):
    def standby_ready(self, view: View) -> bool | None:
        """Whether the step is compiled ahead for ``view``'s mesh (None: nothing was recorded to compile)."""

    def prepare(self, view: View, *, live: bool, during: PrepareHook) -> Placed:
        """Put the state on a mesh over ``view``: moved (``live``, at a step boundary), restored, or fresh.
        ``during`` runs inside a move or restore, its transfers dispatched and not yet landed (chaos)."""

    def run_pass(self, loop: Callable[..., Any], host: PlacementHost) -> PassEnd:
        """One pass of ``loop`` over the prepared state; raises what broke it (a slice-loss error, a hung step,
        or the loop's own error)."""

    def drop(self) -> None:
        """Forget the live state (after a failure it may sit on lost devices): the next prepare restores."""

    def probe(
        self, slices: frozenset[int], timeout_s: float | None, *, early: Callable[[frozenset[int]], None] | None = None
    ) -> frozenset[int]:
        """Which of ``slices`` do not answer within ``timeout_s`` (dead). ``early``, when given, is called once
        with the slices known dead before the others' answers are awaited (none: not called), so that the caller
        can act on them meanwhile; the result includes them."""

    def lost(self, slices: frozenset[int]) -> tuple[dict[int, int] | None, bool]:
        """For a report of ``slices`` as lost: the agent incarnation of each that was seen failing (None: the
        newest), and whether their hardware is suspect (no new agent is started for them by respawning)."""

    def replaced(self, slices: frozenset[int], lost: dict[int, int] | None) -> frozenset[int]:
        """Which of these lost slices already have a newer agent than the one ``lost`` named (a replacement
        process): a view holding them is a view without the lost agent."""

    def final_state(self) -> Any:
        """The state after the last committed step."""

    def save_final(self, path: str) -> None:
        """Write the final state to ``path`` (a new directory) as an Orbax checkpoint, each shard by its holder."""

    def snapshot_stats(self) -> dict[str, Any]:
        """The snapshot counters as last known: ``blocking_seconds``, ``snapshots_taken``, ``held_bytes``."""

    def figures(self) -> PlacementFigures:
        """The placement's figures for the report (snapshot tiers, standby compiles, mode-specific counts), once
        what is in flight is done (``report.fill_report`` puts them in)."""

    def wait_for_standbys(self, timeout: float) -> bool:
        """Until the standby compiles asked for so far are done (tests and benchmarks)."""

    def close(self) -> None:
        """Release what the placement holds (threads, processes)."""


class JobMode(Protocol):
    """What a job asks of its mode for its whole life (``elastic.placements.modes.for_job`` makes one): the slices'
    topology, the mesh checks, the agents, the snapshot tiers the job keeps, and a :class:`Placement` per run."""

    multi: bool  # multi-process mode (a worker process per slice)
    topology: runtime.Topology

    def check_meshes(self) -> None:
        """``ConfigError`` naming the first state leaf that does not split over the mesh of some size the job may
        shrink to (``min_slices`` to ``num_slices``), where this process can build that mesh."""

    def agents(self, token: str) -> Any:
        """The agent factory of the job's slices (None: the supervisor's default agents); ``ConfigError`` when the
        cluster cannot hold them. ``token``: the job's credential."""

    def start_tiers(self, group: ActorGroup, accounting: Accounting) -> None:
        """Ask for the job's keepers (and persistent tier) without waiting for them; once the job is this
        client's (a client refused at launch never touches another client's keepers)."""

    def ready(self) -> None:
        """Until the tiers ``start_tiers`` asked for answer."""

    def snapshot_stats(self) -> dict[str, Any]:
        """The snapshot counters before any run placed the state (``Placement.snapshot_stats`` once one did)."""

    def last_completed(self) -> tuple[int, str] | None:
        """(step, deepest tier) of the newest complete snapshot this process knows of (None: none)."""

    def latest_snapshot(self) -> Any:
        """The newest complete in-memory snapshot (``ElasticError`` where the driver holds none)."""

    def snapshots(self) -> Any:
        """The in-memory snapshot tier (a drill's handle; None where the driver holds none)."""

    def keepers(self) -> Any:
        """The job's keeper client, where the driver keeps one apart from its tiers (None otherwise)."""

    def placement(self, *, group: Callable[[], ActorGroup], accounting: Accounting) -> Placement:
        """A placement for one run."""

    def close(self) -> None:
        """Release the tiers (keepers killed: a clean end needs them no more)."""

    def release(self, *, owned: bool) -> None:
        """After the job's actors are gone: give back what the job took of this process (``owned``: the job was
        this client's; a client refused at launch leaves the slices alone)."""
