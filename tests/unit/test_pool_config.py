"""ElasticConfig's pool fields: defaults, and each bad value refused in one line saying what to fix."""

from __future__ import annotations

import pytest

from elastic.config import ElasticConfig, Policy
from elastic.errors import ConfigError


def test_defaults_follow_the_job() -> None:
    c = ElasticConfig(num_slices=5, pool="shared", priority=3, policy=Policy(min_slices=2))
    assert (c.pool_min_slices, c.pool_max_slices, c.spares) == (2, 5, 0)
    c = ElasticConfig(num_slices=5, pool="shared", min_slices=3, max_slices=4, spares=1)
    assert (c.pool_min_slices, c.pool_max_slices) == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"priority": 2}, ("priority is a pool job's", "set pool=")),
        ({"min_slices": 2, "spares": 1}, ("spares, min_slices are a pool job's",)),
        ({"pool": "a b"}, ("pool must be a pool's name", "'a b'")),
        ({"pool": ""}, ("pool must be a pool's name",)),
        ({"pool": "p", "priority": 1.5}, ("priority must be an int",)),
        ({"pool": "p", "spares": -1}, ("spares must be 0 or more",)),
        ({"pool": "p", "min_slices": 0}, ("min_slices must be an integer of at least 1",)),
        ({"pool": "p", "max_slices": True}, ("max_slices must be an int",)),
        ({"pool": "p", "max_slices": 9}, ("max_slices=9 is above num_slices=4",)),
        ({"pool": "p", "min_slices": 3, "max_slices": 2}, ("min_slices=3 is above max_slices=2",)),
        ({"pool": "p", "min_slices": 1, "policy": Policy(min_slices=2)}, ("below policy.min_slices=2",)),
    ],
)
def test_bad_pool_fields(kwargs, words) -> None:
    with pytest.raises(ConfigError) as info:
        ElasticConfig(num_slices=4, **kwargs)
    text = str(info.value)
    assert "\n" not in text and all(w in text for w in words), text


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pool_size": 4}, ("needs at least 5 slices", "raise --slices")),
        ({"kill_slice": 3}, ("one of high's 3 slices", "got 3")),
        ({"kill_at": 55}, ("steps 1..49", "got 55")),
    ],
)
def test_a_pool_demo_that_could_not_show_its_sequence_is_refused(kwargs, words) -> None:
    from elastic.demos.pool import PoolDemoSpec

    with pytest.raises(ConfigError) as info:
        PoolDemoSpec(**kwargs)
    text = str(info.value)
    assert "\n" not in text and all(w in text for w in words), text
