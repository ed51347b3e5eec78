"""The agent gateway: one stream per agent, its registration, and what it reports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
import structlog

from orka.api import agent_pb2 as apb
from orka.errors import Invalid, NotLeader, PermissionDenied
from orka.models import TERMINAL_PHASES, InstancePhase, InstanceReport, NodeState
from orka.rpc import convert, convert_volumes
from orka.rpc.frames import drain
from orka.scheduler import pace, volumes
from orka.scheduler.feed import Feed
from orka.scheduler.liveness import Liveness, lateness
from orka.scheduler.registry import NodeRecord, Registry
from orka.scheduler.session import AgentSession
from orka.scheduler.streams import SessionRelay
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


class Gateway:
    """Serves each agent's stream: registers the node (named by its certificate), applies its
    heartbeats and events to the registry, resolves its replies to offers and commands, and
    publishes what changed."""

    def __init__(
        self,
        registry: Registry,
        feed: Feed,
        liveness: Liveness,
        register_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.feed = feed
        self.liveness = liveness
        self.register_timeout = register_timeout
        self.clock = clock
        # Leaving agents last told to wait for replacements, by node: re-checked each pass
        # of the liveness clock (`recheck_leaves`), so that one whose last possible taker goes
        # away (lost, left, cordoned) is told at once there is nothing more to wait for.
        self._waiting: dict[str, AgentSession] = {}
        # Logs, exec and console sessions on the agents' streams (orka/scheduler/streams.py).
        self.sessions = SessionRelay(registry)
        # Why this gateway's term ended (None while it lasts): a registration arriving after
        # that (its stream was opened, or asked to register again, just before) is refused
        # with it, not kept in a registry no part of the scheduler looks at any more.
        self.ended: str | None = None

    def close(self) -> None:
        """End every agent's stream (the service is stopping)."""
        self._end_streams(None)

    def stand_by(self, message: str) -> None:
        """The term ended: every agent's stream ends with NOT_LEADER, and so does any
        registration still on its way."""
        self.ended = message
        self._end_streams(message)

    def _end_streams(self, not_leader: str | None) -> None:
        """End every registered agent's stream, with NOT_LEADER and `not_leader` if given."""
        for node in self.registry:
            session = node.session
            if session is None or session.closed:
                continue
            if not_leader is not None:
                session.error, session.error_type = not_leader, NotLeader
            session.close()

    async def connect(
        self, messages: AsyncIterator[apb.AgentMessage], node_name: str
    ) -> AsyncIterator[apb.SchedulerMessage]:
        """One agent's stream; `node_name` comes from its certificate."""
        session = AgentSession(node_name)
        reader = asyncio.create_task(self._read_agent(messages, session))
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
            async with asyncio.timeout(self.register_timeout):
                first = await anext(iterator)
            if first.WhichOneof("body") != "register":
                raise Invalid("the first message on the agent stream must be register")
            if self.ended is not None:
                raise NotLeader(self.ended)
            node = self._register(session, first.register)
            async for msg in iterator:
                self._on_agent_message(node, session, msg)
        except (TimeoutError, StopAsyncIteration):
            pass
        except NotLeader as err:
            session.error, session.error_type = err.message, NotLeader
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
        hinted = convert.duration_from_pb(reg.heartbeat_interval, "register: heartbeat_interval")
        if hinted < 0:
            raise Invalid(f"register: heartbeat_interval must not be negative, got {hinted:g}s")
        pool, volume_backends, volume_capacity = convert_volumes.volume_offer(info)
        reports = [
            (convert.report_from_pb(s, session.node), convert.resources_from_pb(s.resources))
            for s in reg.instances
        ]
        held = volumes.registered(reg)
        node = self.registry.upsert(session.node)
        node.volumes = held
        if node.session is not None and node.session is not session:
            node.session.close()
        node.session = session
        node.capacity = capacity
        node.allocatable = allocatable
        node.labels = labels
        node.drivers = frozenset(info.drivers)
        node.pool, node.volume_backends = pool, volume_backends
        node.volume_capacity_bytes = volume_capacity
        node.last_seen = self.clock()
        node.last_heartbeat_wall = time.time()
        node.interval, node.next_interval = self.liveness.pace.interval, 0.0
        node.hinted = hinted
        self.liveness.registered(node.last_seen)
        # A leave ends with the stream it was announced on: registering again makes the node
        # schedulable (an operator's cordon or drain, kept by the controller, is not touched).
        node.leaving = False
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
                registered=apb.Registered(node=node.name, heartbeat_interval=node.interval)
            )
        )
        self.feed.publish_node(node)
        self.feed.publish_sync(node)
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
            node.last_heartbeat_wall = wall = time.time()
            late = lateness(node, wall - hb.sent_at)
            if late is not None:
                self.liveness.heard(late)
            if node.next_interval:
                pace.heard(node)
            usage = hb.usage
            if (
                usage.cpu_millis != node.usage.cpu_millis
                or usage.memory_bytes != node.usage.memory_bytes
            ):
                node.usage = convert.resources_from_pb(usage)
            for status in hb.instances:
                self._on_status(node, status)
            if node.state is not NodeState.READY:
                self.liveness.set_state(node, NodeState.READY)
        elif kind == "instance_status":
            self._on_status(node, msg.instance_status)
        elif kind == "volume_status":
            volumes.on_status(node, self.feed, msg.volume_status)
        elif kind == "offer_reply":
            r = msg.offer_reply
            session.resolve(r.offer_id, r.status)
        elif kind == "ack":
            a = msg.ack
            session.resolve(a.command_id, a.status)
        elif kind == "leave":
            log.info("agent leaving", node=node.name, reason=msg.leave.reason)
            session.left = True
            node.leaving = True
            self.registry.changed()
            self.feed.publish_node(node)
            reply = self.leave_reply(node)
            session.send(apb.SchedulerMessage(leave_reply=reply))
            if reply.wait:
                self._waiting[node.name] = session
        elif kind == "session_output":
            self.sessions.on_output(session, msg.session_output)
        elif kind == "batch":
            for inner in msg.batch.messages:
                if inner.WhichOneof("body") == "batch":
                    raise Invalid("a batch must not hold another batch")
                self._on_agent_message(node, session, inner)
        elif kind == "register":
            raise Invalid("register may only be sent once per stream")
        else:
            raise Invalid("empty agent message")

    def leave_reply(self, node: NodeRecord) -> apb.LeaveReply:
        """Whether the leaving node's agent should wait for replacements: only while some
        other node is READY and takes new instances, and a controller is connected to place
        them. Otherwise none can come, and waiting would only hold the agent for its whole
        leave timeout."""
        taker = next(
            (
                other
                for other in self.registry
                if other is not node and other.state is NodeState.READY and other.takes_new
            ),
            None,
        )
        if taker is None:
            return apb.LeaveReply(wait=False, reason="no other ready, schedulable node")
        if not self.feed.hub.queues:
            # Replacements are the controller's to decide: with none connected, none come.
            return apb.LeaveReply(wait=False, reason="no controller connected")
        return apb.LeaveReply(wait=True, reason=f"node {taker.name} can take instances")

    def recheck_leaves(self, now: float) -> None:
        """A duty of the liveness clock: tell each agent still waiting for its instances to be
        replaced when no other node can take them any more."""
        for name, session in list(self._waiting.items()):
            node = self.registry.get(name)
            if node is None or node.session is not session or session.closed:
                del self._waiting[name]
                continue
            reply = self.leave_reply(node)
            if not reply.wait:
                del self._waiting[name]
                log.info("leaving agent need not wait", node=name, reason=reply.reason)
                session.send(apb.SchedulerMessage(leave_reply=reply))

    def _on_status(self, node: NodeRecord, status: apb.InstanceStatus) -> None:
        old = node.reports.get(status.name)
        if old is not None and _unchanged(node, old, status):
            return  # the same as last time and already accounted for: nothing to do
        report = convert.report_from_pb(status, node.name)
        if self.registry.apply_report(node, report, convert.resources_from_pb(status.resources)):
            self.feed.publish_instance(node, status)

    def _disconnected(self, session: AgentSession) -> None:
        self.sessions.agent_gone(session)
        node = self.registry.get(session.node)
        if node is None or node.session is not session:
            return
        node.session = None
        if session.left:
            node.leaving = False
            for name in list(node.holds):
                node.drop_hold(name)
            node.reports.clear()
            self.liveness.set_state(node, NodeState.LEFT, "agent left")
        log.info("agent disconnected", node=node.name, left=session.left)


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


_PHASES = {convert.phase_to_pb(p): p for p in InstancePhase}


def _ports_differ(status: apb.InstanceStatus, old: InstanceReport) -> bool:
    return [(p.name, p.port, p.host_port, p.protocol) for p in status.ports] != [
        (b.name, b.port, b.host_port, convert.protocol_to_pb(b.protocol)) for b in old.ports
    ]


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
        or status.address != old.address
        or status.host_ip != old.host_ip
        or ((status.ports or old.ports) and _ports_differ(status, old))
        or status.health_message[: convert.MAX_STATUS_MESSAGE] != old.health_message
        or (status.health_time or None) != old.health_changed_at
    ):
        return False
    hold = node.holds.get(status.name)
    if phase in TERMINAL_PHASES:
        return hold is None
    return hold is not None and hold.expires_at is None
