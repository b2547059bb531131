"""A worker's pass of the user's loop in multi-process mode, and what the driver reads of it while it runs.

:class:`PassRunner` runs the loop with the same :class:`~elastic.loop.run.Run` as single-process mode, its host a
:class:`~elastic.loop.host.PassHost`, on a thread of its own, so that the driver's :meth:`PassRunner.abort` can end
it while a collective is stuck on a dead peer (gloo notices only on its timeout: that thread is abandoned, and
ends by itself). The pass ends with a :class:`~elastic.placements.outcome.PassOutcome`: the loop ran to the end,
left at a step boundary for a new view, or broke (its error classified once, :func:`outcome.classify`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.hooks import StepContext
from elastic.control.report import Ledger
from elastic.control.sources import Source
from elastic.log import get_logger
from elastic.loop.host import PassHost
from elastic.loop.run import Regroup, Run
from elastic.placements.holdings import Holdings
from elastic.placements.outcome import Commit, Ending, ErrorInfo, PassOutcome, classify, error_info, numbers
from elastic.placements.plan import GroupPlan, WorkerSpec
from elastic.supervision.membership import View

__all__ = ["DRIVER_LEASE_S", "PassRunner", "Prepared"]

DRIVER_LEASE_S = 5.0  # a pass stops when the driver has not read its progress for this long (the driver died)

Prepared = tuple[Any, Any, int, dict[str, Any], Ledger]  # mesh, state, first step, the loop's extras, the ledger
Save = Callable[..., Any]  # (plan, ledger, next_step, state, extras, *, final): final saves to the Orbax tier now


@dataclass(kw_only=True)
class _Record:
    """What a pass learns as it runs (the thread's own; read once it ended)."""

    ending: Ending | None = None
    error: ErrorInfo | None = None
    failed_at: float | None = None
    ledger: dict[str, Any] | None = None
    first_commit_at: float | None = None
    first_step_at: float | None = None
    first_step_compile_seconds: float | None = None
    first_step_phases: dict[str, float | None] | None = None
    commits: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)  # metrics as the loop gave them
    persisted: int | None = None  # the step of the final Orbax save, when the job stopped


class PassRunner:
    """One worker's passes: runs each, and answers the driver's progress reads, stop requests and aborts
    (thread-safe: the actor serves those while the pass runs)."""

    def __init__(self, slice_index: int, spec: WorkerSpec, supervisor: Any, holdings: Holdings, save: Save) -> None:
        self.slice = slice_index
        self._spec = spec
        self._config: ElasticConfig = spec.config
        self._supervisor = supervisor
        self._holdings = holdings
        self._save = save
        self._log = get_logger("elastic.worker", job=spec.config.job_name, slice=slice_index)
        self._lock = threading.Lock()
        self._epoch = -1
        self._aborted = threading.Event()
        self._ended: threading.Event | None = None
        # epoch -> (the step the group stops before, the new view, whether the job stops there)
        self._stop_at: dict[int, tuple[int, View, bool]] = {}
        self.next_step = 0
        self._commits: list[tuple[int, int, dict[str, Any]]] = []  # this pass's commits, in order
        self._calls: list[tuple[bytes, Any]] = []  # jitted calls recorded for standby compiles
        self._polled = time.monotonic()  # the driver's last progress read: its lease on this worker's pass
        self._loop_ref: Any = None
        self._loop: Callable[[Run], Any] | None = None
        self.final: Any = None  # the newest state of the last pass not aborted
        self.compile_s = 0.0  # seconds compiling since the group formed

    def on_duration(self, event: str, duration: float, **_: Any) -> None:
        """JAX's event listener: counts backend compile seconds."""
        if event == "/jax/core/compile/backend_compile_duration":
            self.compile_s += duration

    def begin_group(self, epoch: int) -> None:
        """Group ``epoch`` forms: a poll before its pass starts must not read the last pass's commits."""
        with self._lock:
            self._epoch = epoch
            self._commits = []
        self.final = None

    # -- what the driver reads and asks while a pass runs -----------------------------------------------------------
    def progress(self, since: int) -> dict[str, Any]:
        """The next step, the commits from index ``since`` on, the recorded calls and the snapshot counters."""
        self._polled = time.monotonic()
        return {
            "epoch": self._epoch,
            "next_step": self.next_step,
            "commits": _numbered(self._commits[since:]),
            "pid": os.getpid(),
            "calls": list(self._calls),
            "snapshots": self._holdings.stats(),
        }

    def renew(self) -> None:
        self._polled = time.monotonic()

    def request_stop(self, epoch: int, step: int, view: View, final: bool = False) -> bool:
        with self._lock:
            self._stop_at[epoch] = (step, view, final)
            return not (self._epoch == epoch and self.next_step > step)

    def abort(self, epoch: int) -> bool:
        with self._lock:
            if self._epoch != epoch or self._ended is None or self._ended.is_set():
                return False
            self._aborted.set()
            self._ended.set()
            return True

    # -- one pass ---------------------------------------------------------------------------------------------------
    def run(self, plan: GroupPlan, prepared: Prepared) -> PassOutcome:
        """Run the user's loop over the prepared group; how the pass ended and its commits."""
        with self._lock:
            self._aborted = aborted = threading.Event()  # this pass's: an abandoned thread keeps seeing its own
            self._ended = ended = threading.Event()
            self._commits = commits = []  # type: ignore[var-annotated]  # self._commits is declared
            self._polled = time.monotonic()
        record = _Record(commits=commits)

        def body() -> None:
            try:
                self._pass(plan, prepared, record, aborted)
            except _Aborted:
                pass
            except Exception as err:  # noqa: BLE001 - classified: a dead peer is recovered, the rest reported
                record.ending, record.failed_at, record.error = classify(err), time.time(), error_info(err)
            finally:
                ended.set()

        thread = threading.Thread(target=body, name=f"pass-{plan.epoch}", daemon=True)
        thread.start()
        ended.wait()
        aborted_now = aborted.is_set()
        if aborted_now:
            ending: Ending = Ending.PEER_LOST
            error: ErrorInfo | None = ErrorInfo(
                type_name="", message="aborted: the driver saw a member of the group lost"
            )
            failed_at: float | None = time.time()
        else:
            thread.join()
            assert record.ending is not None
            ending, error, failed_at = record.ending, record.error, record.failed_at
        return PassOutcome(
            slice=self.slice,
            epoch=plan.epoch,
            pid=os.getpid(),
            ending=ending,
            error=error,
            failed_at=failed_at,
            aborted=aborted_now,
            commits=tuple(_numbered(record.commits)),
            next_step=self.next_step,
            compile_seconds=round(self.compile_s, 4),
            snapshots=self._holdings.stats(wait_s=30.0 if ending is Ending.FINISHED else 0.0),
            ledger=None if aborted_now else record.ledger,
            persisted=record.persisted,
            first_commit_at=record.first_commit_at,
            first_step_compile_seconds=record.first_step_compile_seconds,
            first_step_phases=record.first_step_phases,
        )

    def _pass(self, plan: GroupPlan, prepared: Prepared, record: _Record, aborted: threading.Event) -> None:
        mesh, state, start, extras, ledger = prepared
        self.next_step = start
        began = time.time()

        def on_commit(run: Run, step: int, new_state: Any, batch: int, metrics: dict[str, Any]) -> None:
            with self._lock:  # abort() waits for a commit in progress; none starts after it
                if aborted.is_set():
                    raise _Aborted(f"group {plan.epoch} was aborted at step {step}")
                ledger.commit(step, batch)
                record.commits.append((step, batch, metrics))
                self.next_step = step + 1
            if record.first_commit_at is None:
                record.first_commit_at = now = time.time()
                record.first_step_compile_seconds = round(self.compile_s, 4)
                first = record.first_step_at
                record.first_step_phases = {
                    "to_step": round(first - began, 3) if first is not None else None,
                    "step": round(now - (first if first is not None else began), 3),
                }

        def changed(next_step: int) -> View | None:
            with self._lock:
                if aborted.is_set():
                    raise _Aborted(f"group {plan.epoch} was aborted before step {next_step}")
                stop = self._stop_at.get(plan.epoch)
            return stop[1] if stop is not None and next_step >= stop[0] else None

        def before(step: int) -> None:
            self.next_step = step
            if record.first_step_at is None:
                record.first_step_at = time.time()
            silent = time.monotonic() - self._polled
            if silent > DRIVER_LEASE_S:  # a worker must not train on for a dead driver (Ray ends it soon)
                raise runtime.SliceLostError(
                    f"the driver has not read this pass's progress for {silent:.1f}s (more than {DRIVER_LEASE_S}s): "
                    "it is gone or stuck"
                )
            if self._spec.step_hooks:
                context = StepContext(step=step, slice=self.slice, floor=plan.fault_floor, supervisor=self._supervisor)
                for hook in self._spec.step_hooks:
                    hook(context)

        def record_call(fn: Callable[..., Any], args: tuple[Any, ...], mesh_: Any) -> None:
            if plan.record_calls:
                self._record(fn, args, mesh_)

        def save(next_step: int, state_: Any, extras_: dict[str, Any]) -> None:
            if not aborted.is_set():  # an abandoned pass snapshots nothing (the next group may be restoring)
                self._save(plan, ledger, next_step, state_, extras_)

        host = PassHost(
            self._config,
            save=save,
            changed=changed,
            on_commit=on_commit,
            before=before,
            record=record_call,
            snapshot_soon=plan.source is not Source.FRESH,
        )
        run = Run(host, view=plan.view, mesh=mesh, state=state, start_step=start, extras=extras)
        del state, prepared
        if plan.source is Source.FRESH:
            host.save(start, run.state, {})
        try:
            self._loop_of(plan)(run)
            record.ending, record.ledger = Ending.FINISHED, ledger.to_meta()
        except Regroup as regroup:
            record.ending, record.ledger = Ending.REGROUP, ledger.to_meta()
            stop = self._stop_at.get(plan.epoch)
            if stop is not None and stop[2] and regroup.live is not None and not aborted.is_set():
                live = regroup.live  # the job stops here: its final snapshot, to the Orbax tier
                record.persisted = self._save(plan, ledger, live.next_step, live.state, live.extras, final=True)
                record.ending = Ending.STOPPED
        finally:
            with self._lock:  # an abandoned pass (aborted) ends late: it must not replace a later pass's state
                if not aborted.is_set():
                    self.final = run.state

    def _loop_of(self, plan: GroupPlan) -> Callable[[Run], Any]:
        """The user's loop (sent once per job, as an object reference; kept here after the first pass)."""
        if not isinstance(plan.loop, ray.ObjectRef):
            return plan.loop
        if self._loop is None or self._loop_ref != plan.loop:
            self._loop_ref, self._loop = plan.loop, ray.get(plan.loop)
        assert self._loop is not None
        return self._loop

    def _record(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Any) -> None:
        """Note a jitted call (pickled function, its signature relative to the mesh) for the standby group."""
        import cloudpickle

        try:
            signature = runtime.standby.Signature.of(args, mesh)
            parts = runtime.standby.portable(fn)
            if signature is not None and parts is not None:
                self._calls.append((cloudpickle.dumps(parts), signature))
        except Exception as err:  # noqa: BLE001 - an optimisation must never fail a step
            self._log.info("standby_record_skipped", error=repr(err)[:200])


def _numbered(commits: list[tuple[int, int, dict[str, Any]]]) -> list[Commit]:
    return [(s, b, numbers(m)) for s, b, m in commits]


class _Aborted(BaseException):
    """Ends an abandoned pass: the driver aborted the group while this thread was still in it."""
