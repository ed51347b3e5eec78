"""The scheduler service: one supervising object over the parts that each own one job.

- the gateway (`gateway.py`): every agent's stream, its registration and reports;
- liveness (`liveness.py`): the clock that turns silent nodes NOT_READY, then LOST;
- the placer (`placer.py`): Place, by offers to ranked nodes, and reservations;
- the relay (`relay.py`): the controller's commands to agents and its cordon and drain;
- the feed (`feed.py`): what changed, to every connected controller.

`Scheduler` builds them over one registry, serves their RPCs (the role of each caller is
checked in one table, below) and runs the parts that loop; the first part that fails stops
the whole scheduler (orka.supervision), and `run()` raises why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import structlog

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.rpc.server import boundaries, start_server, stream, unary
from orka.scheduler.feed import Feed
from orka.scheduler.gateway import Gateway
from orka.scheduler.liveness import Liveness
from orka.scheduler.pipeline import Pipeline, PipelineConfig
from orka.scheduler.placer import Placer
from orka.scheduler.registry import Registry
from orka.scheduler.relay import Relay
from orka.scheduler.terms import LeaderTerms
from orka.security.identity import Identity
from orka.security.tls import TlsFiles
from orka.supervision import Parts

log = structlog.get_logger("orka.scheduler")

SERVICE_NAME = "orka.v1.Scheduler"


@dataclass
class SchedulerConfig:
    listen: str = "127.0.0.1:7444"
    heartbeat_interval: float = 1.0
    node_lost_after: float = 5.0
    offer_timeout: float = 2.0
    # How long an accepted offer holds resources while the controller persists the binding.
    hold_seconds: float = 30.0
    register_timeout: float = 10.0
    command_timeout: float = 10.0
    # Forward a node's usage to the controller at most this often (state changes go at once).
    usage_report_interval: float = 5.0
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise Invalid("heartbeat_interval must be > 0")
        if self.node_lost_after <= 2 * self.heartbeat_interval:
            raise Invalid("node_lost_after must be more than 2 heartbeat intervals")
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
        )
        self.gateway = Gateway(
            self.registry,
            self.feed,
            self.liveness,
            config.heartbeat_interval,
            config.register_timeout,
            clock,
        )
        self.liveness.on_pass.append(self.gateway.recheck_leaves)
        self.relay = Relay(self.registry, self.feed, config.command_timeout)
        self.terms = LeaderTerms()  # the controller term allowed to give orders
        self.parts = Parts("scheduler", self._fail)
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._failed: BaseException | None = None
        self._failing: set[asyncio.Future[None]] = set()  # a reference to the stop task
        self.port = 0
        self.listening = asyncio.Event()  # set once start() has returned

    # ---- lifecycle ----

    async def start(self) -> int:
        self._server, self.port, _ = await start_server(
            self.config.listen,
            self.tls,
            [lambda s: apb_grpc.add_SchedulerServicer_to_server(self, s)],
            [SERVICE_NAME],
            on_revoked=self._fail,
        )
        self.feed.pace_from(self.clock())
        self.parts.start("liveness", self.liveness.run)
        log.info("scheduler listening", port=self.port)
        self.listening.set()
        return self.port

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
        await self.parts.stop()
        self.gateway.close()
        self.feed.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- the RPCs, each served by its part ----

    def Connect(
        self, request_iterator: AsyncIterator[apb.AgentMessage], who: Identity
    ) -> AsyncIterator[apb.SchedulerMessage]:
        return self.gateway.connect(request_iterator, who.name)

    async def Place(self, request: apb.PlaceRequest, who: Identity) -> apb.PlaceResponse:
        self.terms.admit(request.leader_term)
        return await self.placer.place(request)

    async def Command(self, request: apb.CommandRequest, who: Identity) -> apb.CommandResponse:
        self.terms.admit(request.leader_term)
        return await self.relay.command(request)

    async def SetNode(self, request: apb.SetNodeRequest, who: Identity) -> pb.Node:
        self.terms.admit(request.leader_term)
        return self.relay.set_node(request)

    def Watch(
        self, request: apb.WatchClusterRequest, who: Identity
    ) -> AsyncIterator[apb.ClusterUpdates]:
        self.terms.admit(request.leader_term)
        return self.feed.watch()

    def Session(
        self, request_iterator: AsyncIterator[apb.SessionRequest], who: Identity
    ) -> AsyncIterator[apb.SessionResponse]:
        return self.gateway.sessions.session(request_iterator)
