"""Test set-up: 8 forced CPU devices (set before jax is imported) and an embedded Ray for integration tests."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
if "ELASTIC_HOME" not in os.environ:  # job tokens and run records of the tests stay out of the user's home
    import tempfile

    os.environ["ELASTIC_HOME"] = tempfile.mkdtemp(prefix="elastic-home-")

import pytest


@pytest.fixture
def ray_local():
    """A Ray driver connection: the embedded local cluster, started once and shared."""
    import ray

    from elastic.control.cluster import connect

    connect()
    yield ray


# The longest files first: `make test` hands whole files to two workers (pytest-xdist, --dist loadfile) in
# collection order, so starting with the long ones keeps one worker from finishing a long file alone at the end.
_LONG_FIRST = (
    "test_slurm.py",
    "test_chaos.py",
    "test_processes_faults.py",
    "test_demo_cli.py",
    "test_job_submit.py",
    "test_submit_own_script.py",
    "test_flax.py",
    "test_processes.py",
    "test_operator_cli.py",
    "test_supervision_holes.py",
    "test_data_pipeline.py",
    "test_tiers.py",
)


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        name = item.path.name
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and among the rest, is kept
