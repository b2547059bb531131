"""Multi-controller mode: one worker process per slice joined by jax.distributed (gloo on CPU); a worker's process
is SIGKILLed and the survivors re-form the group in place (same processes), resume from their host snapshots,
and a new process for the lost slice joins at a step boundary.

The first tests need no Ray: the failure classification, the pinned private jaxlib call, and join/leave/reform
in two plain subprocesses (this test process only hosts the service, so its own jax backend is untouched).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from runtime import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jax_error(message: str) -> BaseException:
    try:
        raise jax.errors.JaxRuntimeError(message)
    except jax.errors.JaxRuntimeError as err:
        return err


@pytest.mark.parametrize("message, peer_loss", [
    ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
     "5000ms for recv operation to complete", True),
    ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
     "[127.0.0.1]:42673: Connection reset by peer", True),
    ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
     "[127.0.0.1]:43750", True),
    ("UNAVAILABLE: task 3 heartbeat timeout", True),  # runtime.classify's codes still count
    ("INVALID_ARGUMENT: shapes (3,) and (4,) do not match", False),
    ("UNKNOWN: some other runtime failure", False),
])
def test_peer_loss_classification(message: str, peer_loss: bool) -> None:
    assert distributed.is_peer_loss(_jax_error(message)) is peer_loss
    wrapped = RuntimeError("in the step")
    wrapped.__cause__ = _jax_error(message)
    assert distributed.is_peer_loss(wrapped) is peer_loss
    assert distributed.is_peer_loss(ValueError(message)) is False  # only runtime errors of jax


def test_private_service_call_is_pinned() -> None:
    """CoordinationService relies on this private jaxlib function and these keywords (jax 0.10.2)."""
    from jax._src.lib import _jax

    doc = _jax.get_distributed_runtime_service.__doc__
    for word in ("address", "num_nodes", "heartbeat_timeout", "shutdown_timeout", "recoverable"):
        assert word in doc, f"get_distributed_runtime_service lost {word!r}: {doc}"
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    for name in ("client", "service", "process_id", "num_processes", "coordinator_address", "partition_index"):
        assert hasattr(state, name), f"jax's distributed State lost {name!r}"
    service = distributed.CoordinationService(2)
    assert service.running and service.address.endswith(f":{service.port}")
    service.stop()
    assert not service.running


_MEMBER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_cpu_collective_timeout_seconds=5"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from runtime import distributed
    pid0 = os.getpid()
    for address in sys.argv[2:]:
        distributed.reform(address, 2, int(sys.argv[1]))
        devices = jax.devices()
        sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
        x = jax.make_array_from_callback((4,), sharding, lambda i: np.arange(4.0, dtype=np.float32)[i])
        print("sum", float(jax.jit(jnp.sum)(x)), len(devices), os.getpid() == pid0, flush=True)
    distributed.leave()
""")


def test_join_leave_reform_in_the_same_processes() -> None:
    """Two processes join a group served from here, compute across processes, leave, and join a new group on a
    new port (a new service) in the same processes."""
    first, second = distributed.CoordinationService(2), distributed.CoordinationService(2)
    try:
        env = dict(os.environ, PYTHONPATH=ROOT)
        procs = [subprocess.Popen([sys.executable, "-c", _MEMBER, str(i), first.address, second.address],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                 for i in range(2)]
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        first.stop()
        second.stop()
    for out in outs:
        assert [line for line in out.splitlines() if line.startswith("sum")] == ["sum 6.0 4 True"] * 2, out


_LONELY = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from runtime import distributed
    start = time.monotonic()
    try:
        distributed.reform(sys.argv[1], 2, 0, timeout_s=2)  # the other member never comes
        print("joined", flush=True)
    except Exception as err:
        print("refused", round(time.monotonic() - start, 1), type(err).__name__, flush=True)
    distributed.reform(sys.argv[2], 1, 0)
    print("sum", float(jax.jit(jnp.sum)(jnp.arange(4.0))), len(jax.devices()), flush=True)
    distributed.leave()
""")


def test_a_failed_rendezvous_raises_and_the_process_lives_on() -> None:
    """A group whose other member never joins (it died before the rendezvous): jax's default would abort this
    process; here the join raises within about twice its timeout and the process joins the next group."""
    broken, next_group = distributed.CoordinationService(2), distributed.CoordinationService(1)
    try:
        proc = subprocess.run([sys.executable, "-c", _LONELY, broken.address, next_group.address],
                              capture_output=True, text=True, timeout=90, env=dict(os.environ, PYTHONPATH=ROOT))
    finally:
        broken.stop()
        next_group.stop()
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines[0].startswith("refused") and float(lines[0].split()[1]) < 15, lines
    assert lines[1] == "sum 6.0 2", lines


# -- with Ray: real worker processes, one SIGKILLed ---------------------------------------------------------

def _run(spec, *, revive_at, gate=None):  # noqa: ANN001, ANN202
    """With ``gate`` (a file path), the group waits before ``kill_at`` until the kill: it lands exactly there."""
    from elastic.config import Policy
    from elastic.demos.processes import ProcessFaults, init_state, loop
    from elastic.placements.mc_driver import McConfig, McDriver

    from .helpers import FaultGate, gated_mc_loop

    config = McConfig(num_steps=spec.steps, num_slices=spec.num_slices, snapshot_every=spec.snapshot_every,
                      replace_lost=revive_at is not None, policy=Policy(min_slices=1))
    faults = ProcessFaults(kill_slice=spec.kill_slice, kill_at=spec.kill_at, revive_at=revive_at)
    hooks = (faults,) if gate is None else (faults, FaultGate(gate))
    step_loop = loop if gate is None else gated_mc_loop(gate, spec.kill_at)
    with McDriver(config, init_fn=init_state, loop=step_loop, hooks=hooks) as driver:
        out = driver.run()
    return out["report"], out["params"]


def _check_promises(report, params, spec) -> None:  # noqa: ANN001
    from elastic.demos.demo import max_abs_diff
    from elastic.demos.processes import reference_params

    assert report["failures_injected"] == 1 and report["recoveries"] >= 1
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0
    assert report["steps_committed"] == spec.steps
    assert report["client_restarts"] == 0
    assert all(s < 15.0 for s in report["recovery_seconds"]), report["recovery_seconds"]
    reference, _ = reference_params(spec)
    assert max_abs_diff(params["params"], reference) <= 1e-4
    assert np.isfinite(report["final_loss"])


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_sigkilled_worker_survivors_reform_in_place_and_a_new_one_joins(ray_local, tmp_path) -> None:  # noqa: ANN001
    """A random worker SIGKILLed at a random step (seeded: ``ELASTIC_TEST_SEED`` replays a failure); the survivors
    re-form in their own processes, and a new process for the slice joins at a boundary by ``revive_at``."""
    import random

    from elastic.demos.processes import McDemoSpec

    seed = int(os.environ.get("ELASTIC_TEST_SEED", random.SystemRandom().randrange(2**31)))
    rng = random.Random(seed)
    kill_at = rng.randint(1, 10)
    spec = McDemoSpec(steps=24, num_slices=3, kill_slice=rng.randrange(3), kill_at=kill_at, revive_at=kill_at + 6,
                      snapshot_every=5)
    print(f"ELASTIC_TEST_SEED={seed}: slice {spec.kill_slice} killed at step {spec.kill_at}")
    report, params = _run(spec, revive_at=spec.revive_at, gate=str(tmp_path / "gate"))
    _check_promises(report, params, spec)
    started = next(e for e in report["timeline"] if e["event"] == "workers_started")["pids"]
    assert killed_pid(report) == started[spec.kill_slice]
    assert report["steps_recomputed"] == spec.kill_at % spec.snapshot_every  # back to the snapshot before it
    lost = {e["slice"] for e in report["timeline"] if e["event"] == "worker_lost"}
    assert report["worker_processes_restarted"] == 0
    survivors = [s for s in range(3) if s not in lost]
    first_after = next(e for e in report["timeline"] if e["event"] == "group_formed" and e["epoch"] == 2)
    assert first_after["members"] == survivors  # the killed one, and any survivor gloo aborted, left out
    assert report["survivors_lost"] == len(lost) - 1
    assert report["reform_seconds"] and report["reform_seconds"][0] < 5.0

    assert report["grows"] == 1 and report["slices_final"] == 3  # the new processes joined
    join = next(e for e in report["timeline"] if e["event"] == "join_requested")
    assert join["before_step"] <= spec.revive_at + 6  # by revive_at, give or take the steps between two polls
    grown = [e for e in report["timeline"] if e["event"] == "group_formed"][-1]
    assert grown["members"] == [0, 1, 2]
    assert grown["start_step"] == join["before_step"]  # the new member starts at the boundary, from peers' shards
    for s in survivors:  # the survivors ran every group in their first process
        assert report["worker_pids"][s] == started[s]
    for s in lost:
        assert report["worker_pids"][s] != started[s]


def killed_pid(report) -> int:  # noqa: ANN001
    return next(e for e in report["timeline"] if e["event"] == "worker_killed")["pid"]
