"""A cloud's maintenance and preemption notices, read from the metadata server on a slice's host.

GCE's metadata server announces host maintenance (``instance/maintenance-event``: ``NONE`` until an event, then
e.g. ``TERMINATE_ON_HOST_MAINTENANCE``), scheduled maintenance (``instance/upcoming-maintenance``: empty or 404
until some is scheduled) and preemption (``instance/preempted``: ``TRUE`` once preempted). A slice's agent runs on
its host, so it polls its own host's server (:class:`MaintenanceListener`) when ``NoticeSources.metadata_url`` is
set (off by default), and gives the supervisor a notice for its slices, with source ``maintenance``, through the
agent's ``agent_notice`` call, which takes it down the one notice path.

:func:`maintenance_reason` is the decision, pure: whether the keys' values announce a loss, and which.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping

from elastic.log import get_logger
from elastic.supervision.sources import NoticeSources

__all__ = ["KEYS", "MaintenanceListener", "maintenance_reason"]

KEYS = ("instance/maintenance-event", "instance/upcoming-maintenance", "instance/preempted")


def maintenance_reason(values: Mapping[str, str | None]) -> str | None:
    """Why the host will go (one line), or None, from the metadata keys' values (None: the key is absent)."""
    preempted = (values.get("instance/preempted") or "").strip().upper()
    if preempted == "TRUE":
        return "the cloud preempted this host (instance/preempted)"
    event = (values.get("instance/maintenance-event") or "").strip()
    if event and event.upper() != "NONE":
        return f"host maintenance: {event} (instance/maintenance-event)"
    upcoming = (values.get("instance/upcoming-maintenance") or "").strip()
    if upcoming:
        return f"upcoming host maintenance: {' '.join(upcoming.split())[:160]} (instance/upcoming-maintenance)"
    return None


def _read(base: str, key: str) -> str | None:
    request = urllib.request.Request(f"{base.rstrip('/')}/{key}", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:  # the configured server
            return str(response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise


class MaintenanceListener:
    """Polls the metadata server of slice ``slice_index``'s host every ``sources.metadata_poll_s`` and calls
    ``give(deadline, reason)`` once, when it first announces a loss (deadline: ``sources.maintenance_deadline_s``
    from then)."""

    def __init__(
        self, sources: NoticeSources, slice_index: int, job: str, give: Callable[[float, str], Awaitable[object]]
    ) -> None:
        assert sources.metadata_url is not None
        self._base = sources.metadata_url.replace("{slice}", str(slice_index))
        self._sources, self._give = sources, give
        self._log = get_logger("elastic.supervision.maintenance", job=job, slice=slice_index)

    async def run(self) -> None:
        failing = False
        while True:
            try:
                values = {key: await asyncio.to_thread(_read, self._base, key) for key in KEYS}
                failing = False
            except (OSError, ValueError) as err:  # the server unreachable: poll again (logged once per change)
                if not failing:
                    self._log.warning("metadata_poll_failed", error=f"{type(err).__name__}: {err}"[:300])
                failing = True
                values = {}
            reason = maintenance_reason(values)
            if reason is not None:
                self._log.warning("maintenance_notice", reason=reason)
                try:
                    await self._give(time.time() + self._sources.maintenance_deadline_s, reason)
                except Exception as err:  # noqa: BLE001 - refused or the supervisor away: said once, not retried
                    self._log.warning("maintenance_notice_failed", error=f"{type(err).__name__}: {err}"[:300])
                return
            await asyncio.sleep(self._sources.metadata_poll_s)
