"""Keep the global batch when it does not divide over the devices: plan micro-batches.

A plan covers the batch with at most two chunks: one whose size divides over the devices (sharded),
and a remainder smaller than the device count (replicated). Weighting each chunk's mean gradient by
its size gives exactly the gradient of the whole batch's mean loss.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Chunk", "plan_microbatches"]


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Rows ``start`` to ``stop`` of a global batch, one micro-batch of ``plan_microbatches``."""

    start: int
    size: int
    sharded: bool  # True: split over every device; False: replicated on each

    @property
    def stop(self) -> int:
        """One past the chunk's last row."""
        return self.start + self.size


def plan_microbatches(global_batch: int, num_devices: int) -> tuple[Chunk, ...]:
    """Chunks covering ``range(global_batch)`` in order."""
    if global_batch < 1 or num_devices < 1:
        raise ValueError(f"need a positive batch and device count, got {global_batch} and {num_devices}")
    main = global_batch - global_batch % num_devices
    chunks = []
    if main:
        chunks.append(Chunk(start=0, size=main, sharded=True))
    if main < global_batch:
        chunks.append(Chunk(start=main, size=global_batch - main, sharded=False))
    return tuple(chunks)
