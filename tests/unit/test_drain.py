"""`elastic drain`'s deadline: seconds from now, with a unit; anything else a ConfigError."""

from __future__ import annotations

import pytest

from elastic.errors import ConfigError
from elastic.ops.drain import parse_deadline


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30", 30.0), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), ("0.5s", 0.5), ("-5s", -5.0), (" 10 ", 10.0)],
)
def test_deadline_parses(text: str, seconds: float) -> None:
    assert parse_deadline(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "30d", "1m30s", "s"])
def test_deadline_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match="--deadline"):
        parse_deadline(text)
