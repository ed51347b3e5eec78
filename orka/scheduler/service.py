"""The scheduler service: one supervising object over the parts that each own one job.

- the gateway (`gateway.py`): every agent's stream, its registration and reports;
- liveness (`liveness.py`): the clock that turns silent nodes NOT_READY, then LOST;
- the placer (`placer.py`): Place, by offers to ranked nodes, and reservations;
- the relay (`relay.py`): the controller's commands to agents and its cordon and drain;
- the feed (`feed.py`): what changed, to every connected controller.

`Scheduler` builds them over one registry, serves their RPCs (the role of each caller is
checked in one table, below) and runs the parts that loop; the first part that fails stops
the whole scheduler (orka.supervision), and `run()` raises why.

Standby (`store_url` set): several schedulers share one store and elect the active one on it
(orka.store.election, election "scheduler", identity = the address agents dial, `advertise`),
as controllers do (orka.leadership). Every scheduler listens; only the active one
serves. A standby answers every RPC (the agent stream, the controller feed, Place, Command,
SetNode, Session) with NotLeader naming the active one, and its health reports NOT_SERVING
for orka.v1.Scheduler. Each term starts from nothing (`_build`): the registry is rebuilt from
the agents' registrations as after a restart, and liveness only ever judges nodes that
registered in this term, so a node it has not heard from yet is never declared NOT_READY or
LOST by a new term. A term ends when the lease is lost: the streams of agents and
controllers are closed at once with NotLeader, and the parts of the term are stopped, so a
scheduler that lost its lease never goes on serving beside the new active one. A standby
that agents tell the active one is unreachable, and finds its address refusing connections,
ends that term without waiting for the lease (`takeover.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.errors import Invalid, NotLeader, OrkaError
from orka.leadership import Leadership, default_advertise
from orka.rpc.server import boundaries, set_serving, start_server, stream, unary
from orka.scheduler.feed import Feed
from orka.scheduler.gateway import Gateway
from orka.scheduler.liveness import Liveness
from orka.scheduler.pace import HeartbeatPace
from orka.scheduler.pipeline import Pipeline, PipelineConfig
from orka.scheduler.placer import Placer
from orka.scheduler.registry import Registry
from orka.scheduler.relay import Relay
from orka.scheduler.takeover import Takeover
from orka.scheduler.terms import LeaderTerms
from orka.security.identity import Identity
from orka.security.tls import TlsFiles
from orka.store.base import Store
from orka.store.election import Election, election_for
from orka.store.factory import open_configured
from orka.supervision import Parts

log = structlog.get_logger("orka.scheduler")

SERVICE_NAME = "orka.v1.Scheduler"
ELECTION = "scheduler"
# A standby holds a refused agent (`_parked`) for the election TTL plus this: by then a dead
# active scheduler's lease has run out and this one has either taken over or seen who did.
PARK_SLACK = 1.0


@dataclass
class SchedulerConfig:
    listen: str = "127.0.0.1:7444"
    heartbeat_interval: float = 1.0
    node_lost_after: float = 5.0
    # The most heartbeats per second over all nodes (Nomad's max_heartbeats_per_second): a
    # larger cluster heartbeats less often, and its nodes' silence is judged by the interval
    # they were told (orka/scheduler/pace.py). 0: every node at heartbeat_interval.
    max_heartbeats_per_second: float = 1000.0
    offer_timeout: float = 2.0
    # How long an accepted offer holds resources while the controller persists the binding.
    hold_seconds: float = 30.0
    register_timeout: float = 10.0
    command_timeout: float = 10.0
    # Forward a node's usage to the controller at most this often (state changes go at once).
    usage_report_interval: float = 5.0
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # With a store: join the election for the active scheduler (standby mode). Empty: this
    # scheduler is the only one and always active, as before.
    store_url: str = ""
    data_dir: Path = field(default_factory=lambda: Path.home() / ".orka")
    # The address agents and controllers dial for this scheduler (what a standby names in
    # NOT_LEADER); empty: derived from `listen` (wildcard host -> 127.0.0.1).
    advertise: str = ""
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    # The active scheduler's lease; a dead one is replaced within about this many seconds
    # (plus the agents' registrations). 2 s (etcd's shortest) fails over 1,000 agents in
    # 2.6 s, but with 5,000 registering on 2 shared cores even the lease's own refresher
    # thread missed 2 s deadlines and the active scheduler kept losing it: 5 s by default.
    election_ttl: int = 5

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise Invalid("heartbeat_interval must be > 0")
        if self.node_lost_after <= 2 * self.heartbeat_interval:
            raise Invalid("node_lost_after must be more than 2 heartbeat intervals")
        if self.max_heartbeats_per_second < 0:
            raise Invalid("max_heartbeats_per_second must not be negative")
        if self.offer_timeout <= 0:
            raise Invalid("offer_timeout must be > 0")


@boundaries(
    Connect=stream(roles={"agent"}),
    Place=unary(roles={"controller"}),
    Command=unary(roles={"controller"}),
    SetNode=unary(roles={"controller"}),
    Watch=stream(roles={"controller"}),
    Session=stream(roles={"controller"}),
)
class Scheduler(apb_grpc.SchedulerServicer):
    def __init__(
        self,
        config: SchedulerConfig,
        tls: TlsFiles,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        # What liveness measures silence with: a test steps it instead of waiting real seconds.
        self.clock = clock
        self.tls = tls
        self._build()
        self.parts = Parts("scheduler", self._fail)
        # The parts that run only while this scheduler is active, started anew each term.
        self.term_parts = Parts("scheduler", self._fail)
        self.store: Store | None = None
        self.election: Election | None = None
        self.leadership: Leadership | None = None
        # Ends a dead active scheduler's term early (standby mode; `takeover.py`).
        self.takeover: Takeover | None = None
        # The address agents and controllers dial for this scheduler (standby mode).
        self.advertise = ""
        # Agents a standby holds until it takes over (`_parked`).
        self.held = 0
        # Counts the terms begun; a call that began in one term and ends in another (the
        # lease was lost meanwhile) must not hand back what the old term's parts answered.
        self.term = 0
        self._health: health.aio.HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._failed: BaseException | None = None
        self._failing: set[asyncio.Future[None]] = set()  # a reference to the stop task
        self.port = 0
        self.listening = asyncio.Event()  # set once start() has returned

    def _build(self) -> None:
        """Fresh parts over an empty registry: what a restarted scheduler starts from. A new
        term must not inherit the last one's picture, whose nodes have gone silent for it."""
        config, clock = self.config, self.clock
        self.registry = Registry()
        self.pipeline = Pipeline(config.pipeline)
        self.feed = Feed(self.registry, config.usage_report_interval)
        self.hub = self.feed.hub
        self.placer = Placer(
            self.registry, self.pipeline, config.offer_timeout, config.hold_seconds
        )
        self.liveness = Liveness(
            self.registry,
            self.feed,
            config.heartbeat_interval,
            config.node_lost_after,
            clock,
            on_pass=[self.feed.report_usage, self.placer.expire_reservations],
            pace=HeartbeatPace(config.heartbeat_interval, config.max_heartbeats_per_second),
        )
        self.gateway = Gateway(
            self.registry,
            self.feed,
            self.liveness,
            config.register_timeout,
            clock,
        )
        self.liveness.on_pass.append(self.gateway.recheck_leaves)
        self.placer.behind = self.liveness.lag
        self.relay = Relay(self.registry, self.feed, config.command_timeout)
        # The newest controller leadership term seen: an older leader gives no orders.
        self.controller_terms = LeaderTerms()

    # ---- lifecycle ----

    async def start(self) -> int:
        self._server, self.port, self._health = await start_server(
            self.config.listen,
            self.tls,
            [lambda s: apb_grpc.add_SchedulerServicer_to_server(self, s)],
            [SERVICE_NAME],
            on_revoked=self._fail,
        )
        if not self.config.store_url:
            await self._lead()
            log.info("scheduler listening", port=self.port)
            self.listening.set()
            return self.port
        # Standby until elected: the gate answers NOT_LEADER meanwhile.
        await self._set_serving(False)
        config = self.config
        advertise = self.advertise = config.advertise or default_advertise(config.listen, self.port)
        try:
            self.store = open_configured(config)
            if not (self.store.supports_leases and self.store.supports_watch):
                # Without leases every scheduler would win its own election: two active ones.
                raise Invalid(
                    f"--store: {config.store_url!r} cannot elect an active scheduler (no"
                    " leases); use etcd://HOST:PORT[,...], or leave --store out to run one"
                    " scheduler alone"
                )
            await self.store.open()
        except BaseException:
            await self._server.stop(grace=None)
            raise
        self.election = election_for(
            self.store, ELECTION, advertise, ttl=config.election_ttl, info={"address": advertise}
        )
        self.leadership = Leadership(self.election, self._lead, self._step_down)
        self.takeover = Takeover(self.election)
        self.parts.start("leadership", self.leadership.run)
        log.info("scheduler listening", port=self.port, advertise=advertise, standby=True)
        self.listening.set()
        return self.port

    async def _set_serving(self, serving: bool) -> None:
        await set_serving(self._health, SERVICE_NAME, serving)

    async def _lead(self) -> None:
        """A term begins: from an empty registry, which the agents fill as they register."""
        if self.term > 0:
            self._build()
        self.term += 1
        self.feed.pace_from(self.clock())
        self.term_parts = Parts("scheduler", self._fail)
        self.term_parts.start("liveness", self.liveness.run)
        await self._set_serving(True)
        log.info("scheduler active", term=self.term)

    async def _step_down(self) -> None:
        """A term ends (lease lost, or shutdown): stop serving at once; every stream open on
        this term ends with NOT_LEADER, so agents and controllers look for the active one."""
        await self._set_serving(False)
        await self.term_parts.stop()
        self.gateway.stand_by("this scheduler is no longer active; reconnect to the active one")
        self.feed.close()
        log.warning("scheduler standing by", term=self.term)

    async def _require_active(self) -> None:
        """Raise NotLeader unless this scheduler is the active one (always, without a store)."""
        if self.leadership is not None:
            await self.leadership.require()
        elif not self.config.store_url:
            return
        else:
            raise NotLeader("the scheduler is starting; no active scheduler known yet")

    def _parks(self, refusal: NotLeader, first: apb.AgentMessage) -> bool:
        """Whether a standby holds this agent's stream instead of refusing it at once: when
        the active one it would name is one the agent could not reach (or none is known).
        During a failover that is every agent, each asking again and again until the dead
        one's lease runs out; held, they are answered the moment this one takes over."""
        if self.leadership is None or first.WhichOneof("body") != "register":
            return False
        return refusal.leader is None or refusal.leader in first.register.unreachable

    async def _parked(self) -> NotLeader | None:
        """Hold a refused agent until this scheduler leads (None) or until the active one's
        lease would have run out (then the refusal of that moment)."""
        assert self.leadership is not None
        self.held += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.election_ttl + PARK_SLACK):
                    await self.leadership.leading.wait()
        finally:
            self.held -= 1
        try:
            await self._require_active()
        except NotLeader as refusal:
            return refusal
        return None

    async def _require_term(self, term: int) -> None:
        """After a call that began in `term`: NotLeader if that term has ended meanwhile."""
        if self.term != term or (self.leadership is not None and not self.leadership.is_leader):
            await self._require_active()
            raise NotLeader("this scheduler stood by while the call ran; retry with the active one")

    async def run(self) -> None:
        await self.start()
        await self._stopped.wait()
        if self._failing:
            await asyncio.gather(*self._failing, return_exceptions=True)
        if self._failed is not None:
            raise self._failed

    def _fail(self, exc: BaseException) -> None:
        """End the service with `exc` (a part failed, or its own certificate was revoked):
        run() raises it."""
        if self._failed is None:
            self._failed = exc
        self._failing.add(asyncio.ensure_future(self.stop()))

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        # With an election, stopping the leadership part steps the term down (shielded).
        await self.parts.stop()
        await self.term_parts.stop()
        if self.takeover is not None:
            await self.takeover.close()
        self.gateway.close()
        self.feed.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.leadership is not None:
            # Resign, so a standby takes over now rather than when our lease expires.
            await self.leadership.close()
        if self.store is not None:
            with contextlib.suppress(OrkaError):
                await self.store.close()

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- the RPCs, each served by its part ----

    async def Connect(
        self, request_iterator: AsyncIterator[apb.AgentMessage], who: Identity
    ) -> AsyncIterator[apb.SchedulerMessage]:
        first: apb.AgentMessage | None = None
        try:
            await self._require_active()
        except NotLeader as refusal:
            # Refused only once the agent's registration has arrived: an agent that writes it
            # after the stream has ended (a busy agent, a standby answering at once) sees the
            # write fail ("RPC already finished", INTERNAL) instead of this NOT_LEADER, and
            # would not know where to go.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.register_timeout):
                    first = await anext(aiter(request_iterator))
            if first is None or not self._parks(refusal, first):
                raise
            if self.takeover is not None:
                self.takeover.suspect(first.register.unreachable)
        if first is not None:
            # Held, and this scheduler leads now: what the agent registered with may be stale
            # by then, so it registers again, on this stream when it can.
            still = await self._parked()
            if still is not None:
                raise still
            if not first.register.registers_again:
                raise NotLeader(
                    "this scheduler has just become the active one; register again",
                    leader=self.advertise,
                )
            yield apb.SchedulerMessage(register_again=apb.RegisterAgain())
        async for msg in self.gateway.connect(request_iterator, who.name):
            yield msg

    async def Place(self, request: apb.PlaceRequest, who: Identity) -> apb.PlaceResponse:
        await self._require_active()
        self.controller_terms.admit(request.leader_term)
        term = self.term
        reply = await self.placer.place(request)
        await self._require_term(term)
        return reply

    async def Command(self, request: apb.CommandRequest, who: Identity) -> apb.CommandResponse:
        await self._require_active()
        self.controller_terms.admit(request.leader_term)
        term = self.term
        reply = await self.relay.command(request)
        await self._require_term(term)
        return reply

    async def SetNode(self, request: apb.SetNodeRequest, who: Identity) -> pb.Node:
        await self._require_active()
        self.controller_terms.admit(request.leader_term)
        return self.relay.set_node(request)

    async def Watch(
        self, request: apb.WatchClusterRequest, who: Identity
    ) -> AsyncIterator[apb.ClusterUpdates]:
        await self._require_active()
        self.controller_terms.admit(request.leader_term)
        term = self.term
        async for batch in self.feed.watch():
            yield batch
        if not self._stopped.is_set():
            # The feed closed because the term ended: say so, so the controller moves on.
            await self._require_term(term)

    async def Session(
        self, request_iterator: AsyncIterator[apb.SessionRequest], who: Identity
    ) -> AsyncIterator[apb.SessionResponse]:
        await self._require_active()
        async for msg in self.gateway.sessions.session(
            request_iterator, self.controller_terms.admit
        ):
            yield msg
