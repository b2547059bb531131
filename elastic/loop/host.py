"""What a pass of the user's loop talks to, in whichever process runs the loop (the client in single-process
mode, each worker in multi-process mode): the :class:`~elastic.loop.run.RunHost` of one pass.

It keeps the rules both modes share: a snapshot is requested every ``snapshot_every`` steps, after the last
step, and at the first commit after a restore (the restored generation lost its copies on the dead slices);
at a step boundary where the view changed, the state is snapshotted there (unless that step's snapshot was
just requested) and the pass ends with :class:`~elastic.loop.run.Regroup`. Where the snapshot goes, what a
commit is recorded in, and how the view is known are the mode's (the callables it is built with).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from elastic.config import ElasticConfig
from elastic.loop.run import LiveState, Regroup, Run
from elastic.supervision.membership import View

__all__ = ["PassHost", "SnapshotPolicy"]

Save = Callable[[int, Any, dict[str, Any]], None]  # (next_step, state, extras)


@dataclass(frozen=True, kw_only=True)
class SnapshotPolicy:
    """When a snapshot is asked for: every ``every`` steps and after the last one."""

    every: int
    num_steps: int

    def due(self, next_step: int) -> bool:
        return next_step % self.every == 0 or next_step == self.num_steps


class PassHost:
    """The host of one pass. ``save(next_step, state, extras)`` requests a snapshot; ``changed(next_step)`` is
    the new view when the pass must end before ``next_step`` (else None); ``on_commit(run, step, state,
    batch, metrics)`` records a commit; ``before(step)`` runs as each step starts; ``record(fn, args, mesh)``
    notes a jitted call for standby compiles. ``snapshot_soon``: snapshot at the first commit."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        save: Save,
        changed: Callable[[int], View | None],
        on_commit: Callable[[Run, int, Any, int, dict[str, Any]], None],
        before: Callable[[int], None],
        record: Callable[[Callable[..., Any], tuple[Any, ...], Mesh], None],
        snapshot_soon: bool = False,
    ) -> None:
        self.config = config
        self.num_steps = config.num_steps
        self.seed = config.seed
        self._save = save
        self._changed = changed
        self._on_commit = on_commit
        self._before = before
        self._record = record
        self._policy = SnapshotPolicy(every=config.snapshot_every, num_steps=config.num_steps)
        self._soon = snapshot_soon
        self.saved_for: int | None = None  # the step the newest snapshot request resumes at

    def save(self, next_step: int, state: Any, extras: dict[str, Any]) -> None:
        self.saved_for = next_step
        self._save(next_step, state, extras)

    def before_step(self, step: int) -> None:
        self._before(step)

    def must_confirm(self, step: int) -> bool:
        """A snapshot is due after ``step``: its commit waits for it."""
        return self._policy.due(step + 1) or self._soon

    def committed(self, run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None:
        self._on_commit(run, step, state, batch, metrics)
        if self._policy.due(step + 1) or self._soon:
            self._soon = False
            self.save(step + 1, state, run.extras)

    def boundary(self, run: Run, next_step: int) -> Regroup | None:
        """Before ``next_step`` starts: a ``Regroup`` when the view has changed."""
        view = self._changed(next_step)
        if view is None:
            return None
        run.settle()  # the pass ends here: every committed step confirmed (a failure among them surfaces now)
        if view.gave_up is not None:
            return Regroup(view, None)
        if self.saved_for != next_step:  # committed() has not saved this boundary already
            self.save(next_step, run.state, run.extras)  # the snapshot boundary: nothing is lost
        return Regroup(view, LiveState(state=run.state, next_step=next_step, extras=copy.deepcopy(run.extras)))

    def record_call(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh) -> None:
        self._record(fn, args, mesh)
