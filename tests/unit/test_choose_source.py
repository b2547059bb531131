"""Where a restore reads the state from (elastic.control.sources.choose_source): one table for both modes."""

from __future__ import annotations

import pytest

from elastic.control.sources import Choice, Source, choose_source
from elastic.errors import ElasticError


def never() -> None:
    raise AssertionError("a tier after the one chosen was asked")


def test_memory_first_and_no_other_tier_is_asked() -> None:
    assert choose_source((7, "held"), never, never, True) == Choice(source=Source.MEMORY, step=7, found="held")


def test_a_live_move_reads_memory_or_fails_naming_the_members() -> None:
    assert choose_source((3, None), never, never, False, live=True).source is Source.MEMORY
    with pytest.raises(ElasticError, match=r"the members \[0, 2\] do not hold the boundary snapshot"):
        choose_source(None, never, never, False, live=True, survivors=(2, 0))


def test_the_keepers_next() -> None:
    assert choose_source(None, lambda: (5, "keeper-1"), never, True) == Choice(
        source=Source.KEEPER, step=5, found="keeper-1"
    )


def test_then_orbax() -> None:
    asked = []
    choice = choose_source(None, lambda: asked.append("keepers"), lambda: (4, None), True)
    assert choice == Choice(source=Source.PERSISTENT, step=4) and asked == ["keepers"]


def test_fresh_when_nothing_was_saved_or_committed() -> None:
    assert choose_source(None, lambda: None, lambda: None, False) == Choice(source=Source.FRESH)


def test_never_fresh_once_something_was_committed() -> None:
    with pytest.raises(ElasticError, match="no tier can restore the state.*do not hold a whole step between them"):
        choose_source(None, lambda: None, lambda: None, True, survivors=(1, 3))
