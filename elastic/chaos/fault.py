"""One planned fault, as plain data: what :class:`~elastic.chaos.faults.Faults` collects and the injectors fire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["KILL_MOMENTS", "During", "Fault", "FaultKind"]

FaultKind = Literal["kill", "revive", "silence", "transient", "kill_client", "hang", "supervisor_restart"]
During = Literal["step", "collective", "forming", "joined", "restore"]
KILL_MOMENTS: tuple[str, ...] = ("step", "collective", "forming", "joined", "restore")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """``kind`` strikes slice ``slice`` (if any) as step ``at_step`` starts."""

    kind: FaultKind
    at_step: int
    slice: int | None = None
    during: During = "step"  # multi-process kills: as the step starts, inside its collectives, or in a re-formation
    hold: bool = True  # revives: the loop waits for the slice to be back (a repeatable drill), or goes on
