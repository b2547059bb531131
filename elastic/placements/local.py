"""Single-process mode: every slice's devices are in this process (Pathways; simulated slices on CPU in tests).

The mesh of a view is built over the healthy slices' devices; the state is moved there device to device at a
step boundary, restored from the job's tiers (:class:`~elastic.control.tiers.TierSet`: the survivors' host
copies, the keepers, Orbax) after a failure, or initialised. The loop runs here, each dispatch through the
runtime's guard (a simulated slice's loss raises where a real one would). The step is compiled ahead for every
mesh one slice loss away and for the grow-back mesh (:class:`runtime.StandbyCompiler`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.placement import PassEnd, Placed, PlacementHost, PrepareHook
from elastic.control.report import PlacementFigures
from elastic.control.tiers import TierSet
from elastic.loop.host import PassHost
from elastic.loop.run import LiveState, Regroup, Run
from elastic.supervision.membership import View
from elastic.supervision.notices import move_bound

__all__ = ["LocalPlacement"]


class LocalPlacement:
    def __init__(
        self,
        config: ElasticConfig,
        *,
        topology: runtime.Topology,
        mesh_fn: runtime.MeshFn | None,
        shardings: Callable[[Mesh], Any],
        init_fn: Callable[[jax.Array], Any],
        tiers: TierSet,
        initial_state: Callable[[Any], Any] | None = None,
        init_step: int = 0,
    ) -> None:
        self.config = config
        self._topology = topology
        self._mesh_fn = mesh_fn
        self._shardings = shardings
        self._init_fn = init_fn
        self._tiers = tiers
        self._initial_state = initial_state  # shardings -> the state at step 0 (None: init_fn's)
        self._init_step = init_step  # the step a fresh start begins at (an Orbax checkpoint's)
        self._live: LiveState | None = None
        self._prepared: tuple[View, Mesh, Any, int, dict[str, Any]] | None = None  # a pass's view, mesh, state...
        self._state: Any = None  # the newest state of the last pass (its final state at the end)
        self._active = 0  # how many slices the state was last placed on (a move onto more is a grow)
        self._fresh = False  # the prepared state is initialised: snapshot it as step 0 before the loop runs
        self._soon = False  # restored: snapshot again at the first commit
        self._prepared_for: int | None = None  # the epoch standbys were last prepared for
        # a restore lands in the dropped state's buffers (runtime.landing)
        self._lands = runtime.landing_pays(d for s in topology.slices for d in s.devices)
        self._newest: Any = None  # the newest committed state of the last pass, confirmed or not
        self._spare: list[jax.Array] = []  # the dropped buffers the last landing did not need, until its first step
        self._dropped: Any = None  # the state live at the last failure, until a restore lands in it
        self._standby = runtime.StandbyCompiler(max_meshes=config.num_slices + 1)
        self._standby.warm(lambda: runtime.warm_probes(topology.slices))

    def _mesh(self, view: View) -> Mesh:
        return runtime.build_mesh(self._topology.select(view.active), self._mesh_fn)

    @property
    def _wait_s(self) -> float | None:
        """The bound on moving, restoring or initialising the state (as long as a pass's first step)."""
        return self.config.step_wait_s(first=True)

    # -- the seam -------------------------------------------------------------------------------
    def standby_ready(self, view: View) -> bool | None:
        return self._standby.ready(self._mesh(view))

    def prepare(self, view: View, *, live: bool, during: PrepareHook) -> Placed:
        mesh = self._mesh(view)
        shardings = self._shardings(mesh)
        devices = tuple(mesh.devices.flat)
        moving, self._live = self._live, None
        before, self._active = self._active, len(view.active)
        self._prepared = self._state = self._newest = None
        self._fresh = self._soon = False
        if live and moving is not None:
            moved = runtime.guarded(runtime.reshard, devices)(moving.state, shardings)
            during("grow" if len(view.active) > before else "reshard", moving.next_step, view)
            bound = move_bound(self._wait_s, view.notices, time.time())  # off leaving slices: by their deadline
            state = runtime.wait_ready(moved, devices, timeout_s=bound, what=f"the move onto epoch {view.epoch}")
            self._prepared = (view, mesh, state, moving.next_step, moving.extras)
            return Placed(how="moved", step=moving.next_step)
        dst = self._landing(shardings)
        if dst is None:  # the failed pass's leftovers are freed before the restore allocates anew
            runtime.flush_releases()
        # Guarded like any transfer onto the view's devices: a view that is already stale (a slice in it lost too)
        # fails like a lost slice and is recovered from, not taken for tiers that cannot restore.
        restored = runtime.guarded(self._tiers.restore, devices)(
            shardings, devices, epoch=view.epoch, borrow=dst is not None
        )
        if restored is None:
            if self._initial_state is not None:
                state = runtime.guarded(self._initial_state, devices)(shardings)
            else:
                init = runtime.guarded(jax.jit(self._init_fn, out_shardings=shardings), devices)
                state = init(jax.random.key(self.config.seed))
            state = runtime.wait_ready(state, devices, timeout_s=self._wait_s, what="the initial state")
            self._fresh = True
            self._prepared = (view, mesh, state, self._init_step, {})
            return Placed(how="fresh", step=self._init_step)
        state, why = restored.state, ""
        if restored.borrowed:  # it aliases the snapshot: copy it into the dropped state's buffers, or fresh ones
            assert dst is not None
            state, why, self._spare = self._land(dst, state, restored.kept, devices)
        del dst
        during("restore", restored.step, view)
        state = runtime.wait_ready(
            state,
            devices,
            timeout_s=self._wait_s,  # the copies have landed
            what=f"the restore of step {restored.step}",
        )
        # The restored generation lost its copies on the dead slices: snapshot again at the first commit
        # (after the first step, off its path), so every piece regains its copies on the survivors.
        self._soon = True
        self._prepared = (view, mesh, state, restored.step, copy.deepcopy(restored.meta["extras"]))
        return Placed(
            how="restored",
            step=restored.step,
            tier=restored.tier,
            generation=restored.generation,
            source=restored.source,
            shards_kept=restored.shards_kept,  # landed or not, a shard kept in place was not copied
            meta=restored.meta,
            waited_s=round(self._tiers.last_wait_seconds, 3),
            detail=({"landed": not why} | ({"not_landed": why} if why else {})) if restored.borrowed else {},
        )

    def run_pass(self, loop: Callable[..., Any], host: PlacementHost) -> PassEnd:
        assert self._prepared is not None, "run_pass before prepare"
        view, mesh, state, start, extras = self._prepared
        self._prepared = None
        epoch = view.epoch

        def save(next_step: int, state: Any, extras: dict[str, Any]) -> None:
            self._tiers.save(next_step, state, host.snapshot_meta(copy.deepcopy(extras)))

        def on_commit(run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None:
            host.on_commit(step, batch, metrics, run.view, run)
            if self._prepared_for != run.epoch:  # the first step on this mesh ran: compile where we may go next
                self._prepared_for = run.epoch
                self._free_spare()
                if self._lands and (args := runtime.land_args(state)):  # and the program a restore there lands with
                    self._standby.record(runtime.LAND, args, mesh)
                self._standby.prepare(self._next_meshes(run.view))

        def changed(next_step: int) -> View | None:
            now = host.view
            if host.stopping is not None or host.suspending is not None:  # the pass ends here, on its view
                return view
            return None if now.epoch == epoch else now

        pass_host = PassHost(
            self.config,
            save=save,
            changed=changed,
            on_commit=on_commit,
            before=host.before_step,
            record=self._standby.record,
            snapshot_soon=self._soon,
        )
        run = Run(pass_host, view=view, mesh=mesh, state=state, start_step=start, extras=extras)
        if self._fresh:
            self._fresh = False
            pass_host.save(start, run.state, {})
        try:
            value = loop(run)
        except Regroup as regroup:
            live = self._live = regroup.live
            if host.stopping is not None and live is not None:  # the job's final snapshot, to the persistent tier
                meta = host.snapshot_meta(copy.deepcopy(live.extras))
                return PassEnd(
                    stopped_at=live.next_step, persisted=self._tiers.persist(live.next_step, live.state, meta)
                )
            if host.suspending is not None and live is not None:  # the job's state to its keepers, then it waits
                meta = host.snapshot_meta(copy.deepcopy(live.extras))
                kept = self._tiers.suspend(live.next_step, live.state, meta)
                if kept is not None:  # else the live state stays: the job goes on where it is
                    self._live = None
                return PassEnd(suspended_at=live.next_step, kept=kept)
            return PassEnd(regroup=regroup.view, live=regroup.live is not None)
        finally:
            self._state, self._newest = run.state, run.newest_state
        return PassEnd(value=value)

    def drop(self) -> None:
        # Whatever was live may sit on lost devices (or be a hung step's results): restore from a snapshot. On CPU
        # the restore lands in its survivors' buffers (runtime.landing); elsewhere it is dropped now, so that the
        # restore reuses its memory instead of allocating it twice.
        newest = self._newest if self._newest is not None else self._prepared[2] if self._prepared else None
        self._live = self._prepared = self._state = self._newest = None
        self._dropped = newest if self._lands else None
        self._free_spare()
        self._tiers.pause()  # the snapshot in flight holds until the restore: the recovery gets the CPU

    @staticmethod
    def _land(
        dst: list[jax.Array], state: Any, kept: tuple[frozenset[Any], ...], devices: tuple[Any, ...]
    ) -> tuple[Any, str, list[jax.Array]]:
        """``state`` (borrowed, but for the shards ``kept`` in place) in ``dst``'s buffers, or (when they cannot take
        it) in fresh ones; why it did not land ("" when it did: the timeline's ``restored`` event says why), and the
        buffers of ``dst`` it left spare. Only a lost slice's error propagates: the landing is an optimisation."""
        try:
            landed = runtime.guarded(runtime.land, devices)(dst, state, kept)
        except Exception as err:
            if runtime.classify_failure(err) is not runtime.FailureKind.OTHER:
                raise
            why = f"{type(err).__name__}: {str(err)[:200]}"
        else:
            if landed is not None:
                return landed.state, "", landed.spare
            why = runtime.refusal(dst, state)  # asked only when it did not land: land checks the same itself
        return runtime.guarded(runtime.owned, devices)(state, kept), why, []

    def _free_spare(self) -> None:
        """The buffers the last landing left spare, freed on the release thread (after the first step on the new
        mesh, or at the next failure)."""
        if self._spare:
            runtime.discard(self._spare)
            self._spare = []  # the release thread now holds the only reference
            runtime.wake_releases()

    def _landing(self, shardings: Any) -> list[jax.Array] | None:
        """The dropped state's buffers, to take the restore (taken once: dropped either way)."""
        dropped, self._dropped = self._dropped, None
        if dropped is None:
            return None
        try:
            return runtime.landing(dropped, self._tiers.target(shardings))
        except Exception:  # noqa: BLE001 - an optimisation: a state it cannot read restores into fresh buffers
            return None

    def probe(
        self, slices: frozenset[int], timeout_s: float | None, *, early: Callable[[frozenset[int]], None] | None = None
    ) -> frozenset[int]:
        """Which slices do not answer a tiny computation within ``timeout_s`` (one that does not is dead); one
        whose probe fails at dispatch is known at once (``early``)."""
        return runtime.probe_slices(self._topology.select(slices), timeout_s=timeout_s, early=early)

    def lost(self, slices: frozenset[int]) -> tuple[dict[int, int] | None, bool]:
        return None, True  # a slice that failed in this process: its hardware is suspect

    def replaced(self, slices: frozenset[int], lost: dict[int, int] | None) -> frozenset[int]:
        return frozenset()  # a suspect slice comes back only by a revive, after the view dropped it

    def final_state(self) -> Any:
        return self._state

    def save_final(self, path: str) -> None:
        """Write the final state to ``path`` with Orbax (this process holds every shard)."""
        from etils import epath

        from elastic.control import orbax_io

        orbax_io.save_final(epath.Path(path), self._state)

    def snapshot_stats(self) -> dict[str, Any]:
        """The snapshotter's counters (blocking seconds, snapshots taken, bytes held)."""
        return self._tiers.snapshot_stats()

    def figures(self) -> PlacementFigures:
        stats = self._standby.stats
        return self._tiers.figures(
            standby_compiles=stats.compiled, standby_skipped=stats.skipped, standby_compile_seconds=stats.seconds
        )

    def wait_for_standbys(self, timeout: float) -> bool:
        return self._standby.wait(timeout)

    def close(self) -> None:
        self._standby.close()
        runtime.hangs.release_all()  # no simulated hang outlives the job (no thread stays blocked)

    def _next_meshes(self, view: View) -> list[Mesh]:
        """Every mesh one slice loss away (while at least ``min_slices`` remain), then the grow-back mesh."""
        active = sorted(view.active)
        sets = [frozenset(active) - {s} for s in active if len(active) - 1 >= self.config.policy.min_slices]
        everything = frozenset(self._topology.indices)
        if everything != view.active:
            sets.append(everything)
        return [runtime.build_mesh(self._topology.select(s), self._mesh_fn) for s in sets]
