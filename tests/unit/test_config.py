"""Configuration validation and the pickling of every public error."""
from __future__ import annotations

import pickle

import pytest

from elastic.config import ElasticConfig, Policy
from elastic.errors import ConfigError, ElasticError, GiveUpError, RecoveryTimeoutError, SupervisorError
from runtime.reshard import StructureError
from runtime.topology import TopologyError
from snapshot.errors import NoSnapshotError, SnapshotCorruptError, SnapshotError, SnapshotStructureError

# (id, kwargs, words the message must hold: the field and what to do or what was wrong)
POLICY_BAD = [
    ("min-slices-zero", {"min_slices": 0}, ("min_slices", "at least 1", "0")),
    ("min-slices-negative", {"min_slices": -3}, ("min_slices", "at least 1", "-3")),
    ("repair-timeout-zero", {"repair_timeout_s": 0.0}, ("repair_timeout_s", "positive")),
    ("repair-timeout-negative", {"repair_timeout_s": -1.0}, ("repair_timeout_s", "positive")),
    ("repair-timeout-nan", {"repair_timeout_s": float("nan")}, ("repair_timeout_s", "positive")),
    ("max-failures-negative", {"max_slice_failures": -1}, ("max_slice_failures", "0 (no limit) or more")),
]

CONFIG_BAD = [
    ("min-slices-above-num-slices", {"num_slices": 2, "policy": Policy(min_slices=3)},
     ("min_slices=3", "num_slices=2", "lower min_slices to at most 2")),
    ("heartbeat-timeout-equals-interval", {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.0},
     ("heartbeat_timeout_s", "heartbeat_interval_s", "must exceed")),
    ("heartbeat-timeout-below-interval", {"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 0.5},
     ("heartbeat_timeout_s", "heartbeat_interval_s", "must exceed")),
    ("heartbeat-interval-zero", {"heartbeat_interval_s": 0.0}, ("heartbeat_interval_s", "positive")),
    ("startup-timeout-negative", {"startup_timeout_s": -5.0}, ("startup_timeout_s", "positive")),
    ("recovery-timeout-zero", {"recovery_timeout_s": 0}, ("recovery_timeout_s", "positive")),
    ("job-name-empty", {"job_name": ""}, ("job_name", "letters, digits")),
    ("job-name-space", {"job_name": "my job"}, ("job_name", "'my job'")),
    ("job-name-slash", {"job_name": "a/b"}, ("job_name", "'a/b'")),
    ("job-name-dot", {"job_name": "v1.2"}, ("job_name", "'v1.2'")),
    ("num-steps-zero", {"num_steps": 0}, ("num_steps", "at least 1", "0")),
    ("num-slices-zero", {"num_slices": 0, "policy": Policy(min_slices=1)}, ("num_slices", "at least 1")),
    ("devices-per-slice-zero", {"devices_per_slice": 0}, ("devices_per_slice", "at least 1")),
    ("snapshot-every-zero", {"snapshot_every": 0}, ("snapshot_every", "at least 1")),
    ("keep-snapshots-zero", {"keep_snapshots": 0}, ("keep_snapshots", "at least 1")),
    ("transient-retries-negative", {"max_transient_retries": -1}, ("max_transient_retries", "0 or more")),
]


@pytest.mark.parametrize(("kwargs", "words"), [pytest.param(k, w, id=i) for i, k, w in POLICY_BAD])
def test_policy_rejects(kwargs, words):
    with pytest.raises(ConfigError) as info:
        Policy(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ElasticError)
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} lacks {w!r}"


@pytest.mark.parametrize(("kwargs", "words"), [pytest.param(k, w, id=i) for i, k, w in CONFIG_BAD])
def test_config_rejects(kwargs, words):
    with pytest.raises(ConfigError) as info:
        ElasticConfig(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ElasticError)
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} lacks {w!r}"


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"num_slices": 2, "policy": Policy(min_slices=2)}, id="min-equals-num"),
        pytest.param({"job_name": "run-7_b"}, id="job-name-dash-underscore"),
        pytest.param({"num_steps": 1, "snapshot_every": 1, "keep_snapshots": 1}, id="smallest"),
        pytest.param({"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.11}, id="timeout-just-above"),
        pytest.param({"max_transient_retries": 0}, id="no-retries"),
    ],
)
def test_config_accepts(kwargs):
    cfg = ElasticConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(cfg, k) == v


def test_config_namespace_and_frozen():
    cfg = ElasticConfig(job_name="exp-1")
    assert cfg.namespace == "elastic-exp-1"
    with pytest.raises(AttributeError):
        cfg.num_steps = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        ElasticConfig("exp-1")  # type: ignore[misc]  # keyword-only


ERRORS = [
    ("config", ConfigError("num_steps must be at least 1, got 0")),
    ("elastic", ElasticError("plain")),
    ("give-up", GiveUpError("only 1 usable slice(s) (0), below min_slices=2", epoch=7)),
    ("give-up-default-epoch", GiveUpError("too few")),
    ("recovery-timeout", RecoveryTimeoutError("no membership view within 5s")),
    ("supervisor", SupervisorError("could not reach the supervisor")),
    ("snapshot-corrupt", SnapshotCorruptError(12, 3)),
    ("snapshot-structure", SnapshotStructureError("target shardings have structure ...")),
    ("no-snapshot", NoSnapshotError("no intact snapshot is held")),
    ("snapshot-root", SnapshotError("x")),
    ("topology", TopologyError("choose a divisor of 8")),
    ("reshard-structure", StructureError("differ in structure")),
]


@pytest.mark.parametrize("err", [pytest.param(e, id=i) for i, e in ERRORS])
def test_error_pickle_round_trip(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.args == err.args
    for field in ("reason", "epoch", "step", "leaf"):
        if hasattr(err, field):
            assert getattr(back, field) == getattr(err, field)


def test_give_up_error_fields():
    err = GiveUpError("too few slices", epoch=4)
    assert err.reason == "too few slices" and err.epoch == 4
    assert "epoch 4" in str(err) and "too few slices" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert (back.reason, back.epoch) == ("too few slices", 4)
    assert isinstance(back, ElasticError)


def test_snapshot_corrupt_error_fields():
    err = SnapshotCorruptError(12, 3)
    back = pickle.loads(pickle.dumps(err))
    assert (back.step, back.leaf) == (12, 3)
    assert "step 12" in str(back) and "leaf 3" in str(back)


@pytest.mark.parametrize(
    ("err", "bases"),
    [
        pytest.param(ConfigError("x"), (ElasticError, ValueError), id="config"),
        pytest.param(RecoveryTimeoutError("x"), (ElasticError, TimeoutError), id="recovery-timeout"),
        pytest.param(SnapshotStructureError("x"), (SnapshotError, ValueError), id="snapshot-structure"),
        pytest.param(NoSnapshotError("x"), (SnapshotError, LookupError), id="no-snapshot"),
        pytest.param(TopologyError("x"), (ValueError,), id="topology"),
        pytest.param(StructureError("x"), (ValueError,), id="reshard-structure"),
    ],
)
def test_error_hierarchy(err, bases):
    for b in bases:
        assert isinstance(err, b)
