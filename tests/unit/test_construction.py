"""Bad input fails when the job is built (no Ray, no training), with a ConfigError that says what to fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import elastic.api.job
from elastic import ConfigError, ElasticConfig, ElasticJob, Policy, Run, Trainer, View, optax_step
from elastic.runtime import simulated_topology
from elastic.runtime.mesh import build_mesh


def _config(**overrides) -> ElasticConfig:
    base = dict(
        job_name="construction",
        simulated=True,
        num_slices=4,
        devices_per_slice=2,
        num_steps=10,
        policy=Policy(min_slices=3),
    )
    base.update(overrides)
    return ElasticConfig(**base)


def _init(key):
    return {"w": jnp.zeros((24, 4)), "b": jnp.zeros((4,))}


@pytest.fixture
def build(monkeypatch):
    """``build(config, **kwargs)``: an ElasticJob, closed after the test; JAX's cache settings left alone."""
    monkeypatch.setattr(elastic.api.job, "_use_compilation_cache", lambda job_name: None)
    jobs: list[ElasticJob] = []

    def make(config: ElasticConfig | None = None, **kwargs) -> ElasticJob:
        job = ElasticJob(config or _config(), **{"init_fn": _init, **kwargs})
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


def test_a_good_job_builds(build):
    job = build(shardings_fn=lambda mesh: {"w": P(("replica", "local")), "b": P()})
    assert job.topology.num_slices == 4


def test_real_devices_by_default(build):
    """``simulated`` defaults to False: the job's slices are the devices jax sees (here the 8 CPU devices), and a
    config asking for another count fails at construction with one line naming the settings."""
    assert ElasticConfig(job_name="x").simulated is False
    job = build(_config(simulated=False))
    assert [d.id for s in job.topology.slices for d in s.devices] == [d.id for d in jax.devices()]
    with pytest.raises(ConfigError) as info:
        build(_config(simulated=False, num_slices=3))
    msg = str(info.value)
    assert "\n" not in msg and "num_slices=3 x devices_per_slice=2 needs 6 devices but jax sees 8" in msg
    assert "num_slices=4, devices_per_slice=2" in msg and "simulated=True" in msg


@pytest.mark.parametrize(
    "init_fn",
    [
        pytest.param(lambda key: None, id="none"),
        pytest.param(lambda key: {"params": None, "opt": ()}, id="no-array-leaves"),
    ],
)
def test_state_without_array_leaves(build, init_fn):
    with pytest.raises(ConfigError, match="init_fn.*no array leaves"):
        build(init_fn=init_fn)


def test_init_fn_not_callable(build):
    with pytest.raises(ConfigError, match="init_fn must be a callable"):
        build(init_fn={"w": jnp.zeros(3)})


SPECS_BAD = [
    (
        "unknown-axis",
        {"w": P("model"), "b": P()},
        (r"state leaf ['w'] of shape (24, 4)", "'model'", "('replica', 'local')"),
    ),
    ("unknown-axis-in-tuple", {"w": P(("replica", "data")), "b": P()}, ("['w']", "'data'", "('replica', 'local')")),
    ("more-entries-than-dims", {"w": P(), "b": P(None, "local")}, ("['b'] of shape (4,)", "2 entries", "1 dimension")),
    ("duplicate-axis", {"w": P("replica", "replica"), "b": P()}, ("['w']", "'replica' more than once")),
    ("not-a-spec", {"w": "replica", "b": P()}, ("['w']", "'replica' (str)", "PartitionSpec or a Sharding")),
]


@pytest.mark.parametrize(("specs", "words"), [pytest.param(s, w, id=i) for i, s, w in SPECS_BAD])
def test_partition_spec_that_does_not_fit_names_the_leaf(build, specs, words):
    with pytest.raises(ConfigError) as info:
        build(shardings_fn=lambda mesh: specs)
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} lacks {w!r}"


def test_mesh_fn_that_drops_devices(build):
    def mesh_fn(groups):
        return Mesh(np.array([g[0] for g in groups]), ("replica",))

    with pytest.raises(ConfigError, match="mesh_fn over 3 slice.*exactly the healthy devices"):
        build(mesh_fn=mesh_fn)


def test_global_batch_that_would_not_split_after_a_shrink(build):
    """40 rows split over 8 devices but not over the 6 left after losing a slice: it fails now, not mid-run."""
    with pytest.raises(ConfigError) as info:
        build(_config(global_batch_size=40))
    msg = str(info.value)
    for w in ("global_batch_size", "40 rows", "over 6 devices", "6 or 8 devices", "multiple of 24 (e.g. 24 or 48)"):
        assert w in msg, f"{msg!r} lacks {w!r}"


def test_global_batch_that_splits_everywhere_or_is_microbatched(build):
    build(_config(global_batch_size=48))
    build(_config(global_batch_size=40), microbatched=True)
    build(_config(global_batch_size=40, policy=Policy(min_slices=4)))  # never shrinks: 8 devices only


def test_trainer_checks_the_global_batch_unless_it_microbatches(monkeypatch):
    monkeypatch.setattr(elastic.api.job, "_use_compilation_cache", lambda job_name: None)
    params = lambda key: {"w": jnp.zeros((4,))}  # noqa: E731
    batch_fn = lambda step: np.zeros((40, 4), np.float32)  # noqa: E731
    cfg = _config(global_batch_size=40)
    Trainer(
        init_fn=params,
        step_fn=optax_step(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1)),
        batch_fn=batch_fn,
        config=cfg,
    ).job.close()
    with pytest.raises(ConfigError, match="over 6 devices"):
        Trainer(init_fn=params, step_fn=lambda state, batch: (state, {}), batch_fn=batch_fn, config=cfg)


def test_trainer_learns_the_batch_size_from_the_first_batch(monkeypatch):
    """No declared global_batch_size: batch_fn(0) tells the size, and a batch a shrink would strand (32 rows on 8
    devices, 6 after a slice is lost: the NNX tutorial's batch) is refused at construction, not after 20 steps."""
    monkeypatch.setattr(elastic.api.job, "_use_compilation_cache", lambda job_name: None)
    params = lambda key: {"w": jnp.zeros((4,))}  # noqa: E731
    asked: list[int] = []

    def batch_fn(step):
        asked.append(step)
        return np.zeros((32, 4), np.float32)

    with pytest.raises(
        ConfigError,
        match=r"batch_fn\(0\) returned a batch of 32 rows does not split over 6 devices.*"
        r"multiple of 24.*elastic.Trainer with elastic.optax_step",
    ):
        Trainer(init_fn=params, step_fn=lambda state, batch: (state, {}), batch_fn=batch_fn, config=_config())
    assert asked == [0]
    Trainer(
        init_fn=params,
        step_fn=optax_step(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1)),
        batch_fn=batch_fn,
        config=_config(),
    ).job.close()  # micro-batches: any size goes


class _Host:
    """The little a Run asks of its controller, for shard_batch."""

    def __init__(self, config: ElasticConfig) -> None:
        self.config = config
        self.num_steps = config.num_steps
        self.seed = config.seed


def _run(config: ElasticConfig) -> Run:
    mesh = build_mesh(simulated_topology(config.num_slices, config.devices_per_slice).slices)
    return Run(
        _Host(config),
        view=View(epoch=1, active=frozenset(range(config.num_slices))),
        mesh=mesh,
        state=None,
        start_step=0,
        extras={},
    )


def test_shard_batch_rejects_at_the_first_step_a_batch_a_shrink_would_strand():
    run = _run(_config())  # 8 devices now; 6 after a shrink
    assert run.num_devices == 8
    with pytest.raises(ConfigError) as info:
        run.shard_batch({"x": np.zeros((40, 3), np.float32), "y": np.zeros((40,), np.float32)})
    for w in ("a batch of 40 rows", "over 6 devices", "6 or 8 devices", "24 or 48", "elastic.optax_step"):
        assert w in str(info.value)


def test_shard_batch_splits_a_batch_that_fits_every_mesh():
    placed = _run(_config()).shard_batch({"x": np.ones((48, 3), np.float32)})
    assert placed["x"].shape == (48, 3)
    assert {s.data.shape for s in placed["x"].addressable_shards} == {(6, 3)}


@pytest.mark.parametrize(
    ("batch", "words"),
    [
        pytest.param({"x": np.zeros((48, 2)), "lr": 0.1}, "a leaf ['lr'] of shape ()", id="scalar-leaf"),
        pytest.param((np.zeros((48, 2)), np.zeros((24,))), "different leading sizes [24, 48]", id="sizes-differ"),
    ],
)
def test_shard_batch_rejects_leaves_without_one_batch_dimension(batch, words):
    with pytest.raises(ConfigError) as info:
        _run(_config()).shard_batch(batch)
    assert words in str(info.value)


def test_key_is_unchanged():
    run = _run(_config(seed=3))
    assert (
        jax.random.key_data(run.key(2)).tolist()
        == jax.random.key_data(jax.random.fold_in(jax.random.key(3), 2)).tolist()
    )
