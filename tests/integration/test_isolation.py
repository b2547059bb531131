"""A job is a boundary: another job on the same Ray cluster (holding the cluster token, running no code in our
actors) can neither command nor read this job's supervisor, keepers or stream, nor forge what it stores, nor end
it with ``elastic cleanup``. Each attack is refused, the refusal is an event in the job's stream, and a job
attacked mid-run ends equal to a run nobody attacked."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import stat
import threading
import time
import uuid

import jax.numpy as jnp
import pytest
import ray
from ray.experimental import internal_kv as kv

from elastic import AccessError, ElasticJob, Processes, Tiers
from elastic.cli import main
from elastic.control.cluster import ActorGroup
from elastic.control.teardown import cleanup
from elastic.control.tokens import read_token, token_path
from elastic.ops.runs import open_run
from elastic.snapshot.calls import call_key, sign
from elastic.snapshot.image import checksum, meta_checksum
from elastic.snapshot.keeper import KeeperTier
from elastic.supervision import events
from elastic.supervision.access import MAX_RECORD_BYTES, REFUSALS_WRITER
from elastic.supervision.credential import Credentialed, derive, new_token
from elastic.supervision.identity import holder
from elastic.supervision.notices import make_notice
from elastic.supervision.supervisor import SUPERVISOR_NAME

from .attackers import squat
from .helpers import config, max_abs_diff, trainer
from .test_keeper import make_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _secret(directory, token: str) -> str:
    """A 0600 file holding ``token`` (credentials go to the CLI in files, never on its command line)."""
    path = directory / f"token-{uuid.uuid4().hex[:6]}"
    path.write_text(token)
    path.chmod(0o600)
    return str(path)


def refused(ref) -> bool:
    try:
        ray.get(ref, timeout=30)
    except AccessError:
        return True
    except ray.exceptions.RayTaskError as err:  # a keeper's refusal (the snapshot layer's own error)
        return "refused" in str(err)
    return False


def forge(job: str, run: str, writer: str, seq: int, **fields) -> None:
    """What another job can do with the cluster token: put a record under this job's keys in the GCS store."""
    record = {"wall": 1e10, "writer": writer, "seq": seq, **fields}
    kv._internal_kv_put(
        f"{job}/{run}/{writer}/{seq:012d}".encode(), json.dumps(record).encode(), namespace=events.NAMESPACE
    )


@pytest.fixture(scope="module")
def attacker():
    """Another job on the same cluster, running (its supervisor and agents up, its credential live), for the whole
    module: the tests only use its credential against a job of their own, which leaves it as it was. It beats
    once a second: it is not watched here, only a presence beside the other tests."""
    from elastic.control.cluster import connect

    connect()
    other = ActorGroup(config(f"iso-b-{uuid.uuid4().hex[:6]}", heartbeat_interval_s=1.0, heartbeat_timeout_s=15.0))
    try:
        other.launch()
        yield other
    finally:
        other.shutdown()
        events.delete(other._config.job_name)


@pytest.fixture
def two_jobs(ray_local, attacker):
    """A job of this test's own (attacked), and the module's attacker job."""
    mine = ActorGroup(config(f"iso-a-{uuid.uuid4().hex[:6]}"))
    try:
        mine.launch()
        yield mine, attacker
    finally:
        mine.shutdown()
        events.delete(mine._config.job_name)


def test_another_job_can_neither_command_nor_read_the_supervisor(two_jobs):
    mine, other = two_jobs
    job = mine._config.job_name
    path = token_path(job)
    assert read_token(job) == mine.token != other.token
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    raw = ray.get_actor(SUPERVISOR_NAME, namespace=mine._config.namespace)
    agent_cred = derive(mine.token, "agent")
    calls = {
        "register (hijack: replace the slice set)": lambda h, **t: h.register_slices.remote([(1, 99)], None, **t),
        "heartbeat": lambda h, **t: h.heartbeats.remote([(0, 0)], **t),
        "report_lost": lambda h, **t: h.report_lost.remote([1], "not yours", **t),
        "inject": lambda h, **t: h.inject.remote("kill", 1, **t),
        "close": lambda h, **t: h.close.remote(**t),
        "view": lambda h, **t: h.view.remote(**t),
        "events": lambda h, **t: h.events.remote(**t),
        "run_id": lambda h, **t: h.run_id.remote(**t),
        "usage": lambda h, **t: h.usage.remote(**t),
        "wait_for_epoch": lambda h, **t: h.wait_for_epoch.remote(0, 0.1, **t),
        "respawnable": lambda h, **t: h.respawnable.remote(**t),
        "notice": lambda h, **t: h.notice.remote(make_notice(1, 60.0, "not yours"), **t),
    }
    for what, call in calls.items():
        # the job's token itself is no call's credential either: a call carries a token signed for it
        for token in (None, other.token, "x" * 64, mine.token, agent_cred):
            assert refused(call(raw, token=token)), f"{what} with {token!r} was not refused"
        assert refused(call(Credentialed(raw, other.token))), f"{what} signed by another job was not refused"
    for what in ("report_lost", "inject", "close", "events", "run_id", "notice"):  # agents' credential: no command
        assert refused(calls[what](Credentialed(raw, agent_cred))), what
    assert ray.get(Credentialed(raw, agent_cred).heartbeats.remote([(0, 0)]), timeout=30) == []  # ... but beats
    view = ray.get(mine.supervisor.view.remote(), timeout=30)
    assert view.active == frozenset(range(4)) and view.epoch == 1, view  # nothing happened
    assert refused(raw.__ray_call__.remote(lambda self: repr(vars(self))))  # no code from outside runs in it
    seen = sign(call_key(mine.token), "view")  # one call of the job's own, as an eavesdropper might copy it
    assert ray.get(raw.view.remote(token=seen), timeout=30).epoch == 1
    assert refused(raw.view.remote(token=seen))  # replayed: refused
    assert refused(raw.inject.remote("kill", 1, token=sign(call_key(mine.token), "view")))  # signed for another
    records = events.read(job, mine.run)
    good, forged = events.verify(records, derive(mine.token, "stream"))
    refusals = [r for r in good if r["kind"] == "refused_command"]
    assert not forged and any(r["command"] == "register" for r in refusals)
    assert any(r["command"] == "view" and "replayed" in r["reason"] for r in refusals), refusals[-3:]
    out = ray.get(mine.supervisor.inject.remote("kill", 1), timeout=30)  # its own credential works
    assert out["agent"] == "agent-1-0"


def test_forged_records_are_not_replayed_and_not_shown(two_jobs, monkeypatch, capsys):
    mine, _ = two_jobs
    job, run = mine._config.job_name, mine.run
    forge(
        job,
        run,
        "supervisor",
        9_000,
        kind="view",
        epoch=50,
        active=[0],
        gave_up="forged",
        reason="forged",
        decision="GiveUp",
    )
    forge(
        job, run, "supervisor", 9_001, kind="refused", slice=2, incarnation=0, cause="agent died", epoch=1, mac="0" * 64
    )
    before = ray.get(mine.supervisor.usage.remote(), timeout=30)["pid"]
    mine.kill_supervisor(no_restart=False)  # Ray restarts it: it replays its records
    deadline = time.monotonic() + 60  # ray.kill returns before the process is gone: wait for the new one
    while ray.get(mine.supervisor.usage.remote(), timeout=60)["pid"] == before:
        assert time.monotonic() < deadline, "the supervisor was not restarted"
        time.sleep(0.05)  # a bounded poll of the actor (Ray says nothing when it restarts one)
    view = ray.get(mine.supervisor.wait_for_epoch.remote(0, 1.0), timeout=60)
    assert view.epoch == 1 and view.active == frozenset(range(4)) and view.gave_up is None, view
    refusal = [r for r in events.read(job, run) if r["kind"] == "forged_records_refused"]
    assert refusal and refusal[0]["count"] == 2, refusal
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    source = open_run(job, token=mine.token)
    assert source.forged == 2 and not any(r.get("reason") == "forged" for r in source.records)
    assert main(["status", "--job", job, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["state"] == "running" and "not signed" in captured.err


def test_cleanup_and_reads_of_another_job_are_refused(two_jobs, monkeypatch, capsys, tmp_path):
    mine, other = two_jobs
    job = mine._config.job_name
    with pytest.raises(AccessError, match="refused"):
        cleanup(job, purge_events=True, token=other.token)
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "elsewhere"))  # another user: no token file of the job
    for argv in (
        ["cleanup", "--job-name", job, "--purge-events"],
        ["status", "--job", job],
        ["events", "--job", job],
        ["status", "--job", job, "--token-file", _secret(tmp_path, other.token)],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "credential" in err, (argv, err)
    view = ray.get(mine.supervisor.view.remote(), timeout=30)  # the job is whole
    assert view.active == frozenset(range(4)) and events.read(job, mine.run)
    assert ray.get_actor(SUPERVISOR_NAME, namespace=mine._config.namespace)
    assert main(["status", "--job", job, "--token-file", _secret(tmp_path, mine.token)]) == 0  # its credential
    assert "epoch 1" in capsys.readouterr().out


def test_keepers_answer_their_job_only_and_a_forged_image_is_refused(ray_local):
    namespace, token = f"elastic-iso-k-{uuid.uuid4().hex[:6]}", "t" * 64
    refusals: list[tuple[str, int, str]] = []
    tier = KeeperTier(
        namespace,
        num_keepers=2,
        credential=derive(token, "keeper"),
        image_key=derive(token, "image"),
        on_refused=lambda *a: refusals.append(a),
    ).start()
    try:
        tier.push(make_image(10))
        assert tier.wait(30)
        assert tier.latest().step == 10
        keepers = sorted(tier.handles().items())
        for _, k in keepers:  # another job: no credential, or its own
            for cred in (None, derive("other", "keeper"), derive(token, "keeper")):  # nor the credential itself
                for call in (
                    k.latest.remote(token=cred),
                    k.steps.remote(token=cred),
                    k.drop.remote(token=cred),
                    k.put.remote(make_image(20), token=cred),
                    k.held_bytes.remote(token=cred),
                ):
                    assert refused(call)
        assert tier.latest().step == 10  # nothing was dropped or replaced
        # An image slipped into the first keeper past its gate, checksums recomputed: not sealed by the job.
        good = make_image(30, seed=1)
        data = good.leaves[0].pieces[0].data + 1
        piece = dataclasses.replace(good.leaves[0].pieces[0], data=data, checksum=checksum(data))
        leaf = dataclasses.replace(good.leaves[0], pieces=(piece, *good.leaves[0].pieces[1:]))
        forged = dataclasses.replace(
            good, leaves=(leaf, *good.leaves[1:]), meta_checksum=meta_checksum(good.meta), mac="0" * 64
        )
        forged.verify()  # it passes the checksums
        assert refused(keepers[0][1].__ray_call__.remote(lambda self, im: self._images.append(im), forged))
        ray.get(Credentialed(keepers[0][1], derive(token, "keeper")).put.remote(forged), timeout=30)  # gate passed
        got = tier.latest()
        assert got is not None and got.step == 10, got  # the next keeper's good image
        assert refusals and refusals[0][:2] == (keepers[0][0], 30), refusals
    finally:
        tier.close(kill=True)


def test_a_job_attacked_mid_run_ends_equal_to_the_reference(ray_local):
    """Hijack, forged record, keeper drop and cleanup attempts while the job trains: all refused, result unchanged."""
    t = trainer(f"iso-run-{uuid.uuid4().hex[:6]}", tiers=Tiers())  # with its keeper, for the attack on it
    job = t.job.config.job_name
    attacked = threading.Event()
    outcomes: dict[str, bool] = {}

    def attack(step, metrics, run):
        if step != 12 or attacked.is_set():
            return
        namespace = t.job.config.namespace
        raw = ray.get_actor(SUPERVISOR_NAME, namespace=namespace)
        outcomes["hijack"] = refused(raw.register_slices.remote([(0, 7), (1, 7)], None))
        outcomes["report_lost"] = refused(raw.report_lost.remote([2], "forged"))
        forge(
            job,
            events.current_run(job),
            "supervisor",
            9_000,
            kind="view",
            epoch=99,
            active=[0],
            gave_up=None,
            reason="forged",
            decision="Shrink",
        )
        keepers = [
            e["name"]
            for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == namespace and e["name"].startswith("keeper-")
        ]
        outcomes["keepers"] = bool(keepers) and all(
            refused(ray.get_actor(n, namespace=namespace).drop.remote()) for n in keepers
        )
        agents = [
            ray.get_actor(e["name"], namespace=namespace)
            for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == namespace and e["name"].startswith("agent-")
        ]
        outcomes["agents"] = bool(agents) and all(
            refused(a.silence.remote()) and refused(a.stop_process.remote()) for a in agents
        )
        outcomes["private"] = not any(hasattr(raw, m) for m in ("_observe", "_append", "_refuse", "_evaluate"))
        outcomes["flood"] = all(refused(ref) for ref in [raw.inject.remote("x" * 10_000, 1) for _ in range(500)])
        try:
            cleanup(job, purge_events=True, token="not-the-token")
            outcomes["cleanup"] = False
        except AccessError:
            outcomes["cleanup"] = True
        attacked.set()

    t.job._on_step = attack
    result = t.fit()
    reference = trainer(f"iso-ref-{uuid.uuid4().hex[:6]}").fit()
    assert attacked.is_set() and all(outcomes.values()) and len(outcomes) == 7, outcomes
    assert result.report.steps_committed == 40 and result.report.recoveries == 0
    assert max_abs_diff(result.state, reference.state) == 0.0
    events.delete(job)


def test_events_follow_waits_for_a_job_that_has_not_started(ray_local):
    """`elastic events --follow` before the job's stream exists waits for it, then prints its records until it
    closes (the job's credential given in the environment, as an operator of another user would)."""
    import subprocess
    import sys
    from pathlib import Path

    from elastic.supervision.credential import new_token

    job, token = f"iso-follow-{uuid.uuid4().hex[:6]}", new_token()
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=str(root), ELASTIC_TOKEN=token)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic.cli",
            "events",
            "--follow",
            "--follow-for",
            "90",
            "--job",
            job,
        ],
        env=env,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert "waiting for job" in proc.stderr.readline()  # blocks until the command waits
        key = derive(token, "stream")
        run = events.new_run(job, key=key)
        events.EventStream(job, run, "supervisor", key=key).append("closed")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "run_started" in out and "closed" in out and "Traceback" not in err, (out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
        events.delete(job)


@pytest.mark.parametrize("multi", [False, True], ids=["single-process", "multi-process"])
def test_a_client_refused_at_launch_leaves_the_jobs_actors_alone(ray_local, monkeypatch, multi):
    """A second client of a running job that holds a wrong credential is refused at once, and closing it kills
    none of the job's actors (keepers, agents, supervisor): the job goes on with them, no slice lost."""
    name = f"iso-refused-{'mp' if multi else 'sp'}-{uuid.uuid4().hex[:6]}"
    cfg = config(
        name,
        num_slices=2,
        num_steps=6,
        snapshot_every=2,
        tiers=Tiers(keeper_every=1, keepers=1),
        processes=Processes(replace_lost=False, standby=False) if multi else None,
    )

    def actors() -> list[tuple[str, str]]:  # the job's keepers, agents and supervisor
        return sorted(
            (e["name"], e["namespace"])
            for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == cfg.namespace
        )

    def init(key):
        return {"w": jnp.zeros((8,), jnp.float32)}

    def loop(run):
        state = run.state
        step = run.guard(lambda state: {"w": state["w"] + 1.0})
        for _ in run.steps:
            state = step(state)
            run.commit(state)
        return state

    with ElasticJob(cfg, init_fn=init) as job:
        before = actors()
        assert any(n.startswith("keeper-") for n, _ in before), f"the job started no keeper: {before}"
        monkeypatch.setenv("ELASTIC_TOKEN", "not-this-jobs-token")
        with pytest.raises(AccessError, match="refused"), ElasticJob(cfg, init_fn=init):
            pass
        monkeypatch.delenv("ELASTIC_TOKEN")
        assert actors() == before
        for name_, namespace in before:
            assert ray.get(ray.get_actor(name_, namespace=namespace).__ray_ready__.remote(), timeout=30)
        result = job.run(loop)
    assert result.report.steps_committed == cfg.num_steps and result.report.recoveries == 0


# -- a squatted name: the job never adopts an actor by its name ------------------------------------------------------


def _count_loop(run):
    state = run.state
    step = run.guard(lambda state: {"w": state["w"] + 1.0})
    for _ in run.steps:
        state = step(state)
        run.commit(state)
    return state


def _zeros(key):
    return {"w": jnp.zeros((8,), jnp.float32)}


def _gone(name: str, namespace: str, bound_s: float = 60.0) -> None:
    """Until no actor holds ``name`` (ray.kill returns before the actor is dead)."""
    deadline = time.monotonic() + bound_s
    while holder(name, namespace) is not None:
        assert time.monotonic() < deadline, f"{name} still held after {bound_s}s"
        time.sleep(0.05)  # a bounded poll of Ray's actor table (Ray signals nothing when a name frees)


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_squatted_keeper_name_stops_the_job_and_is_never_called(ray_local, tmp_path):
    """Attack 1: another driver creates ``keeper-0`` in the job's namespace before the job starts, answering with a
    pickle that runs code where it is unpickled. The job stops with one line naming it; the squatter received no
    call (no credential, no image) and nothing of it was unpickled; without it, the same job runs to the end."""
    cfg = config(
        f"iso-ksquat-{uuid.uuid4().hex[:6]}", num_slices=2, num_steps=6, snapshot_every=2, tiers=Tiers(keeper_every=1)
    )
    marker = tmp_path / "unpickled"
    fake = squat("keeper-0", cfg.namespace, marker)
    try:
        with pytest.raises(AccessError) as refusal:
            ElasticJob(cfg, init_fn=_zeros).start()
        assert _one_line(str(refusal.value)) and "keeper-0" in str(refusal.value), refusal.value
        assert ray.get(fake.received.remote(), timeout=30) == [] and not marker.exists()
        left = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == cfg.namespace]
        assert left == ["keeper-0"], left  # the job's own actors are gone; the squatter is left alone
    finally:
        ray.kill(fake, no_restart=True)
    _gone("keeper-0", cfg.namespace)
    with ElasticJob(cfg, init_fn=_zeros) as job:
        result = job.run(_count_loop)
    assert result.report.steps_committed == 6 and float(result.state["w"][0]) == 6.0
    assert not marker.exists()
    events.delete(cfg.job_name)


@pytest.fixture
def crashed_job(ray_local, monkeypatch, tmp_path):
    """A job whose client and supervisor are gone (its stream and token file stay), and a squatter holding its
    supervisor's name."""
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
    group = ActorGroup(config(f"iso-ssquat-{uuid.uuid4().hex[:6]}", num_slices=2))
    group.launch()
    namespace = group._config.namespace
    ray.kill(group.supervisor.handle, no_restart=True)
    _gone(SUPERVISOR_NAME, namespace)
    marker = tmp_path / "unpickled"
    fake = squat(SUPERVISOR_NAME, namespace, marker)
    try:
        yield group, fake, marker
    finally:
        ray.kill(fake, no_restart=True)
        group.shutdown()
        events.delete(group._config.job_name)


def test_a_successor_sends_its_token_to_no_squatted_supervisor(crashed_job):
    """Attack 2, the successor: a client taking the crashed job over finds the supervisor's name held by an actor
    the job did not create. It stops with one line; the squatter received nothing (no token) and nothing of it was
    unpickled."""
    group, fake, marker = crashed_job
    successor = ActorGroup(group._config)
    assert successor.token == group.token
    with pytest.raises(AccessError) as refusal:
        successor.launch()
    assert _one_line(str(refusal.value)) and "was not created by job" in str(refusal.value)
    assert not successor.owns_job
    assert ray.get(fake.received.remote(), timeout=30) == [] and not marker.exists()


def test_operator_commands_send_no_token_to_a_squatted_supervisor(crashed_job, monkeypatch, capsys, tmp_path):
    """Attack 2, the operator: inject, cleanup, status, events and report of the job, with its credential, against a
    squatted supervisor: each a one-line error; the squatter received nothing and nothing of it was unpickled; the
    job's stream is still there."""
    group, fake, marker = crashed_job
    job = group._config.job_name
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    token = ["--token-file", _secret(tmp_path, group.token)]
    for argv in (
        ["inject", "kill", "--job", job, "--slice", "1", "--yes", *token],
        ["cleanup", "--job-name", job, "--purge-events", *token],
        ["status", "--job", job, *token],
        ["events", "--job", job, *token],
        ["report", "--job", job, *token],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert _one_line(err) and "not created by" in err, (argv, err)
    assert ray.get(fake.received.remote(), timeout=30) == [] and not marker.exists()
    assert events.read(job, group.run)  # cleanup purged nothing


# -- every method gated: agents, the supervisor's private methods -----------------------------------------------------


def test_another_job_can_neither_silence_nor_stop_nor_stall_the_agents(two_jobs):
    """Attack 3: ``silence``, ``stall``, ``stop_process`` (and ``start``, ``lifeline``, ``alive``) on another job's
    agents, without the credential or with the attacker's own: refused; no slice of the victim is dropped."""
    mine, other = two_jobs
    namespace = mine._config.namespace
    for index in range(4):
        raw = ray.get_actor(f"agent-{index}-0", namespace=namespace)  # what anyone can get
        for token in (None, other.control, mine.token, derive(mine.token, "agent"), mine.control):
            for call in (
                raw.silence.remote(token=token),
                raw.stall.remote(5.0, token=token),
                raw.stop_process.remote(token=token),
                raw.start.remote(token=token),
                raw.alive.remote(index, token=token),
            ):
                assert refused(call), (index, token)
    view = ray.get(mine.supervisor.wait_for_epoch.remote(1, 3 * 1.5), timeout=60)  # past the heartbeat timeout
    assert view.epoch == 1 and view.active == frozenset(range(4)), view  # nobody was dropped
    assert ray.get(mine.agent(1).alive.remote(1), timeout=30)  # a call signed with its own credential works


def test_the_supervisors_private_methods_are_unreachable(two_jobs):
    """Attack 3: ``_observe`` (make the job give up), ``_append`` (a correctly signed forged record), ``_refuse``,
    ``_evaluate``: no handle offers them, and a restarted supervisor replays only what the job wrote."""
    mine, _ = two_jobs
    job, run = mine._config.job_name, mine.run
    raw = ray.get_actor(SUPERVISOR_NAME, namespace=mine._config.namespace)
    for name in ("_observe", "_append", "_refuse", "_evaluate", "_authorize", "_replay", "_watch", "_run_monitor"):
        with pytest.raises(AttributeError):
            getattr(raw, name)
    before = [r for r in events.read(job, run, writers=["supervisor"])]
    pid = ray.get(mine.supervisor.usage.remote(), timeout=30)["pid"]
    mine.kill_supervisor(no_restart=False)  # Ray restarts it: it replays its records
    deadline = time.monotonic() + 60
    while ray.get(mine.supervisor.usage.remote(), timeout=60)["pid"] == pid:
        assert time.monotonic() < deadline, "the supervisor was not restarted"
        time.sleep(0.05)  # a bounded poll of the actor (Ray says nothing when it restarts one)
    view = ray.get(mine.supervisor.wait_for_epoch.remote(0, 1.0), timeout=60)
    assert view.epoch == 1 and view.active == frozenset(range(4)) and view.gave_up is None, view
    assert [r for r in events.read(job, run, writers=["supervisor"]) if r["seq"] < len(before)] == before


def test_a_purge_after_planting_deletes_nothing_of_the_job(ray_local):
    """Attack 4: another job plants a ``run_started`` signed under its own key (as the first record of a run of
    its making, and inside the job's run) and asks ``cleanup --purge-events`` with that key: only what it planted
    goes; every record of the job stays, and the job's own credential purges them."""
    job, token, attacker = f"iso-purge-{uuid.uuid4().hex[:6]}", new_token(), new_token()
    key = derive(token, "stream")
    run = events.new_run(job, key=key)
    stream = events.EventStream(job, run, "supervisor", key=key)
    for i in range(323):
        stream.append("progress", step=i)
    theirs = derive(attacker, "stream")
    planted = "00000000T000000.000000-0000"  # sorts first, and its wall says it came first
    kv._internal_kv_put(
        f"{job}/{planted}/job/{0:012d}".encode(),
        json.dumps(events.sign({"wall": 0.0, "writer": "job", "seq": 0, "kind": "run_started"}, theirs)).encode(),
        namespace=events.NAMESPACE,
    )
    kv._internal_kv_put(
        f"{job}/{run}/job/{1:012d}".encode(),
        json.dumps(events.sign({"wall": 0.0, "writer": "job", "seq": 1, "kind": "run_started"}, theirs)).encode(),
        namespace=events.NAMESPACE,
    )
    before = events.read(job, run)
    assert len(events.verify(before, key)[0]) == 324
    try:
        cleanup(job, purge_events=True, token=attacker)
        assert events.read(job, run) == before and events.runs(job) == [run]  # only the planted run went
        cleanup(job, purge_events=True, token=token)
        assert events.runs(job) == [] and events.current_run(job) is None
    finally:
        events.delete(job)


def test_a_flood_of_refused_calls_is_bounded_and_evicts_no_history(two_jobs):
    """Attack 5: refused calls on the supervisor for over three seconds (hundreds a second), one of them with a
    command string of a megabyte: the first ten of each method recorded, then at most one a second (the later ones
    written: the bound is a rate, not a cap), none over 4 KiB, and the supervisor's own records (its replay history)
    untouched."""
    mine, other = two_jobs
    job, run = mine._config.job_name, mine.run
    raw = ray.get_actor(SUPERVISOR_NAME, namespace=mine._config.namespace)
    history = events.read(job, run, writers=["supervisor"])
    huge = "x" * 1_000_000
    start, sent = time.monotonic(), 0
    assert refused(raw.inject.remote(huge, 1, token=other.token))
    while sent < 1_000 or time.monotonic() - start < 3.5:  # each batch is answered before the clock is read
        batch = [
            raw.view.remote(token=other.token) if i % 2 else raw.inject.remote(huge[:64], 1, token=None)
            for i in range(200)
        ]
        assert all(refused(ref) for ref in batch)
        sent += len(batch)
    records = [r for r in events.read(job, run) if r["kind"] == "refused_command"]
    assert records and {r["writer"] for r in records} == {REFUSALS_WRITER}
    assert max(len(json.dumps(r)) for r in records) < MAX_RECORD_BYTES
    assert {r["command"] for r in records} <= {"inject", "view", "register", "heartbeat"}, {
        r["command"] for r in records
    }
    for command in ("inject", "view"):
        walls = sorted(r["wall"] for r in records if r["command"] == command)
        assert len(walls) >= 12, (command, sent, walls)  # the burst, then one a second: the flood lasted 3.5 s
        assert all(b - a >= 1.0 - 1e-3 for a, b in zip(walls, walls[10:], strict=False)), walls  # <= 10 a second
    assert events.read(job, run, writers=["supervisor"])[: len(history)] == history
    view = ray.get(mine.supervisor.view.remote(), timeout=30)
    assert view.epoch == 1 and view.active == frozenset(range(4)), view


# -- every method of every named actor refuses a call without the credential ---------------------------------------

# Ray's own: __ray_call__ (refused to every caller: checked apart), __ray_ready__, __ray_terminate__; a handle's
# __init__ is the handle's own Python method, not a call on the actor (``handle.__init__.remote`` does not exist)
RAYS_OWN = {"__ray_call__", "__ray_ready__", "__ray_terminate__", "__init__"}


def _refuses_every_method(handle, original: type, tokens) -> list[str]:
    """Each method a handle of ``handle``'s actor offers (``dir``, Ray's own reflection), called with dummy arguments
    and each of ``tokens``: the names of those that did not refuse."""
    offered = sorted(set(dir(handle)) - RAYS_OWN)
    assert offered and not [m for m in offered if m.startswith("_")], offered  # no private method is offered
    accepted = []
    for name in offered:
        params = inspect.signature(getattr(original, name)).parameters.values()
        required = [p for p in params if p.name not in ("self", "token") and p.default is inspect.Parameter.empty]
        for token in tokens:
            if not refused(getattr(handle, name).remote(*[None] * len(required), token=token)):
                accepted.append(f"{name}({token!r})")
    return accepted


def test_every_method_of_every_actor_refuses_a_call_without_the_credential(ray_local, tmp_path):
    """Issue 42's enumeration: the supervisor, both agents, the keeper and the multi-process worker, each created
    with a job's credential; every method a handle offers refuses a call without it (or with another job's)."""
    from elastic.placements.standby import StandbyProcess
    from elastic.placements.worker import SliceWorker, WorkerSpec
    from elastic.snapshot.keeper_actor import Keeper
    from elastic.supervision.agent import SliceAgent, SliceGroupAgent
    from elastic.supervision.supervisor import Supervisor

    token, other = new_token(), new_token()
    cfg = config(f"iso-enum-{uuid.uuid4().hex[:6]}", num_slices=2)
    job, namespace = cfg.job_name, cfg.namespace
    # the credentials themselves are refused too: a call carries a token signed for it, never the credential
    control = call_key(derive(token, "control"))
    wrong = [None, derive(other, "control"), token, derive(token, "control")]
    run = events.new_run(job, key=derive(token, "stream"))
    spec = WorkerSpec(config=cfg, init_fn=_zeros)
    actors = {
        "supervisor": (
            Supervisor.options(name="supervisor", namespace=namespace).remote(job, cfg.policy, 1.5, 0.05, run, token),
            Supervisor.__ray_metadata__.modified_class,
        ),
        "agent": (
            SliceAgent.options(name="agent-0-0", namespace=namespace).remote(0, 0, None, 0.1, job, control=control),
            SliceAgent.__ray_metadata__.modified_class,
        ),
        "group agent": (
            SliceGroupAgent.options(name="agents", namespace=namespace).remote({0: 0}, None, 0.1, job, control),
            SliceGroupAgent.__ray_metadata__.modified_class,
        ),
        "keeper": (
            Keeper.options(name="keeper-0", namespace=namespace).remote(1, call_key(derive(token, "keeper"))),
            Keeper.__ray_metadata__.modified_class,
        ),
        "worker": (
            ray.remote(SliceWorker)
            .options(name="agent-1-0", namespace=namespace, max_concurrency=16)
            .remote(1, 0, None, spec, None, control),
            SliceWorker,
        ),
        "standby helper": (  # unnamed: its handle is what an actor listing's ID would give another job
            ray.remote(StandbyProcess).remote(str(tmp_path), {}, control),
            StandbyProcess,
        ),
    }
    try:
        for what, (created, cls) in actors.items():
            ray.get(created.__ray_ready__.remote(), timeout=120)
            name = {"supervisor": "supervisor", "agent": "agent-0-0", "group agent": "agents"}.get(what)
            name = name or {"keeper": "keeper-0", "worker": "agent-1-0"}.get(what)
            raw = ray.get_actor(name, namespace=namespace) if name else created  # what another job gets
            tokens = {
                "supervisor": [None, other, derive(token, "control"), token],
                "keeper": [None, derive(other, "keeper"), token, derive(token, "keeper")],
            }.get(what, wrong)
            assert _refuses_every_method(raw, cls, tokens) == [], what
            for token_ in (None, *tokens):  # Ray's own way to run the caller's code in the actor: refused to all
                assert refused(raw.__ray_call__.remote(lambda self: vars(self), token=token_)), what
    finally:
        for created, _ in actors.values():
            ray.kill(created, no_restart=True)
        events.delete(job)
