"""Test set-up: 8 forced CPU devices (set before jax is imported) and an embedded Ray for integration tests."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
if "ELASTIC_HOME" not in os.environ:  # job tokens and run records of the tests stay out of the user's home
    import tempfile

    os.environ["ELASTIC_HOME"] = tempfile.mkdtemp(prefix="elastic-home-")

import pytest  # noqa: E402


@pytest.fixture
def ray_local():
    """A Ray driver connection: the embedded local cluster, started once and shared."""
    import ray

    from elastic.cluster import connect

    connect()
    yield ray
