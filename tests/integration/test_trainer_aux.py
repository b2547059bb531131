"""A Trainer with BatchNorm statistics (aux) and dropout (per-example keys) survives a shrink from 8 devices
to 6 (32 rows: 30 + 2 micro-batches there) and ends with the state of a failure-free run on the same
device sets: the recomputed steps draw the same dropout masks, and the aux follows the documented
size-weighted merge on 6 devices."""

from __future__ import annotations

import jax
import pytest

from elastic import Faults, Trainer
from elastic.api.trainer import StepRunner

from ..unit.test_trainer_aux import batch, bn_step, diff, init_params, place, step_key
from .helpers import config

pytestmark = pytest.mark.integration


def test_aux_and_dropout_survive_a_shrink_like_a_failure_free_run(ray_local):
    opt = bn_step("weighted_mean")
    meshes = {}  # step -> the mesh its committed result was computed on (a recomputed step: the last one)
    cfg = config("aux-shrink", num_steps=12, snapshot_every=5)
    trainer = Trainer(
        init_fn=init_params,
        step_fn=opt,
        batch_fn=batch,
        config=cfg,
        faults=Faults().kill_slice(2, at_step=8),
        on_step=lambda step, metrics, run: meshes.__setitem__(step, run.mesh),
    )
    result = trainer.fit()
    report = result.report
    assert report.recoveries == 1 and report.min_slices_seen == 3
    assert report.steps_recomputed > 0, "the restore must recompute steps, with their dropout keys"
    sizes = [meshes[s].devices.size for s in range(cfg.num_steps)]
    assert sizes[0] == 8 and sizes[-1] == 6, sizes

    # The failure-free reference: the same steps, each on the mesh the Trainer's committed step used.
    state = opt.init(init_params(jax.random.key(cfg.seed)))
    runner = StepRunner(opt)
    for step in range(cfg.num_steps):
        state, _ = runner.on_mesh(meshes[step])(place(state, meshes[step]), batch(step), step_key(step, cfg.seed))
    for part in ("params", "opt_state", "aux"):
        gap = diff(result.state[part], state[part])
        print(f"{part}: max |diff| against the failure-free run = {gap:.2e}")
        assert gap < 1e-6, part
    assert int(result.state["aux"]["count"]) == cfg.num_steps
