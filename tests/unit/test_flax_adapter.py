"""The Flax adapters without Ray: NNX's in-place trap refused, functional steps equal to plain Flax bit for bit,
shardings from partitioning annotations, RNG streams and BatchNorm statistics in the state."""

from __future__ import annotations

import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from elastic import ConfigError, ElasticConfig, Policy, Run, View
from elastic.api.flax_linen import LinenAdapter
from elastic.api.flax_nnx import NnxAdapter
from elastic.runtime import batch_sharding, build_mesh, simulated_topology

P = PartitionSpec
IS_SPEC = lambda x: isinstance(x, PartitionSpec)  # noqa: E731


# ---- a small NNX model: annotated kernels, BatchNorm, Dropout with its stored RNG stream ------------
class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(16, 24, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)
        self.bn = nnx.BatchNorm(24, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear2 = nnx.Linear(24, 4, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(self.dropout(nnx.relu(self.bn(self.linear1(x)))))


def _loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def plain_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


train_step = nnx.jit(plain_step)  # the tutorial's @nnx.jit step


def _adapter(**kw) -> NnxAdapter:
    return NnxAdapter(
        model_fn=lambda rngs: MLP(rngs=rngs),
        optimizer_fn=lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param),
        **kw,
    )


RULES = [("model", "local")]


def _objects() -> tuple[MLP, nnx.Optimizer]:
    with nnx.use_eager_sharding(False):  # annotated, not placed: no mesh here
        model = MLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.normal(size=(48, 16)).astype(np.float32), rng.integers(0, 4, 48).astype(np.int32)


class _Host:
    def __init__(self) -> None:
        self.config = ElasticConfig(
            simulated=True, job_name="flax-unit", num_slices=4, num_steps=10, policy=Policy(min_slices=3)
        )
        self.num_steps, self.seed, self.recorded = 10, 0, []

    def record_call(self, fn, args, mesh) -> None:
        self.recorded.append(fn)


@pytest.fixture
def run() -> Run:
    mesh = build_mesh(simulated_topology(4, 2).slices)
    return Run(_Host(), view=View(epoch=1, active=frozenset(range(4))), mesh=mesh, state=None, start_step=0, extras={})


def _placed(adapter, init_fn, mesh):
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), adapter.shardings_fn(mesh), is_leaf=IS_SPEC)
    return jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))


def _max_diff(a, b) -> float:
    def num(x):
        x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        return np.asarray(x, np.float64)

    diffs = jax.tree_util.tree_map(lambda x, y: float(np.abs(num(x) - num(y)).max()), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


# ---- the in-place trap -------------------------------------------------------------------------
def test_the_trap_jax_jit_drops_nnx_in_place_updates():
    """Why run.jit refuses: plain jax.jit of the in-place step trains nothing, silently."""
    model, optimizer = _objects()
    before = np.asarray(model.linear2.kernel[...])
    losses = [float(jax.jit(plain_step)(model, optimizer, *_batch(0))) for _ in range(2)]
    assert losses[0] == losses[1] and np.array_equal(before, model.linear2.kernel[...])


def test_run_jit_refuses_an_nnx_jit_function(run):
    with pytest.raises(ConfigError, match=r"nnx\.jit function.*silently train nothing.*NnxAdapter.*run\.guard"):
        run.jit(train_step)


def test_run_jit_and_guard_refuse_nnx_graph_nodes_as_arguments(run):
    model, optimizer = _objects()
    x, y = run.shard_batch(_batch(0))
    for fn in (run.jit(plain_step), run.guard(jax.jit(plain_step))):
        with pytest.raises(ConfigError, match=r"graph nodes \(argument 0: MLP, argument 1: Optimizer\).*NnxAdapter"):
            fn(model, optimizer, x, y)
    assert run._host.recorded == []


def test_run_guard_keeps_an_nnx_jit_functions_updates(run):
    model, optimizer = _objects()
    before = np.asarray(model.linear2.kernel[...])
    step_fn = run.guard(train_step)
    x, y = run.shard_batch(_batch(0))
    losses = {float(step_fn(model, optimizer, x, y)) for _ in range(3)}
    assert len(losses) == 3 and not np.array_equal(before, model.linear2.kernel[...])
    assert int(model.dropout.rngs.count[...]) == 3 and int(optimizer.step[...]) == 3
    assert run._host.recorded == []


# ---- NNX: state, step, shardings -----------------------------------------------------------------
def test_nnx_step_equals_plain_nnx_bit_for_bit_and_carries_rngs_and_batch_stats(run):
    adapter = _adapter(axis_rules=RULES)
    state = _placed(adapter, adapter.init_fn, run.mesh)
    model, optimizer = adapter.merge(state)  # plain NNX from here: objects updated in place
    step_fn = run.jit(adapter.step(train_step))
    for step in range(3):
        x, y = run.shard_batch(_batch(step))
        state, loss = step_fn(state, x, y)
        assert float(loss) == float(train_step(model, optimizer, x, y))
    assert run._host.recorded
    assert _max_diff(state, nnx.state((model, optimizer))) == 0.0
    back = adapter.module(state)
    assert int(back.dropout.rngs.count[...]) == 3 and jax.dtypes.issubdtype(
        back.dropout.rngs.key[...].dtype, jax.dtypes.prng_key
    )
    assert float(jnp.abs(back.bn.mean[...]).max()) > 0 and int(state[1]["step"][...]) == 3
    back.eval()  # the module back, for evaluation
    assert back(jnp.ones((2, 16))).shape == (2, 4)


def test_nnx_shardings_come_from_partitioning_annotations(run):
    adapter = _adapter(axis_rules=RULES)
    specs = adapter.shardings_fn(run.mesh)
    assert jax.tree_util.tree_structure(specs, is_leaf=IS_SPEC) == jax.tree_util.tree_structure(
        jax.eval_shape(adapter.init_fn, jax.random.key(0))
    )
    model, opt = specs[0], specs[1]["opt_state"][0]
    assert model["linear1"]["kernel"].get_value() == P("local")  # ("model", None): trailing None dropped
    assert model["linear2"]["kernel"].get_value() == P(None, "local")
    assert opt["mu"]["linear2"]["kernel"].get_value() == opt["nu"]["linear2"]["kernel"].get_value() == P(None, "local")
    for leaf in (model["linear2"]["bias"], model["bn"]["mean"], model["dropout"]["rngs"]["key"], specs[1]["step"]):
        assert leaf.get_value() == P()
    state = _placed(adapter, adapter.init_fn, run.mesh)
    assert state[0]["linear2"]["kernel"][...].sharding.spec == P(None, "local")
    with pytest.raises(ConfigError, match=r"axis 'model', which the mesh \('replica', 'local'\) lacks.*axis_rules"):
        _adapter().shardings_fn(run.mesh)


def test_nnx_step_refuses_a_structure_change(run):
    def to_eval(model, optimizer, x, y):
        model.eval()
        return jnp.zeros(())

    adapter = _adapter(axis_rules=RULES)
    with pytest.raises(ConfigError, match="changed the structure"):
        jax.eval_shape(adapter.step(to_eval), jax.eval_shape(adapter.init_fn, jax.random.key(0)), *_batch(0))


def test_adapters_check_what_they_are_given():
    with pytest.raises(ConfigError, match="return an nnx.Module"):
        NnxAdapter(model_fn=lambda rngs: {"w": jnp.zeros(3)}, optimizer_fn=lambda m: m).init_fn(jax.random.key(0))
    with pytest.raises(ConfigError, match="optimizer_fn=.*must be a callable"):
        NnxAdapter(model_fn=MLP, optimizer_fn=optax.adam(1e-2))
    with pytest.raises(ConfigError, match=r"axis_rules entry 'model'.*pairs"):
        _adapter(axis_rules=["model", "local"])
    with pytest.raises(ConfigError, match="must be an optax.GradientTransformation"):
        LinenAdapter(module=LinenMLP(), tx=1e-2, sample_input=jnp.zeros((1, 16)))


def test_missing_flax_is_a_config_error_naming_the_extra(monkeypatch):
    for name in ("elastic.api.flax_nnx", "elastic.api.flax_linen"):
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "flax", None)  # what `import flax` meets when it is not installed
        with pytest.raises(ConfigError, match=r"pip install 'jax-elastic\[flax\]'"):
            importlib.import_module(name)
        monkeypatch.undo()


# ---- Linen: TrainState with batch_stats and key ----------------------------------------------------
class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(24, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("hidden", "classes"))
        return nn.Dense(4, kernel_init=init)(x)


def _linen_loss(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"acc": (logits.argmax(1) == labels).mean()}


def _linen(**kw) -> LinenAdapter:
    return LinenAdapter(
        module=LinenMLP(),
        tx=optax.adam(1e-2),
        sample_input=jax.ShapeDtypeStruct((1, 16), jnp.float32),
        init_kwargs={"train": False},
        train_kwargs={"train": True},
        **kw,
    )


LINEN_RULES = [("model", "local"), ("classes", "local"), ("hidden", None)]


@jax.jit
def _plain_linen_step(state, x, y):  # the classic Linen step, as the adapter promises to run it
    dropout = jax.random.fold_in(jax.random.fold_in(state.key, state.step), 0)

    def compute(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            x,
            train=True,
            rngs={"dropout": dropout},
            mutable=["batch_stats"],
        )
        return _linen_loss(logits, y)[0], updates

    (loss, updates), grads = jax.value_and_grad(compute, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), loss


def test_linen_shardings_come_from_partitioning_annotations(run):
    adapter = _linen(axis_rules=LINEN_RULES)
    specs = adapter.shardings_fn(run.mesh)
    assert jax.tree_util.tree_structure(specs, is_leaf=IS_SPEC) == jax.tree_util.tree_structure(
        jax.eval_shape(adapter.init_fn, jax.random.key(0))
    )
    assert specs.params["Dense_0"]["kernel"] == P(None, "local")
    assert specs.params["Dense_1"]["kernel"] == P(None, "local")  # logical ("hidden", "classes") via the rules
    assert specs.opt_state[0].mu["Dense_0"]["kernel"] == P(None, "local")
    assert specs.params["Dense_0"]["bias"] == specs.batch_stats["BatchNorm_0"]["mean"] == specs.key == P()
    with pytest.raises(ConfigError, match=r"axis 'model'.*axis_rules"):
        _linen().shardings_fn(run.mesh)


def test_linen_step_equals_a_plain_step_bit_for_bit(run):
    adapter = _linen(axis_rules=LINEN_RULES)
    state = reference = _placed(adapter, adapter.init_fn, run.mesh)
    assert jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key) and "BatchNorm_0" in state.batch_stats
    step_fn = run.jit(adapter.step(_linen_loss))
    for step in range(3):
        x, y = run.shard_batch(_batch(step))
        state, metrics = step_fn(state, x, y)
        reference, loss = _plain_linen_step(reference, x, y)
        assert float(metrics["loss"]) == float(loss) and set(metrics) == {"loss", "acc"}
    assert _max_diff(state, reference) == 0.0 and int(state.step) == 3
    assert float(jnp.abs(state.batch_stats["BatchNorm_0"]["mean"]).max()) > 0
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "local")
    logits = adapter.module.apply(
        adapter.variables(state), jax.device_put(_batch(0)[0], batch_sharding(run.mesh)), train=False
    )
    assert logits.shape == (48, 4)


def metrics_step(model: MLP, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, x: jax.Array, y: jax.Array):
    """The tutorial's step: the metrics object beside the model and optimizer, updated in place."""
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    metrics.update(loss=loss)
    optimizer.update(model, grads)
    return loss


def test_nnx_extras_carry_the_tutorials_metrics_in_the_state(run):
    """``extras_fn``: the step's further NNX objects (the tutorial's MultiMetric) live in the state, so they are
    snapshotted and moved with it; the step updates them in place and they equal plain NNX's, bit for bit."""
    adapter = _adapter(axis_rules=RULES, extras_fn=lambda model: nnx.MultiMetric(loss=nnx.metrics.Average("loss")))
    state = _placed(adapter, adapter.init_fn, run.mesh)
    model, optimizer, metrics = adapter.merge(state)  # plain NNX from here
    step_fn = run.jit(adapter.step(metrics_step))
    for step in range(3):
        x, y = run.shard_batch(_batch(step))
        state, loss = step_fn(state, x, y)
        assert float(loss) == float(nnx.jit(metrics_step)(model, optimizer, metrics, x, y))
    (carried,) = adapter.extras(state)
    assert float(carried.compute()["loss"]) == float(metrics.compute()["loss"])
    assert int(carried.loss.count[...]) == 3
    with pytest.raises(ConfigError, match="extras_fn"):
        run.jit(adapter.step(plain_step))(state, nnx.MultiMetric(loss=nnx.metrics.Average("loss")), *_batch(0))
