"""The one module that uses Ray's private API: each function does what its callers rely on, on a real Ray."""

from __future__ import annotations

import uuid

from elastic.supervision import ray_internals as ri
from elastic.supervision.identity import holder


def test_kv_round_trip(ray_local):
    ns = f"test-{uuid.uuid4().hex[:8]}"
    assert not ri.kv_exists(b"a/1", namespace=ns)
    assert ri.kv_put(b"a/1", b"x", namespace=ns) is False  # not there before
    assert ri.kv_put(b"a/1", b"y", namespace=ns, overwrite=False) is True  # there: left as it was
    ri.kv_put(b"a/2", b"z", namespace=ns)
    assert ri.kv_get(b"a/1", namespace=ns) == b"x"
    assert ri.kv_exists(b"a/1", namespace=ns)
    assert sorted(ri.kv_list(b"a/", namespace=ns)) == [b"a/1", b"a/2"]
    assert ri.kv_multi_get([b"a/1", b"a/2", b"a/3"], namespace=ns) == {b"a/1": b"x", b"a/2": b"z"}
    assert ri.kv_del(b"a/", namespace=ns, del_by_prefix=True) == 2
    assert ri.kv_list(b"a/", namespace=ns) == []


def test_actor_id_and_tables(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Probe:
        def ident(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    name = f"probe-{uuid.uuid4().hex[:8]}"
    handle = Probe.options(name=name, namespace="test-internals").remote()
    try:
        ident = ri.actor_id(handle)
        assert ident == ray.get(handle.ident.remote(), timeout=60)
        entry = ri.actor_table(ident)
        assert entry["Address"]["NodeID"]  # what the drain source reads: the node the actor runs on
        assert holder(name, "test-internals") == ident  # read from the raw table of every actor
        assert isinstance(ri.draining_nodes(), dict)
    finally:
        ray.kill(handle, no_restart=True)


def test_gcs_client_answers(ray_local):
    client = ri.gcs_client(ray_local.get_runtime_context().gcs_address)
    assert callable(client.drain_node)  # what the Slurm drain forwarder calls
