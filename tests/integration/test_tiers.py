"""The snapshot tiers under a job: a crashed client resumed from the keepers, a stopped job resumed from
Orbax onto another slice count, two slices lost at once. Each keeps exactly-once (the state records
every step it applied and the batch it ate)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import ray

from elastic import ElasticError, Faults, Policy, Tiers
from elastic.control.teardown import cleanup

from .helpers import ledger_job

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLIENT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import ray
from elastic import Faults, Tiers
from tests.integration.helpers import ledger_job
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
job, loop = ledger_job({name!r}, Faults().kill_client(at_step={kill_at}), tiers={tiers})
with job:
    job.run(loop)
raise SystemExit("the client should have been SIGKILLed")
"""


def crash_a_client(name: str, kill_at: int, tiers: str) -> None:
    """Run a ledger job in a separate driver process that SIGKILLs itself as step ``kill_at`` starts."""
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    code = textwrap.dedent(CLIENT.format(name=name, kill_at=kill_at, tiers=tiers))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def assert_exactly_once(result, n: int = 40) -> None:
    state = result.state
    assert np.array_equal(np.asarray(state["applied"]), np.ones(n, np.int32)), np.asarray(state["applied"])
    assert np.array_equal(np.asarray(state["batch_of"]), np.arange(n, dtype=np.int32))
    r = result.report
    assert r.steps_committed == n and r.duplicate_steps == 0 and r.skipped_steps == 0


def test_a_stopped_job_resumes_from_orbax_on_fewer_slices(ray_local, tmp_path):
    name = "tier-orbax-resume"
    tiers = f"Tiers(keeper_every=0, persistent_dir={str(tmp_path)!r}, persistent_every=10)"
    crash_a_client(name, 23, tiers)
    cleanup(name)  # everything of the first run is gone but its checkpoints
    job, loop = ledger_job(
        name,
        tiers=Tiers(keeper_every=0, persistent_dir=str(tmp_path), persistent_every=10),
        num_slices=3,
        policy=Policy(min_slices=2, repair_timeout_s=30.0),
    )
    with job:
        result = job.run(loop)
    assert_exactly_once(result)
    r = result.report
    assert r.resumed_from_tier == "persistent" and r.restores[0]["step"] in (10, 20)
    assert r.slices_initial == 3 and r.client_restarts == 1


def test_two_slices_lost_at_once_fall_back_to_the_keepers(ray_local):
    """With copies=2 the small ledger state's 'applied' leaf lives on slices 0 and 1 only: losing both
    makes the in-memory snapshot unusable, and the keeper tier restores an older, intact one."""
    faults = Faults().kill_slice(0, at_step=12).kill_slice(1, at_step=12)
    job, loop = ledger_job("tier-two-lost", faults, tiers=Tiers(copies=2, keeper_every=1))
    with job:
        result = job.run(loop)
        keepers = len(job._mode.tiers._keepers.handles())
    assert_exactly_once(result)
    tiers = [r["tier"] for r in result.report.restores]
    assert tiers == ["keeper"], result.report.restores
    assert result.report.min_slices_seen == 2
    assert keepers == 1  # tiers.keepers=2, but a one-node cluster: one keeper


def test_two_slices_lost_without_another_tier_is_a_clear_error(ray_local):
    faults = Faults().kill_slice(0, at_step=12).kill_slice(1, at_step=12)
    job, loop = ledger_job("tier-two-lost-alone", faults, tiers=Tiers(copies=2, keeper_every=0))
    with job, pytest.raises(ElasticError, match="no tier can restore the state"):
        job.run(loop)


def test_a_restore_onto_slices_lost_meanwhile_is_a_slice_loss(ray_local):
    """The view a restore targets may be stale already (every slice killed at once: the supervisor shrank to two
    that died as well). Placing onto them must fail like a lost slice, which the job recovers from or gives up on,
    not raise the tiers' "no tier can restore" error (the chaos suite's every_slice once ended so under load)."""
    from elastic import runtime
    from elastic.supervision.membership import View

    job, _ = ledger_job("tier-stale-view", tiers=Tiers(copies=2, keeper_every=0))
    with job:
        placement = job._new_placement()
        try:
            placement.prepare(View(epoch=1, active=frozenset(range(4))), live=False, during=lambda *a: None)
            state = placement._prepared[2]
            job._mode.tiers.save(0, state, {"extras": {}})
            assert job.latest_snapshot().step == 0
            for s in job.topology.slices:
                runtime.simulated.kill_slice(s)
            with pytest.raises(Exception) as caught:
                placement.prepare(View(epoch=2, active=frozenset({2, 3})), live=False, during=lambda *a: None)
            assert runtime.classify_failure(caught.value) is runtime.FailureKind.SLICE_LOSS, caught.value
        finally:
            runtime.simulated.reset()
            placement.close()
