"""The complete generations a Snapshotter holds and the host buffers they were written into.

At most ``keep`` generations, oldest first; ``keep + 1`` buffer slots, reused across generations (the slot being
written never holds a complete generation). Not locked: its owner serialises every call.
"""

from __future__ import annotations

from .copier import Buffers
from .generation import Generation

__all__ = ["Ring"]


class Ring:
    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.held: list[Generation] = []
        self.slots: dict[int, Buffers] = {}

    @property
    def newest(self) -> Generation | None:
        return self.held[-1] if self.held else None

    def free_slot(self) -> int:
        """A slot no complete generation is in."""
        used = {g.slot for g in self.held}
        return next(s for s in range(self.keep + 1) if s not in used)

    def publish(self, gen: Generation) -> None:
        """Hold ``gen`` as the newest; the oldest past ``keep`` is let go."""
        if self.held and self.held[-1].step >= gen.step:
            # A rollback or a repeat: generations at or past this step belong to a discarded future.
            self.held = [g for g in self.held if g.step < gen.step]
        self.held.append(gen)
        del self.held[: -self.keep]

    def drop(self, gen: Generation) -> None:
        """Let ``gen`` go (it is corrupt)."""
        self.held = [g for g in self.held if g is not gen]

    def held_bytes(self) -> int:
        """The bytes of the host buffers held (or of the generations' copies, where they are jax arrays)."""
        held = sum(b.nbytes for slot in self.slots.values() for b in slot.values())
        return held or sum(g.held_bytes for g in self.held)
