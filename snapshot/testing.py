"""Fault injection into held snapshots, for tests and drills (never used by the runtime itself)."""

from __future__ import annotations

from typing import Any

from .snapshotter import Snapshotter

__all__ = ["copies_of", "flip_byte"]


def copies_of(snapshotter: Snapshotter, *, leaf: int, piece: int = 0, generation: int = -1) -> list[Any]:
    """The copies (``snapshot.engine.Copy``) of one piece of a held generation (default: the newest)."""
    gen = snapshotter.generation(generation)
    return list(gen.leaves[leaf].pieces[piece].copies)


def flip_byte(
    snapshotter: Snapshotter, *, leaf: int, piece: int = 0, copy: int | None = None, generation: int = -1, byte: int = 0
) -> int:
    """Flip every bit of one byte in the host buffer of one copy (``copy=None``: every copy) of a piece,
    as a memory fault would. Returns the number of buffers changed. Host engine only."""
    changed = 0
    for i, c in enumerate(copies_of(snapshotter, leaf=leaf, piece=piece, generation=generation)):
        if copy is not None and i != copy:
            continue
        if c.buffer is None:
            raise TypeError("flip_byte needs the host engine (the copies' bytes are host buffers)")
        raw = c.buffer.reshape(-1).view("uint8")
        raw[byte % raw.size] ^= 0xFF
        changed += 1
    return changed
