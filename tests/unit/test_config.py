"""Configuration validation and the pickling of every public error."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from elastic.config import ElasticConfig, Policy, Tiers, check_batch_splits
from elastic.errors import ConfigError, ElasticError, GiveUpError, RecoveryTimeoutError, SupervisorError
from elastic.loop.run import batch_rows
from elastic.runtime.guard import StepHungError
from elastic.runtime.reshard import StructureError
from elastic.runtime.topology import TopologyError
from elastic.snapshot.errors import NoSnapshotError, SnapshotCorruptError, SnapshotError, SnapshotStructureError

# (id, kwargs, words the message must hold: the field and what to do or what was wrong)
POLICY_BAD = [
    ("min-slices-zero", {"min_slices": 0}, ("min_slices", "at least 1", "0")),
    ("min-slices-negative", {"min_slices": -3}, ("min_slices", "at least 1", "-3")),
    ("repair-timeout-zero", {"repair_timeout_s": 0.0}, ("repair_timeout_s", "positive")),
    ("repair-timeout-negative", {"repair_timeout_s": -1.0}, ("repair_timeout_s", "positive")),
    ("repair-timeout-nan", {"repair_timeout_s": float("nan")}, ("repair_timeout_s", "positive")),
    ("max-failures-negative", {"max_slice_failures": -1}, ("max_slice_failures", "0 (no limit) or more")),
    # types: a raw TypeError ('<' not supported) before, a ConfigError naming the field and value now
    ("min-slices-str", {"min_slices": "2"}, ("min_slices", "int", "'2'", "str")),
    ("min-slices-float", {"min_slices": 2.0}, ("min_slices", "int", "2.0", "float")),
    ("min-slices-bool", {"min_slices": True}, ("min_slices", "int", "True", "bool")),
    ("max-failures-float", {"max_slice_failures": 1.5}, ("max_slice_failures", "int", "1.5")),
    ("max-failures-none", {"max_slice_failures": None}, ("max_slice_failures", "int", "None")),
    ("repair-timeout-inf", {"repair_timeout_s": math.inf}, ("repair_timeout_s", "finite", "inf")),
    ("repair-timeout-str", {"repair_timeout_s": "60"}, ("repair_timeout_s", "number of seconds", "'60'")),
    ("repair-timeout-bool", {"repair_timeout_s": True}, ("repair_timeout_s", "number of seconds", "bool")),
    ("respawn-every-zero", {"respawn_every_s": 0.0}, ("respawn_every_s", "positive", "or None")),
    ("respawn-every-negative", {"respawn_every_s": -1.0}, ("respawn_every_s", "positive", "-1.0")),
    ("respawn-every-inf", {"respawn_every_s": math.inf}, ("respawn_every_s", "finite", "inf")),
    ("respawn-every-nan", {"respawn_every_s": math.nan}, ("respawn_every_s", "finite", "nan")),
    ("respawn-every-str", {"respawn_every_s": "5"}, ("respawn_every_s", "number of seconds", "'5'")),
    ("respawn-every-bool", {"respawn_every_s": True}, ("respawn_every_s", "number of seconds", "bool")),
]

TIERS_BAD = [
    ("copies-zero", {"copies": 0}, ("tiers.copies", "at least 1", "0")),
    ("copies-float", {"copies": 2.0}, ("tiers.copies", "int", "2.0")),
    ("copies-str", {"copies": "2"}, ("tiers.copies", "int", "'2'")),
    ("keeper-every-negative", {"keeper_every": -1}, ("tiers.keeper_every", "at least 0")),
    ("keeper-every-bool", {"keeper_every": False}, ("tiers.keeper_every", "int", "bool")),
    ("keepers-none", {"keepers": None}, ("tiers.keepers", "int", "None")),
    ("persistent-every-float", {"persistent_every": 10.5}, ("tiers.persistent_every", "int", "10.5")),
    ("on-busy-other", {"on_busy": "drop"}, ("tiers.on_busy", "'coalesce' or 'wait'", "'drop'")),
    ("on-busy-list", {"on_busy": ["wait"]}, ("tiers.on_busy", "'coalesce' or 'wait'")),
    ("persistent-dir-blank", {"persistent_dir": "  "}, ("tiers.persistent_dir", "directory or bucket path")),
    ("persistent-dir-int", {"persistent_dir": 5}, ("tiers.persistent_dir", "directory or bucket path", "5")),
]

CONFIG_BAD = [
    (
        "min-slices-above-num-slices",
        {"num_slices": 2, "policy": Policy(min_slices=3)},
        ("min_slices=3", "num_slices=2", "lower min_slices to at most 2"),
    ),
    (
        "heartbeat-timeout-equals-interval",
        {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.0},
        ("heartbeat_timeout_s", "heartbeat_interval_s", "must exceed"),
    ),
    (
        "heartbeat-timeout-below-interval",
        {"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 0.5},
        ("heartbeat_timeout_s", "heartbeat_interval_s", "must exceed"),
    ),
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
    # integers must be ints: not floats (a raw TypeError mid-run before), bools or strings
    ("num-steps-float", {"num_steps": 2.5}, ("num_steps", "int", "2.5", "float")),
    ("num-steps-whole-float", {"num_steps": 100.0}, ("num_steps", "int", "100.0")),
    ("num-steps-bool", {"num_steps": True}, ("num_steps", "int", "True", "bool")),
    ("num-slices-str", {"num_slices": "4"}, ("num_slices", "int", "'4'", "str")),
    ("devices-per-slice-float", {"devices_per_slice": 2.0}, ("devices_per_slice", "int", "2.0")),
    ("devices-per-slice-numpy", {"devices_per_slice": np.int64(2)}, ("devices_per_slice", "int", "int64")),
    ("snapshot-every-none", {"snapshot_every": None}, ("snapshot_every", "int", "None")),
    ("keep-snapshots-str", {"keep_snapshots": "2"}, ("keep_snapshots", "int", "'2'")),
    ("seed-float", {"seed": 0.5}, ("seed", "int", "0.5")),
    ("seed-str", {"seed": "0"}, ("seed", "int", "'0'")),
    ("seed-too-big", {"seed": 2**64}, ("seed", "64-bit", str(2**64))),
    ("seed-too-small", {"seed": -(2**63) - 1}, ("seed", "64-bit")),
    ("transient-retries-float", {"max_transient_retries": 1.0}, ("max_transient_retries", "int", "1.0")),
    ("global-batch-zero", {"global_batch_size": 0}, ("global_batch_size", "at least 1", "or None")),
    ("global-batch-float", {"global_batch_size": 48.0}, ("global_batch_size", "int", "48.0")),
    ("global-batch-str", {"global_batch_size": "48"}, ("global_batch_size", "int", "'48'")),
    # durations: finite and positive (inf and nan were accepted before)
    ("heartbeat-timeout-inf", {"heartbeat_timeout_s": math.inf}, ("heartbeat_timeout_s", "finite", "inf")),
    ("heartbeat-timeout-nan", {"heartbeat_timeout_s": math.nan}, ("heartbeat_timeout_s", "finite", "nan")),
    ("heartbeat-timeout-negative", {"heartbeat_timeout_s": -3.0}, ("heartbeat_timeout_s", "positive", "-3.0")),
    ("heartbeat-interval-inf", {"heartbeat_interval_s": math.inf}, ("heartbeat_interval_s", "finite")),
    ("heartbeat-interval-nan", {"heartbeat_interval_s": math.nan}, ("heartbeat_interval_s", "finite")),
    ("startup-timeout-inf", {"startup_timeout_s": math.inf}, ("startup_timeout_s", "finite", "inf")),
    ("recovery-timeout-nan", {"recovery_timeout_s": math.nan}, ("recovery_timeout_s", "finite", "nan")),
    ("recovery-timeout-neg-inf", {"recovery_timeout_s": -math.inf}, ("recovery_timeout_s", "positive")),
    ("startup-timeout-str", {"startup_timeout_s": "60"}, ("startup_timeout_s", "number of seconds", "'60'")),
    ("heartbeat-timeout-none", {"heartbeat_timeout_s": None}, ("heartbeat_timeout_s", "number of seconds", "None")),
    ("step-timeout-zero", {"step_timeout_s": 0.0}, ("step_timeout_s", "positive", "or None")),
    ("step-timeout-inf", {"step_timeout_s": math.inf}, ("step_timeout_s", "finite", "or None")),
    ("step-timeout-nan", {"step_timeout_s": math.nan}, ("step_timeout_s", "finite")),
    ("step-timeout-str", {"step_timeout_s": "30"}, ("step_timeout_s", "number of seconds", "'30'")),
    # the other fields
    ("job-name-int", {"job_name": 5}, ("job_name", "5")),
    ("simulated-int", {"simulated": 1}, ("simulated", "bool", "1")),
    ("policy-dict", {"policy": {"min_slices": 2}}, ("policy", "Policy", "dict")),
    ("tiers-none", {"tiers": None}, ("tiers", "Tiers", "None")),
]


@pytest.mark.parametrize(("kwargs", "words"), [pytest.param(k, w, id=i) for i, k, w in POLICY_BAD])
def test_policy_rejects(kwargs, words):
    with pytest.raises(ConfigError) as info:
        Policy(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ElasticError)
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} lacks {w!r}"


@pytest.mark.parametrize(("kwargs", "words"), [pytest.param(k, w, id=i) for i, k, w in TIERS_BAD])
def test_tiers_rejects(kwargs, words):
    with pytest.raises(ConfigError) as info:
        Tiers(**kwargs)
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
        pytest.param(
            {"heartbeat_interval_s": 1, "heartbeat_timeout_s": 5, "startup_timeout_s": 30, "recovery_timeout_s": 60},
            id="whole-second-durations-as-ints",
        ),
        pytest.param({"startup_timeout_s": np.float64(30.0)}, id="numpy-float-duration"),
        pytest.param({"seed": -1}, id="negative-seed"),
        pytest.param({"seed": 2**63 - 1}, id="largest-seed"),
        pytest.param({"global_batch_size": None}, id="no-global-batch"),
        pytest.param({"step_timeout_s": None}, id="step-watchdog-off"),
        pytest.param({"step_timeout_s": 5}, id="step-timeout-int"),
        pytest.param({"global_batch_size": 40}, id="global-batch-any-size-at-config"),
        pytest.param({"tiers": Tiers(keeper_every=0, persistent_dir="/tmp/ckpt")}, id="tiers"),
        pytest.param({"policy": Policy(min_slices=2, repair_timeout_s=5, max_slice_failures=0)}, id="policy"),
        pytest.param({"policy": Policy(respawn_every_s=None)}, id="respawn-off"),
        pytest.param({"policy": Policy(respawn_every_s=5)}, id="respawn-every-int"),
        pytest.param({"policy": Policy(respawn_every_s=0.5)}, id="respawn-every-float"),
    ],
)
def test_config_accepts(kwargs):
    cfg = ElasticConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(cfg, k) == v


BATCH_SPLITS = [
    # (num_slices, devices_per_slice, min_slices, rows, device counts the job may run on, failing counts or None,
    #  sizes the message suggests)
    (4, 2, 3, 40, (6, 8), "6", "24 or 48"),
    (4, 2, 3, 48, (6, 8), None, ""),
    (4, 2, 1, 48, (2, 4, 6, 8), None, ""),
    (4, 2, 1, 32, (2, 4, 6, 8), "6", "24 or 48"),
    (4, 2, 4, 12, (8,), "8", "8 or 16"),  # no shrink allowed: the message does not offer raising min_slices
    (4, 2, 2, 3, (4, 6, 8), "4, 6 or 8", "multiple of 24 (e.g. 24)"),
    (2, 1, 1, 7, (1, 2), "2", "6 or 8"),
    (1, 1, 1, 7, (1,), None, ""),
]


@pytest.mark.parametrize(("num_slices", "per_slice", "min_slices", "rows", "counts", "bad", "sizes"), BATCH_SPLITS)
def test_check_batch_splits(num_slices, per_slice, min_slices, rows, counts, bad, sizes):
    cfg = ElasticConfig(num_slices=num_slices, devices_per_slice=per_slice, policy=Policy(min_slices=min_slices))
    assert cfg.device_counts == counts
    if bad is None:
        check_batch_splits(rows, cfg, what="a batch")
        return
    with pytest.raises(ConfigError) as info:
        check_batch_splits(rows, cfg, what="a batch")
    msg = str(info.value)
    for w in (
        f"a batch of {rows} rows",
        f"split over {bad} devices",
        sizes,
        "elastic.optax_step",
        f"policy.min_slices={min_slices}",
    ):
        assert w in msg, f"{msg!r} lacks {w!r}"
    assert ("raise policy.min_slices" in msg) == (len(counts) > 1)


BATCH_ROWS_BAD = [
    ("empty", {}, "no array leaves"),
    ("none", None, "no array leaves"),
    ("scalar-leaf", {"x": np.zeros((8, 2)), "lr": np.float32(0.1)}, "a leaf ['lr'] of shape ()"),
    ("sizes-differ", {"x": np.zeros((8, 2)), "y": np.zeros((6,))}, "different leading sizes [6, 8]"),
]


@pytest.mark.parametrize(("batch", "words"), [pytest.param(b, w, id=i) for i, b, w in BATCH_ROWS_BAD])
def test_batch_rows_rejects(batch, words):
    with pytest.raises(ConfigError) as info:
        batch_rows(batch, what="run.shard_batch got")
    assert str(info.value).startswith("run.shard_batch got") and words in str(info.value)


def test_batch_rows():
    assert batch_rows((np.zeros((40, 3)), {"y": np.zeros((40,))}), what="x") == 40
    assert batch_rows(np.zeros((5,)), what="x") == 5


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
    ("step-hung", StepHungError("step 3", 1.5, pending=2, total=5, hint="raise step_timeout_s")),
]


@pytest.mark.parametrize("err", [pytest.param(e, id=i) for i, e in ERRORS])
def test_error_pickle_round_trip(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.args == err.args
    for field in ("reason", "epoch", "step", "leaf", "what", "timeout_s", "pending", "total", "hint"):
        if hasattr(err, field):
            assert getattr(back, field) == getattr(err, field)


def test_give_up_error_fields():
    err = GiveUpError("too few slices", epoch=4)
    assert err.reason == "too few slices" and err.epoch == 4
    assert "epoch 4" in str(err) and "too few slices" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert (back.reason, back.epoch) == ("too few slices", 4)
    assert isinstance(back, ElasticError)


def test_step_timeout_default_and_first_step_wait():
    cfg = ElasticConfig()
    assert cfg.step_timeout_s == 300.0
    assert cfg.step_wait_s(first=False) == 300.0 and cfg.step_wait_s(first=True) == 900.0
    off = ElasticConfig(step_timeout_s=None)
    assert off.step_wait_s(first=False) is None and off.step_wait_s(first=True) is None


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
        pytest.param(StepHungError("step 3", 1.0), (TimeoutError,), id="step-hung"),
    ],
)
def test_error_hierarchy(err, bases):
    for b in bases:
        assert isinstance(err, b)


def test_steps_in_flight_defaults_to_two_in_one_process_and_one_across_processes():
    from elastic.config import Processes

    assert ElasticConfig().in_flight == 2
    assert ElasticConfig(processes=Processes()).in_flight == 1  # a step ahead collides with a broken collective
    assert ElasticConfig(processes=Processes(), steps_in_flight=2).in_flight == 2
    assert ElasticConfig(steps_in_flight=1).in_flight == 1
    with pytest.raises(ConfigError, match="steps_in_flight"):
        ElasticConfig(steps_in_flight=0)
