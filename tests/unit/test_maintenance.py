"""maintenance_reason: which metadata values announce that the host will go (a table)."""

from __future__ import annotations

import pytest

from elastic.config import NoticeSources
from elastic.errors import ConfigError
from elastic.supervision.maintenance import maintenance_reason

EV, UP, PRE = "instance/maintenance-event", "instance/upcoming-maintenance", "instance/preempted"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, None),
        ({EV: "NONE", UP: None, PRE: "FALSE"}, None),
        ({EV: "NONE\n", UP: "", PRE: "FALSE"}, None),
        ({EV: "TERMINATE_ON_HOST_MAINTENANCE", PRE: "FALSE"}, "host maintenance: TERMINATE_ON_HOST_MAINTENANCE"),
        ({EV: "MIGRATE_ON_HOST_MAINTENANCE"}, "host maintenance: MIGRATE_ON_HOST_MAINTENANCE"),
        ({EV: "NONE", PRE: "TRUE"}, "the cloud preempted this host"),
        ({EV: "NONE", UP: '{"maintenance_status": "PENDING"}'}, "upcoming host maintenance"),
    ],
)
def test_maintenance_reason(values, expected) -> None:
    reason = maintenance_reason(values)
    assert (reason is None) if expected is None else (reason is not None and reason.startswith(expected)), reason


def test_notice_sources_are_checked() -> None:
    assert NoticeSources().metadata_url is None  # off by default
    with pytest.raises(ConfigError, match="metadata_url"):
        NoticeSources(metadata_url="metadata.google.internal")
    with pytest.raises(ConfigError, match="metadata_poll_s"):
        NoticeSources(metadata_poll_s=0)
