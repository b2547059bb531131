"""Data positions in the snapshot (elastic.loop.data, Run.data/batches): real Grain iterators, no cluster."""

from __future__ import annotations

import copy
import json
from typing import Any

import grain
import jax.numpy as jnp
import numpy as np
import pytest

from elastic import ElasticConfig, Policy, Run
from elastic.errors import ConfigError, ElasticError
from elastic.loop.data import POSITIONS_KEY, from_plain, open_data, record_positions, to_plain
from elastic.runtime import build_mesh, simulated_topology
from elastic.snapshot.persistent import _decode, _encode
from elastic.supervision.membership import View


class _Source:
    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"id": np.int32(i)}

    def __repr__(self) -> str:
        return "_Source()"


def _loader() -> grain.DataLoader:
    sampler = grain.samplers.IndexSampler(
        num_records=100, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=None, seed=3
    )
    return grain.DataLoader(
        data_source=_Source(),
        sampler=sampler,
        worker_count=0,
        operations=[grain.transforms.Batch(8, drop_remainder=True)],
    )


def _dataset() -> grain.IterDataset:
    return grain.MapDataset.source(_Source()).shuffle(seed=3).repeat(None).batch(8).to_iter_dataset()


PIPELINES = [
    pytest.param(_loader, id="DataLoader"),
    pytest.param(_dataset, id="IterDataset"),
    pytest.param(lambda: grain.MapDataset.source(_Source()).shuffle(seed=3).repeat(None).batch(8), id="MapDataset"),
]


def _ids(batch: Any) -> list[int]:
    return np.asarray(batch["id"]).tolist()


@pytest.mark.parametrize(
    "state",
    [
        None,
        3,
        {"next_index": 7},
        b'{\n "version": 2}',
        {"a": (1, [2.5, "x"], b"\x00\xff"), "b": None},
    ],
)
def test_plain_state_round_trips_through_the_json_snapshot_tier(state):
    plain = to_plain(state)
    stored = json.loads(json.dumps(_encode({"extras": {POSITIONS_KEY: {"data": plain}}})))
    assert from_plain(_decode(stored)["extras"][POSITIONS_KEY]["data"]) == state


def test_numpy_scalars_become_python_scalars():
    assert to_plain({"i": np.int64(4), "f": np.float32(0.5)}) == {"i": 4, "f": 0.5}


@pytest.mark.parametrize(
    ("state", "where"),
    [
        pytest.param(np.zeros(3), "state is a ndarray", id="array"),
        pytest.param({"k": object()}, "state['k'] is a object", id="object-leaf"),
        pytest.param({1: 2}, "state is a dict", id="int-keys"),
    ],
)
def test_state_that_is_not_plain_data_is_refused(state, where):
    with pytest.raises(ConfigError, match="plain data") as info:
        to_plain(state)
    assert where in str(info.value) and isinstance(info.value, ElasticError)


@pytest.mark.parametrize("make", PIPELINES)
def test_a_recorded_position_resumes_exactly(make):
    step: list[int | None] = [0]
    extras: dict[str, Any] = {}
    data = open_data(make(), name="data", extras=extras, start_step=0, current_step=lambda: step[0])
    first = [_ids(next(data)) for _ in range(15)]  # past an epoch of 100 examples
    record_positions(extras, {"data": data})
    after = [_ids(next(data)) for _ in range(4)]
    saved = copy.deepcopy(extras)
    resumed = open_data(make(), name="data", extras=saved, start_step=15, current_step=lambda: step[0])
    assert [_ids(next(resumed)) for _ in range(4)] == after
    fresh = open_data(make(), name="data", extras={}, start_step=0, current_step=lambda: step[0])
    assert [_ids(next(fresh)) for _ in range(15)] == first  # no position saved: the pipeline's start


def test_an_iterator_without_get_state_is_refused_with_what_it_needs():
    with pytest.raises(ConfigError) as info:
        open_data(lambda: (i for i in range(10)), name="data", extras={}, start_step=0, current_step=lambda: 0)
    for words in ("generator has no get_state() and set_state(state)", "grain's DataLoader", "get_batch(step)"):
        assert words in str(info.value)
    with pytest.raises(ConfigError, match="list_iterator has no get_state"):
        open_data([1, 2, 3], name="data", extras={}, start_step=0, current_step=lambda: 0)


def test_an_iterator_object_is_refused_in_favour_of_its_pipeline():
    with pytest.raises(ConfigError, match="pass the pipeline itself"):
        open_data(iter(_dataset()), name="data", extras={}, start_step=0, current_step=lambda: 0)


def test_a_pass_after_step_0_needs_a_saved_position():
    with pytest.raises(ConfigError, match="the snapshot of step 5 holds no position"):
        open_data(
            _loader(),
            name="train",
            extras={POSITIONS_KEY: {"eval": {"next_index": 0}}},
            start_step=5,
            current_step=lambda: 5,
        )


def test_pulls_outside_a_step_and_an_exhausted_pipeline_are_refused():
    step: list[int | None] = [None]
    finite = grain.MapDataset.source(_Source()).batch(50)  # two batches, then done
    data = open_data(finite, name="data", extras={}, start_step=0, current_step=lambda: step[0])
    with pytest.raises(ConfigError, match="outside a step"):
        next(data)
    step[0] = 0
    next(data), next(data)
    with pytest.raises(ConfigError, match="ran out at step 0"):
        next(data)


# -- through Run, with a host that records what each commit would snapshot ----------------------
class _Host:
    def __init__(self, config: ElasticConfig) -> None:
        self.config, self.num_steps, self.seed = config, config.num_steps, config.seed
        self.saved: dict[int, dict[str, Any]] = {}  # next_step -> the extras a snapshot there would hold

    def before_step(self, step: int) -> None:
        pass

    def committed(self, run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None:
        self.saved[step + 1] = copy.deepcopy(run.extras)

    def boundary(self, run: Run, next_step: int) -> None:
        return None

    def must_confirm(self, step: int) -> bool:
        return False  # steps run ahead: each commit's positions must still reach its own confirmation

    def record_call(self, *args: Any) -> None:
        pass


def _run(host: _Host, start_step: int, extras: dict[str, Any]) -> Run:
    mesh = build_mesh(simulated_topology(4, 2).slices)
    return Run(
        host,
        view=View(epoch=1, active=frozenset(range(4))),
        mesh=mesh,
        state=jnp.zeros(()),
        start_step=start_step,
        extras=extras,
    )


def test_run_batches_records_the_position_at_each_commit_and_resumes_from_it():
    host = _Host(
        ElasticConfig(
            simulated=True,
            job_name="data",
            num_slices=4,
            devices_per_slice=2,
            num_steps=12,
            policy=Policy(min_slices=2),
        )
    )
    seen: dict[int, list[int]] = {}
    run = _run(host, 0, {})
    for step, batch in run.batches(_loader()):
        seen[step] = _ids(batch)
        run.commit(jnp.ones(()))
    resumed: dict[int, list[int]] = {}
    run = _run(host, 7, copy.deepcopy(host.saved[7]))  # a restore of the snapshot at step 7
    for step, batch in run.batches(_loader()):
        resumed[step] = _ids(batch)
        run.commit(jnp.ones(()))
    assert resumed == {s: seen[s] for s in range(7, 12)}


def test_run_data_is_opened_once_per_name_per_pass():
    host = _Host(ElasticConfig(simulated=True, job_name="data", num_slices=4, devices_per_slice=2, num_steps=4))
    run = _run(host, 0, {})
    run.data(_loader())
    with pytest.raises(ConfigError, match="already opened"):
        run.data(_loader())
    run.data(_dataset(), name="eval")
