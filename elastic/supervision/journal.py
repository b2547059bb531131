"""The supervisor's journal: the records it writes to the job run's event stream, and those it has, in order.

Each record gets the epoch of the view current when it is written (unless it names its own). Written at once, or,
within :meth:`Journal.gathering`, started at once and all landed when the block ends (one round trip to the GCS for
many, not one each). Once closed (the job is closing) nothing is written again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from elastic.supervision.events import EventStream

__all__ = ["Journal"]


class Journal:
    """Writes ``stream``'s records and keeps them after ``records`` (those already there, replayed)."""

    def __init__(self, stream: EventStream, records: list[dict[str, Any]], *, epoch: Callable[[], int]) -> None:
        self._stream = stream
        self._records = list(records)
        self._epoch = epoch
        self._gathered: list[Future[None]] | None = None  # writes started inside ``gathering``, not yet waited for
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record, oldest first (a copy)."""
        return list(self._records)

    def last(self) -> dict[str, Any] | None:
        return self._records[-1] if self._records else None

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` (its ``kind`` and fields): at once, or, while gathering, started now and waited for by
        :meth:`flush`. Nothing once closed."""
        if self._closed:
            return
        fields = {k: v for k, v in record.items() if k != "kind"}
        fields = {"epoch": self._epoch(), **fields}
        if self._gathered is None:
            self._records.append(self._stream.append(record["kind"], **fields))
            return
        written, landing = self._stream.append_soon(record["kind"], **fields)
        self._records.append(written)
        self._gathered.append(landing)

    def close(self) -> None:
        """Write ``closed`` (the first time) and nothing after it."""
        if not self._closed:
            self.append({"kind": "closed"})
        self._closed = True

    @contextlib.asynccontextmanager
    async def gathering(self) -> AsyncIterator[None]:
        """Within: records are written together, and every one has landed when the block ends. A block entered
        while another gathers joins it (the first to end stops the gathering; later records go at once)."""
        opened = self._gathered is None
        if opened:
            self._gathered = []
        try:
            yield
            await self.flush()
        finally:
            if opened:
                self._gathered = None

    async def flush(self) -> None:
        """Until the records started so far have landed (nothing to wait for when not gathering)."""
        while self._gathered:
            pending, self._gathered[:] = list(self._gathered), []
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending))
