"""The scheduler service: agent gateway, placement by offers, liveness, and the controller feed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from orka import fit
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.errors import Invalid, NotFound, PermissionDenied
from orka.etags import node_etag
from orka.models import (
    TERMINAL_PHASES,
    InstancePhase,
    InstanceReport,
    NodeState,
    Resources,
    WorkloadKind,
)
from orka.rpc import convert
from orka.rpc.frames import drain
from orka.rpc.place_reasons import place_result_to_pb
from orka.rpc.server import boundaries, start_server, stream, unary
from orka.scheduler.pipeline import Pipeline, PipelineConfig
from orka.scheduler.registry import NodeRecord, Registry
from orka.scheduler.session import AgentSession, Expected, Reply, next_id, replies
from orka.scheduler.snapshot import PlacementRequest
from orka.security.identity import Identity
from orka.security.tls import TlsFiles
from orka.validation import (
    MAX_DRIVER_NAME,
    MAX_DRIVERS,
    MAX_NODE_LABELS,
    NODE_LABEL,
    RESERVED_LABEL_PREFIX,
    check_label_key,
    check_label_value,
    check_text,
    quote,
    reserved_labels,
)

log = structlog.get_logger("orka.scheduler")

SERVICE_NAME = "orka.v1.Scheduler"
# Candidates ranked per placement before falling back to ranking every feasible node.
RANK_FIRST = 8
# A Place batch's first round ranks this many instances, then lets the event loop run
# (agents' heartbeats and replies are read meanwhile): ranked in one go, a batch stalls the
# loop for its whole length (0.5 s was seen for 4,096 instances on 1,000 nodes).
PLACE_CHUNK = 256
# Offers made but not sent yet, with the session each goes to (see Place).
_Held = list[tuple[AgentSession, apb.SchedulerMessage]]


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


class WatchHub:
    """Fans cluster updates out to every connected controller, batched per wake-up."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[apb.ClusterUpdate | None]] = set()

    def publish(self, update: apb.ClusterUpdate) -> None:
        for q in self.queues:
            q.put_nowait(update)

    def close(self) -> None:
        for q in self.queues:
            q.put_nowait(None)


_KINDS = {pb.WorkloadSpec.Kind.Value(k.value): k for k in WorkloadKind}


def request_of(a: apb.Assignment) -> PlacementRequest:
    spec = a.spec
    kind = _KINDS.get(spec.kind)
    if kind is None:
        raise Invalid(f"assignment {a.instance}: spec.kind is required")
    return PlacementRequest(
        instance=a.instance,
        workload=spec.name,
        kind=kind,
        cpu_millis=spec.resources.cpu_millis,
        memory_bytes=spec.resources.memory_bytes,
        node_selector=dict(spec.node_selector),
        max_per_node=spec.max_per_node,
    )


_NODE_STATES = {state: pb.Node.State.Value(state.value) for state in NodeState}


class NodeMessages:
    """`pb.Node` of a node record, the same as `convert.node_to_pb(node.to_model())`.

    Every node is published every `usage_report_interval`, so this skips the model and keeps
    what only registering changes (name, labels, drivers, capacity, allocatable) as one message
    per node, copied into each new one.
    """

    def __init__(self) -> None:
        # Node name -> (labels, drivers, capacity, allocatable, the message of those).
        self._static: dict[
            str, tuple[dict[str, str], frozenset[str], Resources, Resources, pb.Node]
        ] = {}

    def build(self, node: NodeRecord) -> pb.Node:
        msg = pb.Node()
        self.fill(msg, node)
        return msg

    def fill(self, msg: pb.Node, node: NodeRecord) -> None:
        """Write the node into `msg`, an empty message (such as a new update's `node`)."""
        cached = self._static.get(node.name)
        if (
            cached is None
            or cached[1] is not node.drivers
            or cached[2] is not node.capacity
            or cached[3] is not node.allocatable
            or cached[0] != node.labels
        ):
            static = pb.Node(
                name=node.name,
                capacity=convert.resources_to_pb(node.capacity),
                allocatable=convert.resources_to_pb(node.allocatable),
                labels=node.labels,
                drivers=sorted(node.drivers),
            )
            cached = (dict(node.labels), node.drivers, node.capacity, node.allocatable, static)
            self._static[node.name] = cached
        msg.CopyFrom(cached[4])
        msg.state = _NODE_STATES[node.state]
        msg.schedulable = node.schedulable
        msg.draining = node.draining
        # Set even when zero: the sub-messages are present, as in convert.node_to_pb.
        allocated = msg.allocated
        allocated.cpu_millis = node.cpu_used
        allocated.memory_bytes = node.mem_used
        usage = msg.usage
        usage.cpu_millis = node.usage.cpu_millis
        usage.memory_bytes = node.usage.memory_bytes
        msg.instance_count = len(node.holds)
        if node.last_heartbeat_wall:
            convert.set_timestamp(msg.last_heartbeat_time, node.last_heartbeat_wall)
        msg.message = node.message
        msg.etag = node_etag(node)


@boundaries(
    Connect=stream(roles={"agent"}),
    Place=unary(roles={"controller"}),
    Command=unary(roles={"controller"}),
    SetNode=unary(roles={"controller"}),
    Watch=stream(roles={"controller"}),
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
        self.hub = WatchHub()
        self._node_pb = NodeMessages()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._failed: BaseException | None = None
        self._failing: set[asyncio.Future[None]] = set()  # a reference to the stop task
        self.port = 0

    # ---- lifecycle ----

    async def start(self) -> int:
        self._server, self.port, _ = await start_server(
            self.config.listen,
            self.tls,
            [lambda s: apb_grpc.add_SchedulerServicer_to_server(self, s)],
            [SERVICE_NAME],
            on_revoked=self._fail,
        )
        self._tasks.append(asyncio.create_task(self._liveness(), name="liveness"))
        log.info("scheduler listening", port=self.port)
        return self.port

    async def run(self) -> None:
        await self.start()
        await self._stopped.wait()
        if self._failing:
            await asyncio.gather(*self._failing, return_exceptions=True)
        if self._failed is not None:
            raise self._failed

    def _fail(self, exc: BaseException) -> None:
        """End the service with `exc` (its own certificate revoked): run() raises it."""
        if self._failed is None:
            self._failed = exc
        self._failing.add(asyncio.ensure_future(self.stop()))

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        for t in self._tasks:
            t.cancel()
        for node in self.registry:
            if node.session is not None:
                node.session.close()
        self.hub.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- publishing to controllers ----

    def _publish_node(self, node: NodeRecord) -> None:
        update = apb.ClusterUpdate()
        self._node_pb.fill(update.node, node)
        self.hub.publish(update)

    def _publish_sync(self, node: NodeRecord) -> None:
        self.hub.publish(_sync_update(node))

    def _set_state(self, node: NodeRecord, state: NodeState, message: str = "") -> None:
        if node.state is state:
            return
        log.info("node state", node=node.name, old=node.state.value, new=state.value)
        was_lost = node.state in (NodeState.LOST, NodeState.LEFT)
        node.state = state
        node.message = message
        self.registry.changed(node)
        self._publish_node(node)
        if was_lost and state is NodeState.READY:
            # The controller may have replaced what this node runs while it was away.
            self._publish_sync(node)

    # ---- agent stream ----

    async def Connect(
        self,
        request_iterator: AsyncIterator[apb.AgentMessage],
        who: Identity,
    ) -> AsyncIterator[apb.SchedulerMessage]:
        session = AgentSession(who.name)
        reader = asyncio.create_task(self._read_agent(request_iterator, session))
        try:
            while True:
                msg = await session.outbox.get()
                if msg is None:
                    break
                items, closed = drain(msg, session.outbox)
                if len(items) == 1:
                    yield msg
                else:
                    yield apb.SchedulerMessage(batch=apb.SchedulerBatch(messages=items))
                if closed:
                    break
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self._disconnected(session)
        if session.error:
            # Raised from the handler itself (not the reader task) so the agent gets the code.
            raise session.error_type(session.error)

    async def _read_agent(
        self, messages: AsyncIterator[apb.AgentMessage], session: AgentSession
    ) -> None:
        node: NodeRecord | None = None
        try:
            iterator = aiter(messages)
            async with asyncio.timeout(self.config.register_timeout):
                first = await anext(iterator)
            if first.WhichOneof("body") != "register":
                raise Invalid("the first message on the agent stream must be register")
            node = self._register(session, first.register)
            async for msg in iterator:
                self._on_agent_message(node, session, msg)
        except (TimeoutError, StopAsyncIteration):
            pass
        except (Invalid, PermissionDenied) as err:
            log.warning("agent sent bad input", node=session.node, error=err.message)
            session.error = err.message
            session.error_type = type(err)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            # Nothing aborts a live agent stream from outside its handler but the CRL watcher
            # cutting a peer a new CRL revoked (security/revocation.py): expected, so one line.
            log.warning("agent certificate revoked; stream ended", node=session.node)
        except Exception:
            log.exception("agent stream failed", node=session.node)
        finally:
            session.close()

    def _register(self, session: AgentSession, reg: apb.Register) -> NodeRecord:
        info = reg.node
        capacity = convert.resources_from_pb(info.capacity)
        allocatable = convert.resources_from_pb(info.allocatable)
        if capacity.cpu_millis < 0 or capacity.memory_bytes < 0:
            raise Invalid("register: node.capacity must not be negative")
        if allocatable.cpu_millis < 0 or allocatable.memory_bytes < 0:
            raise Invalid("register: node.allocatable must not be negative")
        labels = node_labels(info.labels, session.node)
        if len(info.drivers) > MAX_DRIVERS:
            raise Invalid(f"register: node.drivers: at most {MAX_DRIVERS}, got {len(info.drivers)}")
        for i, driver in enumerate(info.drivers):
            try:
                check_text(driver, MAX_DRIVER_NAME)
            except ValueError as err:
                raise Invalid(f"register: node.drivers[{i}]: {err}") from None
        reports = [
            (convert.report_from_pb(s, session.node), convert.resources_from_pb(s.resources))
            for s in reg.instances
        ]
        node = self.registry.upsert(session.node)
        if node.session is not None and node.session is not session:
            node.session.close()
        node.session = session
        node.capacity = capacity
        node.allocatable = allocatable
        node.labels = labels
        node.drivers = frozenset(info.drivers)
        node.last_seen = self.clock()
        node.last_heartbeat_wall = time.time()
        if node.state is NodeState.LEFT:
            node.draining = False
        # What the node re-announces replaces what we believed it held, except reservations
        # for offers still in flight.
        node.reports.clear()
        for name, hold in list(node.holds.items()):
            if hold.expires_at is None:
                node.drop_hold(name)
        for report, res in reports:
            self.registry.apply_report(node, report, res)
        old_state = node.state
        node.state = NodeState.READY
        node.message = ""
        self.registry.changed()
        log.info("agent registered", node=node.name, instances=len(reports), was=old_state.value)
        session.send(
            apb.SchedulerMessage(
                registered=apb.Registered(
                    node=node.name, heartbeat_interval=self.config.heartbeat_interval
                )
            )
        )
        self._publish_node(node)
        self._publish_sync(node)
        return node

    def _on_agent_message(
        self, node: NodeRecord, session: AgentSession, msg: apb.AgentMessage
    ) -> None:
        if node.session is not session:
            return  # a newer stream of the same node took over
        kind = msg.WhichOneof("body")
        node.last_seen = self.clock()
        if kind == "heartbeat":
            hb = msg.heartbeat
            node.last_heartbeat_wall = time.time()
            usage = hb.usage
            if (
                usage.cpu_millis != node.usage.cpu_millis
                or usage.memory_bytes != node.usage.memory_bytes
            ):
                node.usage = convert.resources_from_pb(usage)
            for status in hb.instances:
                self._on_status(node, status)
            if node.state is not NodeState.READY:
                self._set_state(node, NodeState.READY)
        elif kind == "event":
            self._on_status(node, msg.event)
        elif kind == "offer_reply":
            r = msg.offer_reply
            session.resolve(r.offer_id, r.accepted, r.reason)
        elif kind == "ack":
            a = msg.ack
            session.resolve(a.command_id, a.ok, a.error)
        elif kind == "leave":
            log.info("agent leaving", node=node.name, reason=msg.leave.reason)
            session.left = True
            node.draining = True
            self.registry.changed()
            self._publish_node(node)
        elif kind == "batch":
            for inner in msg.batch.messages:
                if inner.WhichOneof("body") == "batch":
                    raise Invalid("a batch must not hold another batch")
                self._on_agent_message(node, session, inner)
        elif kind == "register":
            raise Invalid("register may only be sent once per stream")
        else:
            raise Invalid("empty agent message")

    def _on_status(self, node: NodeRecord, status: apb.InstanceStatus) -> None:
        old = node.reports.get(status.name)
        if old is not None and _unchanged(node, old, status):
            return  # the same as last time and already accounted for: nothing to do
        report = convert.report_from_pb(status, node.name)
        if self.registry.apply_report(node, report, convert.resources_from_pb(status.resources)):
            self.hub.publish(
                apb.ClusterUpdate(instance=apb.InstanceUpdate(node=node.name, status=status))
            )

    def _disconnected(self, session: AgentSession) -> None:
        node = self.registry.get(session.node)
        if node is None or node.session is not session:
            return
        node.session = None
        if session.left:
            node.draining = False
            for name in list(node.holds):
                node.drop_hold(name)
            node.reports.clear()
            self._set_state(node, NodeState.LEFT, "agent left")
        log.info("agent disconnected", node=node.name, left=session.left)

    # ---- liveness ----

    async def _liveness(self) -> None:
        interval = self.config.heartbeat_interval
        tick = min(interval / 4, 0.25)
        last_usage_report = self.clock()
        while True:
            await asyncio.sleep(tick)
            now = self.clock()
            for node in list(self.registry):
                if node.state in (NodeState.LOST, NodeState.LEFT):
                    continue
                silent = now - node.last_seen
                if silent > self.config.node_lost_after:
                    if node.session is not None:
                        node.session.close()
                    node.reports.clear()
                    for name in list(node.holds):
                        node.drop_hold(name)
                    self._set_state(node, NodeState.LOST, f"no heartbeat for {silent:.1f}s")
                elif silent > 2 * interval and node.state is NodeState.READY:
                    self._set_state(node, NodeState.NOT_READY, f"no heartbeat for {silent:.1f}s")
            if now - last_usage_report >= self.config.usage_report_interval:
                # Usage and allocation change with every heartbeat; the controller gets them
                # at this pace rather than once per heartbeat per node.
                last_usage_report = now
                for node in self.registry:
                    if node.state in (NodeState.READY, NodeState.NOT_READY):
                        self._publish_node(node)
            for node_name, instance in self.registry.expire_reservations(now):
                node = self.registry.get(node_name)
                if node is not None and node.session is not None:
                    node.session.send(_release_message(instance))

    # ---- placement ----

    async def Place(self, request: apb.PlaceRequest, who: Identity) -> apb.PlaceResponse:
        attempts = [_Attempt(a, request_of(a)) for a in request.items]
        # Round one: each instance's best node gets its offer, all sent before any reply is
        # awaited, and the batch waits for them once. Each ranking sees the reservations made
        # before it (they are made at once, on the live records). The offers are held until
        # the whole round is ranked, then sent together: the round yields to the event loop
        # every PLACE_CHUNK instances, and a node's offers still leave together.
        held: _Held = []
        first = []
        for i, at in enumerate(attempts, 1):
            first.append((at, self._first_offer(at, held)))
            if i % PLACE_CHUNK == 0 and i < len(attempts):
                await asyncio.sleep(0)
        for session, msg in held:
            session.send(msg)
        sent = [(at, offer) for at, offer in first if offer is not None]
        answers = await replies([e for _, (_, e) in sent], self.config.offer_timeout)
        for (at, (node, e)), reply in zip(sent, answers, strict=True):
            if self._settle_offer(at, node, e.session, reply):
                at.result = place_result_to_pb(at.req.instance, node.name, at.refusals)
        # The rest (refused, timed out, nothing reservable) go on one by one.
        rest = [at for at in attempts if at.result is None]
        if rest:
            await asyncio.gather(*(self._place_rest(at) for at in rest))
        return apb.PlaceResponse(results=[at.result for at in attempts])

    def _first_offer(self, at: _Attempt, held: _Held) -> tuple[NodeRecord, Expected] | None:
        """Reserve on the best node that takes it and hold the offer in `held` for the caller
        to send; None when no node could be reserved."""
        ranking = self.pipeline.rank(at.req, self.registry.snapshot(), limit=RANK_FIRST)
        for name in ranking.candidates:
            offer = self._reserve_and_offer(at, name, held)
            if offer is not None:
                return offer
        return None

    def _reserve_and_offer(
        self,
        at: _Attempt,
        name: str,
        held: _Held | None = None,
    ) -> tuple[NodeRecord, Expected] | None:
        """Reserve on `name` and offer it the instance: sent at once, or appended to `held`."""
        at.tried.add(name)
        node = self.registry.get(name)
        if node is None:
            at.refusals[name] = fit.GONE
            return None
        reason = self.registry.try_reserve(node, at.req, self.config.hold_seconds)
        if reason is not None:
            at.refusals[name] = reason
            return None
        session = node.session
        assert session is not None  # try_reserve checked it
        offer_id = next_id("o")
        msg = apb.SchedulerMessage(
            offer=apb.Offer(
                offer_id=offer_id, assignment=at.assignment, hold_seconds=self.config.hold_seconds
            )
        )
        expected = session.expect(msg, offer_id, send=held is None)
        if held is not None:
            held.append((session, msg))
        return node, expected

    def _settle_offer(
        self, at: _Attempt, node: NodeRecord, session: AgentSession, reply: Reply
    ) -> bool:
        """True when the agent took it; otherwise free the reservation and say why not."""
        if reply.ok:
            return True
        self.registry.release(node, at.req.instance)
        if reply.reason == "timed out":
            session.send(_release_message(at.req.instance))
            at.refusals[node.name] = fit.OFFER_TIMED_OUT
        else:
            at.refusals[node.name] = fit.refused(reply.reason)
        return False

    async def _place_rest(self, at: _Attempt) -> None:
        """Offer to the next nodes in turn until one accepts; all of them only when the best
        few (those not tried yet) refused."""
        limit: int | None = RANK_FIRST
        while True:
            ranking = self.pipeline.rank(at.req, self.registry.snapshot(), limit=limit)
            for name in ranking.candidates:
                if name in at.tried:
                    continue
                offer = self._reserve_and_offer(at, name)
                if offer is None:
                    continue
                node, e = offer
                (reply,) = await replies([e], self.config.offer_timeout)
                if self._settle_offer(at, node, e.session, reply):
                    at.result = place_result_to_pb(at.req.instance, name, at.refusals)
                    return
            if limit is None or len(ranking.candidates) < limit:
                break
            limit = None
        # Reason counts are only computed now that nothing took the instance.
        rejections = dict(ranking.rejections)
        for reason in at.refusals.values():
            rejections[reason] = rejections.get(reason, 0) + 1
        at.result = place_result_to_pb(at.req.instance, "", at.refusals, rejections)

    # ---- commands ----

    async def Command(self, request: apb.CommandRequest, who: Identity) -> apb.CommandResponse:
        sent = [self._send_command(c) for c in request.commands]
        pending = [s[1] for s in sent if not isinstance(s, apb.CommandResult)]
        answers = iter(await replies(pending, self.config.command_timeout))
        results = [
            s if isinstance(s, apb.CommandResult) else self._command_done(s, next(answers))
            for s in sent
        ]
        return apb.CommandResponse(results=results)

    def _send_command(
        self, cmd: apb.NodeCommand
    ) -> apb.CommandResult | tuple[apb.NodeCommand, Expected]:
        node = self.registry.get(cmd.node)
        if node is None or node.session is None:
            return apb.CommandResult(
                ok=False, error=f"node {cmd.node} is not connected", unconfirmed=True
            )
        which = cmd.WhichOneof("command")
        msg: Any
        if which == "start":
            msg = apb.SchedulerMessage(start=cmd.start)
            key = cmd.start.command_id or next_id("c")
            msg.start.command_id = key
        elif which == "stop":
            msg = apb.SchedulerMessage(stop=cmd.stop)
            key = cmd.stop.command_id or next_id("c")
            msg.stop.command_id = key
        elif which == "release":
            self.registry.release(node, cmd.release.instance)
            msg = apb.SchedulerMessage(release=cmd.release)
            key = cmd.release.command_id or next_id("c")
            msg.release.command_id = key
        else:
            return apb.CommandResult(ok=False, error="empty command")
        return cmd, node.session.expect(msg, key)

    def _command_done(
        self, sent: tuple[apb.NodeCommand, Expected], reply: Reply
    ) -> apb.CommandResult:
        cmd = sent[0]
        if cmd.WhichOneof("command") == "start":
            node = self.registry.get(cmd.node)
            instance = cmd.start.assignment.instance
            hold = node.holds.get(instance) if node is not None else None
            if reply.ok and hold is not None:
                hold.expires_at = None  # bound now: the hold lasts until the instance ends
            elif not reply.ok and node is not None:
                self.registry.release(node, instance)
        return apb.CommandResult(ok=reply.ok, error=reply.reason, unconfirmed=not reply.answered)

    async def SetNode(self, request: apb.SetNodeRequest, who: Identity) -> pb.Node:
        node = self.registry.get(request.name)
        if node is None:
            raise NotFound(f"node {request.name!r} is not known to the scheduler")
        if request.HasField("schedulable"):
            node.schedulable = request.schedulable
        if request.HasField("draining"):
            node.draining = request.draining
        self.registry.changed()
        self._publish_node(node)
        return self._node_pb.build(node)

    # ---- controller feed ----

    async def Watch(
        self, request: apb.WatchClusterRequest, who: Identity
    ) -> AsyncIterator[apb.ClusterUpdates]:
        queue: asyncio.Queue[apb.ClusterUpdate | None] = asyncio.Queue()
        first = apb.ClusterUpdates()
        for node in self.registry:
            first.updates.append(apb.ClusterUpdate(node=self._node_pb.build(node)))
            if node.state in (NodeState.READY, NodeState.NOT_READY):
                first.updates.append(_sync_update(node))
        self.hub.queues.add(queue)
        try:
            yield first
            while True:
                update = await queue.get()
                if update is None:
                    return
                batch = apb.ClusterUpdates(updates=[update])
                # Drain whatever else is queued so a burst travels as one message.
                while not queue.empty() and len(batch.updates) < 1000:
                    more = queue.get_nowait()
                    if more is None:
                        yield batch
                        return
                    batch.updates.append(more)
                yield batch
        finally:
            self.hub.queues.discard(queue)


@dataclass(slots=True)
class _Attempt:
    """One instance of a Place batch: what was tried, why nodes said no, and the outcome."""

    assignment: apb.Assignment
    req: PlacementRequest
    tried: set[str] = field(default_factory=set)
    refusals: dict[str, fit.Reason] = field(default_factory=dict)
    result: apb.PlaceResult | None = None


def node_labels(announced: Mapping[str, str], node: str) -> dict[str, str]:
    """The labels an agent announces, checked, plus those the scheduler sets itself: a node
    may not pick its own `orka.io/` labels (a rogue agent announcing `orka.io/node=n1` would
    receive the replicas pinned to n1), so `orka.io/node` comes from its certificate."""
    reserved = reserved_labels(announced)
    if reserved:
        keys = ", ".join(quote(k) for k in reserved[:5])
        raise PermissionDenied(
            f"register: node.labels {keys}: the {RESERVED_LABEL_PREFIX} prefix is set by the"
            " scheduler only"
        )
    if len(announced) > MAX_NODE_LABELS:
        raise Invalid(f"register: node.labels: at most {MAX_NODE_LABELS}, got {len(announced)}")
    for key, value in announced.items():
        try:
            check_label_key(key)
            check_label_value(value)
        except ValueError as err:
            raise Invalid(f"register: node.labels[{quote(key)}]: {err}") from None
    return {**announced, NODE_LABEL: node}


def _sync_update(node: NodeRecord) -> apb.ClusterUpdate:
    """Everything the node reports holding, for the controller to reconcile against."""
    sync = apb.NodeSync(node=node.name)
    for report in node.reports.values():
        sync.instances.append(convert.report_to_pb(report))
    return apb.ClusterUpdate(sync=sync)


def _release_message(instance: str) -> apb.SchedulerMessage:
    """Tell an agent to drop its reservation for `instance`."""
    return apb.SchedulerMessage(
        release=apb.ReleaseOffer(command_id=next_id("r"), instance=instance)
    )


_PHASES = {convert.phase_to_pb(p): p for p in InstancePhase}


def _unchanged(node: NodeRecord, old: InstanceReport, status: apb.InstanceStatus) -> bool:
    """True when `status` says exactly what `old` (the stored report) says, and applying it
    again would change nothing: compared on the raw message, before building any model."""
    phase = _PHASES.get(status.phase)
    if (
        phase is not old.phase
        or status.restarts != old.restarts
        or status.reason[: convert.MAX_REASON] != old.reason
        or status.message[: convert.MAX_STATUS_MESSAGE] != old.message
        or status.workload != old.workload
        or (status.started_at or None) != old.started_at
        or (status.finished_at or None) != old.finished_at
        or (status.exit_code if status.HasField("exit_code") else None) != old.exit_code
    ):
        return False
    hold = node.holds.get(status.name)
    if phase in TERMINAL_PHASES:
        return hold is None
    return hold is not None and hold.expires_at is None
