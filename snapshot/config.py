"""What a snapshotter is told (its configuration) and what it answers (snapshot info, a restore)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .errors import SnapshotConfigError

__all__ = ["Restored", "SnapshotConfig", "SnapshotInfo"]


@dataclass(frozen=True, kw_only=True)
class SnapshotConfig:
    """``keep`` complete generations; every byte on ``copies`` distinct slices (survives ``copies - 1``
    slice losses); ``on_busy`` says what a save does while an earlier one still waits to be copied."""

    keep: int = 2
    copies: int = 2
    on_busy: Literal["coalesce", "wait"] = "coalesce"
    engine: Literal["auto", "host", "device"] = "auto"
    threads: int = 2

    def __post_init__(self) -> None:
        for name in ("keep", "copies", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SnapshotConfigError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.on_busy not in ("coalesce", "wait"):
            raise SnapshotConfigError(f"on_busy must be 'coalesce' or 'wait', got {self.on_busy!r}")
        if self.engine not in ("auto", "host", "device"):
            raise SnapshotConfigError(f"engine must be 'auto', 'host' or 'device', got {self.engine!r}")


@dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    """A complete snapshot: its step, generation, bytes of state and the number of copies of each byte."""

    step: int
    generation: int
    state_bytes: int
    copies: int


@dataclass(frozen=True, kw_only=True)
class Restored:
    """What ``load`` placed: the state of ``step`` from ``generation``, its ``meta``, and the tier and source
    it came from."""

    step: int
    generation: int
    state: Any
    meta: dict[str, Any]
    tier: str = "memory"
    source: str = "copies"  # "staged": a snapshot still in flight, taken from the shards it staged
    kept: tuple[frozenset[Any], ...] = ()  # per leaf of ``state`` (tree_leaves order): devices whose shard was kept
    borrowed: bool = False  # the state may alias the snapshot's host bytes: copy it before the snapshot moves on

    @property
    def shards_kept(self) -> int:
        """Device shards restored in place (nothing moved)."""
        return sum(len(devices) for devices in self.kept)
