"""The background thread's half of a save: every staged piece written into the host memory of its copies' devices,
checksummed as it is written, a lost slice's copies skipped (the piece keeps its others)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import numpy as np
import structlog

from .engine import Copy, Engine
from .generation import Guard, PieceRecord
from .staged import StagedRequest

__all__ = ["PAUSE_S", "Abandoned", "Buffers", "copy_pieces"]

log = structlog.get_logger("snapshot")
PAUSE_S = 5.0  # the longest a paused copy holds at one piece (see ``Snapshotter.pause``)

Buffers = dict[tuple[int, int, int], np.ndarray]  # (leaf, piece, copy) -> the host buffer it was written into


class Abandoned(Exception):
    """The request was abandoned while it was being copied (its state was restored, or is not wanted)."""


def copy_pieces(
    req: StagedRequest,
    *,
    engine: Engine,
    pool: ThreadPoolExecutor,
    reuse: Buffers,
    guard: Guard | None,
    running: threading.Event,
    first_skip: Callable[[tuple[int, int | None, str]], bool],
) -> tuple[dict[tuple[int, int], PieceRecord], Buffers]:
    """Write every piece of ``req`` on ``pool`` (into ``reuse``'s buffers where they fit); each piece's record and
    the buffers written. Holds between copies while ``running`` is clear (at most ``PAUSE_S`` each); raises
    :class:`Abandoned` once ``req.abandoned`` is set, and a piece's error when none of its copies could be
    written. ``first_skip((request, slice, cause))``: whether a skipped copy's cause is new (logged once each)."""
    buffers: Buffers = {}  # only this layout's buffers stay held

    def one_piece(i: int, j: int) -> PieceRecord:
        plan = req.plans[i]
        assert plan is not None
        piece = plan.pieces[j]
        copies: list[Copy] = []
        digest = 0
        lost: BaseException | None = None
        for k, (cp, staged) in enumerate(zip(piece.copies, req.staged[i][j], strict=True)):
            running.wait(PAUSE_S)  # paused while a failure is recovered from (bounded: it goes on)
            if req.abandoned:
                raise Abandoned
            if guard is not None:
                try:
                    guard([cp.dest])
                except Exception as err:  # noqa: BLE001 - that slice is gone: the piece keeps its other copies
                    lost = err
                    if first_skip((req.number, cp.slice, type(err).__name__)):  # one line per lost slice and cause
                        log.warning("snapshot_copy_skipped", step=req.step, slice=cp.slice, error=str(err)[:120])
                    continue
            if not copies:  # one checksum per piece, taken from its first copy as it is written
                made, digest = engine.write_checksummed(staged, cp.dest, cp.slice, reuse.get((i, j, k)))
            else:
                made = engine.write(staged, cp.dest, cp.slice, reuse.get((i, j, k)))
            if made.buffer is not None:
                buffers[(i, j, k)] = made.buffer
            copies.append(made)
        if not copies:
            assert lost is not None
            raise lost
        return PieceRecord(index=piece.index, checksum=digest, copies=tuple(copies))

    futures = {
        (i, j): pool.submit(one_piece, i, j)
        for i, plan in enumerate(req.plans)
        if plan
        for j in range(len(plan.pieces))
    }
    # Every piece settles before a failure is raised: a piece still writing would otherwise land in the
    # reused buffers of the next save (this slot stays free) after that save checksummed them.
    wait_all(futures.values())
    return {ij: f.result() for ij, f in futures.items()}, buffers
