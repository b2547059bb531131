"""The pool actor on a real Ray: decisions carried out and logged, the actor killed and restarted by Ray (its state
replayed from the signed log), and the boundary between users."""

from __future__ import annotations

import pytest

from elastic.errors import AccessError, ConfigError
from elastic.pool import JobSpec
from elastic.pool.access import user_credential
from elastic.pool.actor import actor_name
from elastic.pool.client import PoolHandle, find_pool, start_pool
from elastic.supervision import credential, identity
from tests.conftest import until


@pytest.fixture
def pool(ray_local, request):
    token = credential.new_token()
    name = f"p{abs(hash(request.node.nodeid)) % 10**8}"
    handle = start_pool(name, 5, token, quotas={"bob": 4}, users=["alice"])
    yield name, token, handle
    ray_local.kill(handle.handle, no_restart=True)
    identity.forget(f"pool-{name}")


def test_lend_reclaim_give_back_and_replay_after_a_kill(ray_local, pool) -> None:
    name, token, op = pool
    alice = find_pool(name, user_credential(token, "alice"), user="alice")
    bob = find_pool(name, user_credential(token, "bob"), user="bob")
    low = alice.call("submit", JobSpec(name="low", user="alice", min_slices=1, max_slices=5))
    assert low["slices"] == [0, 1, 2, 3, 4] and low["state"] == "running"
    high = bob.call("submit", JobSpec(name="high", user="bob", priority=10, max_slices=3, spares=1))
    assert high["state"] == "waiting" and high["slices"] == []
    low = alice.call("wait_lease", "low", 0, 5.0)
    assert low["leave"] == [2, 3, 4], "the reclaim notice is in low's lease"

    ray_local.kill(op.handle, no_restart=False)  # Ray restarts it; it replays its log
    before = low["version"]
    low = until(lambda: _try(alice, "lease", "low"), 60, "the restarted pool answering")
    assert low["leave"] == [2, 3, 4] and low["version"] == before, "the state replayed, nothing decided twice"

    alice.call("release", "low", [2, 3, 4])
    high = bob.call("lease", "high")
    assert high["slices"] == [2, 3, 4] and high["state"] == "running"
    bob.call("slice_failed", 3)
    low = alice.call("lease", "low")
    assert low["leave"] == [1], "a hot swap for high's failed slice"
    alice.call("release", "low", [1])
    op.call("slice_returned", 3)
    assert alice.call("lease", "low")["slices"] == [0, 3]
    bob.call("leave", "high")
    low = alice.call("lease", "low")
    assert low["slices"] == [0, 1, 2, 3, 4] and low["seconds_below_asked"] > 0
    status = op.call("status")
    assert status["free"] == [] and set(status["jobs"]) == {"low"}
    kinds = [r["kind"] for r in op.call("events")]
    assert kinds[0] == "pool_started" and "pool_restarted" in kinds and kinds.count("decision") == 7


def test_the_boundary_between_users(ray_local, pool) -> None:
    name, token, op = pool
    alice = find_pool(name, user_credential(token, "alice"), user="alice")
    bob = find_pool(name, user_credential(token, "bob"), user="bob")
    alice.call("submit", JobSpec(name="a1", user="alice", max_slices=2))
    with pytest.raises(AccessError, match="not user 'bob'"):
        bob.call("release", "a1", [0])
    with pytest.raises(AccessError, match="not user 'bob'"):
        bob.call("lease", "a1")
    with pytest.raises(AccessError, match="as user 'alice'"):
        bob.call("submit", JobSpec(name="b1", user="alice"))
    with pytest.raises(AccessError, match=rf"slice_returned refused \(.*\): only pool '{name}''s operator"):
        bob.call("slice_returned", 0)
    status = bob.call("status")
    assert status["jobs"] == {} and status["held_by_others"] == 2
    assert bob.call("events") == []
    with pytest.raises(AccessError):  # alice's credential presented as bob's
        find_pool(name, user_credential(token, "alice"), user="bob").call("status")
    with pytest.raises(identity.SquatError):  # a user not admitted has no record to find the pool by
        find_pool(name, user_credential(token, "carol"), user="carol")
    with pytest.raises(AccessError):  # a forged operator credential
        PoolHandle(op.handle, "forged").call("status")
    with pytest.raises(ConfigError, match="min_slices=6 but the pool has 5"):
        alice.call("submit", JobSpec(name="a2", user="alice", min_slices=6, max_slices=6))
    assert identity.holder(actor_name(name), "elastic-pools") is not None
    refused = [r["command"] for r in op.call("events") if r["kind"] == "refused_command"]
    assert refused == ["slice_returned", "status"], "the operator sees the calls refused"


def _try(pool, method, *args):
    try:
        return pool.call(method, *args, timeout_s=5.0)
    except Exception:  # noqa: BLE001 - the restarting actor: asked again
        return None


def test_metrics_per_pool_and_job(ray_local, pool) -> None:
    """The pool's Ray metrics on Ray's Prometheus endpoint: a job taken below its minimum is suspended."""
    name, token, op = pool
    alice = find_pool(name, user_credential(token, "alice"), user="alice")
    bob = find_pool(name, user_credential(token, "bob"), user="bob")
    alice.call("submit", JobSpec(name="low", user="alice", min_slices=2, max_slices=5))
    high = bob.call("submit", JobSpec(name="high", user="bob", priority=10, min_slices=4, max_slices=4))
    low = alice.call("lease", "low")
    assert low["state"] == "suspended" and low["leave"] == [0, 1, 2, 3, 4] and high["state"] == "waiting"
    ports = [n["MetricsExportPort"] for n in ray_local.nodes() if n["Alive"]]  # the pool's node among them
    want = {
        ("ray_elastic_pool_job_state", (("job", "low"), ("state", "suspended"))): 1.0,
        ("ray_elastic_pool_job_state", (("job", "low"), ("state", "running"))): 0.0,
        ("ray_elastic_pool_job_state", (("job", "high"), ("state", "waiting"))): 1.0,
        ("ray_elastic_pool_job_slices_lent", (("job", "low"),)): 5.0,
        ("ray_elastic_pool_job_slices_asked", (("job", "high"),)): 4.0,
        ("ray_elastic_pool_queue_length", ()): 2.0,
        ("ray_elastic_pool_slices", (("kind", "reclaiming"),)): 5.0,
        ("ray_elastic_pool_reclaims_total", (("job", "low"), ("kind", "suspend"))): 5.0,
    }

    def scraped():
        got = {k: v for port in ports for k, v in _scrape(port, name).items()}
        return got if all(got.get(k) == v for k, v in want.items()) else None

    got = until(scraped, 40, "the pool's metrics on Ray's endpoint (reported every 10 s by default)", every_s=0.5)
    assert got[("ray_elastic_pool_job_seconds_below_asked", (("job", "high"),))] >= 0


def _scrape(port: int, pool: str) -> dict:
    """Ray's endpoint's samples of ``pool`` as {(name, ((label, value), ...) but pool's): value}."""
    import re
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r"^(ray_elastic_pool_\w+)\{(.*)\} (\S+)$", body, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        if labels.get("pool") == pool:
            mine = tuple(sorted((k, v) for k, v in labels.items() if k in ("job", "state", "kind")))
            out[(m[1], mine)] = float(m[3])
    return out
