"""The one place a job's mode is chosen (:func:`for_job`): single-process (:class:`LocalMode`, every slice's
devices in this process) or multi-process (``process_mode.ProcessMode``, a worker process per slice), both a
:class:`~elastic.control.placement.JobMode`."""

from __future__ import annotations

from elastic.control.placement import JobMode
from elastic.placements.plan import JobParts

__all__ = ["JobParts", "for_job"]


def for_job(parts: JobParts) -> JobMode:
    """The job's mode: multi-process when ``config.processes`` is set, else single-process. ``ConfigError`` when
    this process cannot see the slices' devices (single-process mode)."""
    if parts.config.processes is None:
        from elastic.placements.local_mode import LocalMode

        return LocalMode(parts)
    from elastic.placements.process_mode import ProcessMode

    return ProcessMode(parts)
