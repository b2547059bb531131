"""A job's side of the pool on a real Ray: join (bounded, with the pool's reason), reclaim notices in the job's own
slice numbers, slices left and given back, the pool killed mid-lease (restarted, replayed, the members go on)."""

from __future__ import annotations

import threading

import pytest

from elastic.errors import PoolError
from elastic.pool import JobSpec
from elastic.pool.access import user_credential
from elastic.pool.client import find_pool, start_pool
from elastic.pool.member import PoolMember
from elastic.supervision import credential, identity
from tests.conftest import bounded, until


class LeavesAtOnce:
    """The job side: a reclaim is left at once (a step boundary reached), a grant recorded."""

    def __init__(self) -> None:
        self.member: PoolMember | None = None
        self.reclaims: list[tuple[frozenset[int], str]] = []
        self.grants: list[frozenset[int]] = []

    def reclaim(self, slices: frozenset[int], reason: str) -> None:
        self.reclaims.append((slices, reason))
        assert self.member is not None
        self.member.left(slices)

    def granted(self, slices: frozenset[int]) -> None:
        self.grants.append(slices)


@pytest.fixture
def pool(ray_local, request):
    token = credential.new_token()
    name = f"m{abs(hash(request.node.nodeid)) % 10**8}"
    op = start_pool(name, 4, token, users=["alice", "bob"])
    yield name, token, op
    while _MEMBERS:  # a test that failed half-way leaves no member following a pool that is gone
        member = _MEMBERS.pop()
        if not member._stop.is_set():
            member.close()
    ray_local.kill(op.handle, no_restart=True)
    identity.forget(f"pool-{name}")


_MEMBERS: list[PoolMember] = []


def _member(pool_name, token, user, hooks=None, **spec) -> PoolMember:
    handle = find_pool(pool_name, user_credential(token, user), user=user)
    member = PoolMember(handle, JobSpec(user=user, **spec), hooks)
    _MEMBERS.append(member)
    if hooks is not None:
        hooks.member = member
    return member


def test_reclaim_left_and_given_back_across_a_pool_restart(ray_local, pool) -> None:
    name, token, op = pool
    hooks = LeavesAtOnce()
    low = _member(name, token, "alice", hooks, name="low", min_slices=1, max_slices=4)
    assert low.join(30) == {0, 1, 2, 3}
    low.watch()
    high = _member(name, token, "bob", name="high", priority=9, max_slices=2)
    got: dict[str, frozenset[int]] = {}
    joining = threading.Thread(target=lambda: got.setdefault("high", high.join(60)), daemon=True)
    joining.start()
    bounded(lambda: joining.join(60), 70, "high's join")
    assert got["high"] == {0, 1}, "the job numbers its slices from 0"
    ((taken, why),) = hooks.reclaims
    assert taken == {2, 3} and "high (priority 9) needs it" in why
    # the pool lends high the slices low released within low's release call, which low folds in once it returns
    until(lambda: low.slices == {0, 1}, 10, "low's slices after it left 2 and 3")

    ray_local.kill(op.handle, no_restart=False)  # Ray restarts it; it replays its log; the members go on
    high.close()
    until(lambda: hooks.grants, 60, "low lent high's slices back")
    assert hooks.grants == [frozenset({2, 3})] and low.slices == {0, 1, 2, 3}
    status = op.call("status")
    assert set(status["jobs"]) == {"low"} and status["free"] == []
    low.close()
    assert op.call("status")["free"] == [0, 1, 2, 3]


def test_join_waits_bounded_and_says_why(ray_local, pool) -> None:
    name, token, _ = pool
    low = _member(name, token, "alice", name="low", min_slices=2, max_slices=4)
    low.join(30)
    mid = _member(name, token, "bob", name="mid", priority=-1, min_slices=3, max_slices=3)
    with pytest.raises(PoolError, match="waited 1 s for 3 slice.*waiting, needs min_slices=3"):
        mid.join(1)
    with pytest.raises(PoolError, match="min_slices=5 but the pool has 4 slices"):
        _member(name, token, "bob", name="big", min_slices=5, max_slices=5).join(5)
    low.close()
