"""The job's actors: one supervisor, one agent per slice (``connect``, the Ray connection: :mod:`.connect`).

``ActorGroup`` launches the supervisor and agents, waits (bounded) until each agent has registered, and tears
them down (a crashed client's job is taken over: :mod:`.takeover`; agents are started by an
:class:`~elastic.control.agents.AgentFactory`). With
``Policy.respawn_every_s`` set, it also starts a replacement agent for each slice the supervisor lists as
``respawnable`` (its agent died), at most once per ``respawn_every_s`` per slice: the client owns agent
creation (and the incarnation counter that names agents ``agent-{slice}-{incarnation}``), so it respawns too.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from elastic.config import ElasticConfig
from elastic.control.agents import AgentFactory, SliceAgents
from elastic.control.connect import connect, workers_start_niced
from elastic.control.takeover import job_credential, take_over
from elastic.control.teardown import close_supervisor, kill_actor, sweep_agents
from elastic.control.tokens import job_token, remove_token, write_token
from elastic.errors import SupervisorError
from elastic.log import get_logger
from elastic.snapshot.calls import call_key
from elastic.supervision import credential, events
from elastic.supervision.credential import Credentialed
from elastic.supervision.identity import JobActors, SquatError, holder
from elastic.supervision.supervisor import SUPERVISOR_NAME, Supervisor

__all__ = ["ActorGroup", "AgentFactory", "SliceAgents", "connect", "workers_start_niced"]  # see .agents, .connect


class ActorGroup:
    """The supervisor and the slice agents of one job (``agents`` starts each: single-process mode's small agent
    actors, or multi-process mode's worker processes, which are their slices' agents)."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        agent_nodes: dict[int, str] | None = None,
        agents: AgentFactory | None = None,
        token: str | None = None,
    ) -> None:
        self._config = config
        self._factory = agents or SliceAgents(config)
        self._agent_nodes = dict(agent_nodes or {})
        self._agents: dict[int, Any] = {}
        self._incarnations: dict[int, int] = {}
        self._lock = threading.RLock()  # agents are spawned on the client's thread and on the respawner's
        self._started_at: dict[int, float] = {}  # when each slice's newest agent was started (monotonic)
        self._starting: dict[int, tuple[int, Any, float]] = {}  # respawns in flight: slice -> (incarnation,
        #                                                          its start() ref, deadline)
        self._failed: dict[int, int] = {}  # slice -> a respawned incarnation that never registered
        self._stop = threading.Event()
        self._respawner: threading.Thread | None = None
        self.respawns: list[tuple[int, int]] = []  # (slice, incarnation) the respawner started, in order
        self._log = get_logger("elastic.control.cluster", job=config.job_name)
        self.supervisor: Any = None  # a Credentialed handle: every call carries the job's token
        self._for_agents: Any = None  # the same actor, for the agents: their credential registers and beats only
        self.run: str | None = None  # the event stream's run (elastic.supervision.events): new, or the crashed client's
        self.token = token or job_token(config)  # the job's credential (a successor takes its predecessor's)

    @property
    def actors(self) -> JobActors:
        """The job's actors as its credential finds them (never by a name alone)."""
        return JobActors(self._config.job_name, self._config.namespace, self.token)

    def _signed(self, agent: Any) -> Credentialed:
        """``agent`` (or worker) with its calls signed under the job's control credential."""
        return Credentialed(agent, self.control)

    @property
    def control(self) -> str:
        """The credential the job's agents answer (silence, stop, liveness): derived from the job's token."""
        return credential.derive(self.token, "control")

    def launch(self, *, owned: Callable[[], None] | None = None, slices: Iterable[int] | None = None) -> None:
        """Start the supervisor and every agent (``slices``: only those slices'; a pool lent the job no others);
        return once all registered and judging began. ``owned`` is called once the job's supervisor is this
        client's (created or taken over), while the agents start."""
        cfg = self._config
        if holder(SUPERVISOR_NAME, cfg.namespace) is not None:  # read from Ray's actor table: nothing is called
            self._take_over()
        self.run = self.run or events.new_run(cfg.job_name, key=self.stream_key)
        # On the client's node: a host lost elsewhere must not take the supervisor with it (a soft affinity was seen
        # ignored for detached actors, Ray 2.60); if the client's node dies, the job's client is gone anyway.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        try:  # a name taken since the check above raises here, before anything is sent to its holder
            handle = Supervisor.options(  # type: ignore[attr-defined]  # a ray actor class
                name=SUPERVISOR_NAME, namespace=cfg.namespace, lifetime="detached", scheduling_strategy=here
            ).remote(
                cfg.job_name, cfg.policy, cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s / 2, self.run, self.token
            )
        except ValueError as err:
            raise SquatError(
                f"refused: the name {SUPERVISOR_NAME!r} in namespace {cfg.namespace!r} was taken by an actor job "
                f"{cfg.job_name!r} did not create: nothing was sent to it; remove it or use another job_name"
            ) from err
        self.actors.record(SUPERVISOR_NAME, handle)  # how a successor and the operator's commands find it
        self.supervisor = Credentialed(handle, self.token)
        self._for_agents = Credentialed(handle, credential.derive(self.token, "agent"))  # registers and beats only
        write_token(cfg.job_name, self.token)
        for index in range(cfg.num_slices) if slices is None else sorted(slices):
            self.spawn_agent(index, wait=False)
        if owned is not None:
            owned()
        deadline = time.monotonic() + cfg.startup_timeout_s
        pending = [self._signed(self._agents[i]).start.remote() for i in sorted(self._agents)]
        ready, not_ready = ray.wait(pending, num_returns=len(pending), timeout=cfg.startup_timeout_s)
        if not_ready:
            raise SupervisorError(
                f"{len(not_ready)} of {len(pending)} slice agents did not register within startup_timeout_s="
                f"{cfg.startup_timeout_s}; is the Ray cluster big enough and healthy?"
            )
        ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))
        ray.get(self.supervisor.start.remote(), timeout=cfg.startup_timeout_s)
        if self.respawn_every_s is not None:
            self._respawner = threading.Thread(target=self._respawn_loop, name=f"respawner-{cfg.job_name}", daemon=True)
            self._respawner.start()

    @property
    def owns_job(self) -> bool:
        """Whether launch created (or took over) the job's supervisor: a group refused at launch owns nothing."""
        return self.supervisor is not None

    @property
    def stream_key(self) -> str:
        """The key the job's event stream records are signed under."""
        return credential.derive(self.token, "stream")

    def _take_over(self) -> None:
        """Take over the job of a crashed client (:func:`~elastic.control.takeover.take_over`), under the job's
        credential as a successor finds it."""
        self.token = job_credential(self._config)
        self.run = take_over(self._config, self.actors, self.token, self.run, self._log)

    def spawn_agent(self, index: int, *, wait: bool = True) -> None:
        """Start a (new incarnation of the) agent of slice ``index``; a previous agent of that slice, even a
        silent one still alive, is killed first (a repaired slice has one agent)."""
        agent = self._spawn(index)
        if wait:
            ray.get(self._signed(agent).start.remote(), timeout=self._config.startup_timeout_s)

    def _spawn(self, index: int) -> Any:
        cfg = self._config
        with self._lock:
            previous = self._agents.pop(index, None)
            if previous is not None:
                kill_actor(previous)
            incarnation = self._incarnations.get(index, -1) + 1
            self._incarnations[index] = incarnation
            options: dict[str, Any] = {"name": f"agent-{index}-{incarnation}", "namespace": cfg.namespace}
            if self._factory.detached:
                options["lifetime"] = "detached"
            if index in self._agent_nodes:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._agent_nodes[index], soft=False)
            self._started_at[index] = time.monotonic()
            self._starting.pop(index, None)  # a respawn still in flight is superseded (and its agent killed)
            try:
                agent = self._factory(index, incarnation, self._for_agents, options, call_key(self.control))
            except Exception:
                self._failed[index] = incarnation  # e.g. killed while Ray created it: the respawner tries again
                raise
            self.actors.record(options["name"], agent)  # cleanup finds it by this record, never by its name alone
            self._agents[index] = agent
            self._failed.pop(index, None)
            return agent

    # -- respawning (Policy.respawn_every_s) ----------------------------------------------------
    @property
    def respawn_every_s(self) -> float | None:
        """How often a dead agent's slice may get a new one: ``Policy.respawn_every_s``; in multi-process mode with
        ``Processes.replace_lost``, every second at most by default (a new process for a lost one). Never for a job
        on a pool: the pool lends the replacement (:mod:`elastic.api.pool_lease`)."""
        cfg = self._config
        if cfg.pool is not None:
            return None
        if cfg.policy.respawn_every_s is not None:
            return cfg.policy.respawn_every_s
        return 1.0 if cfg.processes is not None and cfg.processes.replace_lost else None

    def revive(self, index: int) -> bool:
        """Bring slice ``index`` back without blocking (a repaired host): start a new agent and its registration,
        unless one is starting already or the slice is in the view. True if one was started."""
        with self._lock:
            if index in self._starting or self._stop.is_set():
                return False
        view = ray.get(self.supervisor.view.remote(), timeout=10)
        if index in view.active:
            return False
        with self._lock:
            agent = self._spawn(index)
            incarnation = self._incarnations[index]
            self._starting[index] = (
                incarnation,
                self._signed(agent).start.remote(),
                time.monotonic() + self._config.startup_timeout_s,
            )
        self._expect(index, incarnation)
        self._log.warning("agent_revived", slice=index, incarnation=incarnation)
        return True

    def incarnation(self, index: int) -> int | None:
        """The incarnation of slice ``index``'s newest agent."""
        with self._lock:
            return self._incarnations.get(index)

    def replace(self, index: int, dead: int) -> bool:
        """Start a new agent for slice ``index`` whose agent incarnation ``dead`` is known dead (multi-process mode:
        its worker process died), unless a newer one is starting or runs, or the job is on a pool (which lends the
        replacement). True if one was started."""
        with self._lock:
            if self._config.pool is not None or self._stop.is_set() or index in self._starting:
                return False
            if self._incarnations.get(index) != dead:
                return False
            agent = self._spawn(index)
            incarnation = self._incarnations[index]
            self._starting[index] = (
                incarnation,
                self._signed(agent).start.remote(),
                time.monotonic() + self._config.startup_timeout_s,
            )
            self.respawns.append((index, incarnation))
        self._expect(index, incarnation)
        self._log.warning("agent_replaced", slice=index, incarnation=incarnation, dead_incarnation=dead)
        return True

    def _expect(self, index: int, incarnation: int) -> None:
        """Tell the supervisor a new agent of slice ``index`` is starting (it does not give up for want of it
        while that agent may still register); fire and forget."""
        try:
            self.supervisor.expect.remote(index, incarnation, self._config.startup_timeout_s)
        except Exception as err:  # noqa: BLE001 - a supervisor restarting: only the wait's length is at stake
            self._log.warning("expect_failed", slice=index, error=repr(err))

    def _respawn_loop(self) -> None:
        every = self.respawn_every_s
        assert every is not None
        while not self._stop.wait(min(every, 1.0)):
            try:
                self._respawn_once(every)
            except Exception as err:  # noqa: BLE001 - e.g. the supervisor restarting: try again next time
                self._log.warning("respawn_check_failed", error=repr(err))

    def _respawn_once(self, every: float) -> None:
        """Settle the respawns in flight, then start a new agent for each slice the supervisor lists as
        respawnable whose newest agent (ours) is the dead one or never registered, whose node is alive, and
        whose last agent started at least ``every`` seconds ago."""
        self._settle_starts()
        dead = ray.get(self.supervisor.respawnable.remote(), timeout=10)
        alive: set[str] | None = None
        for index, incarnation in sorted(dead.items()):
            with self._lock:
                if self._stop.is_set():
                    return
                current = self._incarnations.get(index)
                if current is None or index in self._starting:
                    continue
                if current != incarnation and self._failed.get(index) != current:
                    continue  # a newer agent holds the slice (a revive) or registers still
                if time.monotonic() - self._started_at.get(index, -math.inf) < every:
                    continue
                node = self._agent_nodes.get(index)
                if node is not None:
                    alive = _alive_nodes() if alive is None else alive
                    if node not in alive:  # dead hardware: a new agent could not start there
                        continue
                agent = self._spawn(index)
                new = self._incarnations[index]
                self._starting[index] = (
                    new,
                    self._signed(agent).start.remote(),
                    time.monotonic() + self._config.startup_timeout_s,
                )
                self.respawns.append((index, new))
                self._expect(index, new)
                self._log.warning("agent_respawned", slice=index, incarnation=new, dead_incarnation=incarnation)

    def _settle_starts(self) -> None:
        """Forget the respawned agents that registered; mark those that died first, or did not register within
        ``startup_timeout_s`` (killed then), as failed: their slice may be respawned again."""
        with self._lock:
            starting = dict(self._starting)
        for index, (incarnation, ref, deadline) in starting.items():
            ready, _ = ray.wait([ref], timeout=0)
            error = None
            if ready:
                try:
                    ray.get(ref, timeout=10)
                except Exception as err:  # noqa: BLE001 - it died before registering
                    error = repr(err)
            elif time.monotonic() > deadline:
                error = f"did not register within startup_timeout_s={self._config.startup_timeout_s}"
            else:
                continue
            with self._lock:
                if self._starting.get(index, (None,))[0] != incarnation:
                    continue  # superseded meanwhile
                del self._starting[index]
                if error is not None:
                    self._failed[index] = incarnation
                    kill_actor(self._agents[index])
                    self._log.warning("agent_respawn_failed", slice=index, incarnation=incarnation, error=error)

    def agent(self, index: int) -> Any:
        """Slice ``index``'s agent, its calls carrying the job's control credential (``.handle``: the actor's)."""
        return self._signed(self._agents[index])

    def kill_supervisor(self, *, no_restart: bool = True) -> None:
        """Kill the supervisor's process (``no_restart=False``: Ray starts it again, and it replays its log)."""
        ray.kill(self.supervisor.handle, no_restart=no_restart)

    def kill_agent(self, index: int) -> None:
        """Kill slice ``index``'s agent for real (as its host dying would)."""
        ray.kill(self._agents[index], no_restart=True)

    @retry(
        retry=retry_if_exception_type(ray.exceptions.GetTimeoutError),
        stop=stop_after_delay(30),
        wait=wait_exponential(multiplier=0.1, max=2),
        reraise=True,
    )
    def events(self) -> list[dict[str, Any]]:
        return ray.get(self.supervisor.events.remote(), timeout=10)

    def shutdown(self) -> None:
        """Kill every actor of the job (they are detached, so nothing else would); the event stream stays.

        The supervisor is closed first: the agents' deaths that follow are neither judged nor written to the
        stream. The respawner stops first; every ``agent-*`` actor of the namespace is killed last, whoever
        started it. A group whose launch was refused (the job is another live client's) touches nothing.
        """
        self._stop.set()
        if self._respawner is not None:
            self._respawner.join(timeout=30)
        if not self.owns_job:
            return
        with self._lock:  # a respawner still running past the join spawns nothing once it holds the lock
            if self.supervisor is not None:
                close_supervisor(self.supervisor.handle, self._config.job_name, self.token)
            quiet = [
                self._signed(agent).silence.remote() for agent in self._agents.values()
            ]  # no beat into a dead supervisor
            ray.wait(quiet, num_returns=len(quiet), timeout=5)
            for agent in self._agents.values():
                kill_actor(agent)
            if self.supervisor is not None:
                kill_actor(self.supervisor.handle)
            self._agents.clear()
            self._starting.clear()
            sweep_agents(self.actors)
        remove_token(self._config.job_name, self.token)


def _alive_nodes() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
