"""The scheduler seen from hand-driven agents on real gRPC: what a refused or unanswered offer
leaves reserved, under which name a node registers, and the READY -> NOT_READY -> LOST steps.

Like Nomad's planner Harness, the agents here record what the scheduler sent them and answer as
each test tells them to, and the tests then assert the registry (holds, used resources, states).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
import structlog.testing
from google.rpc import code_pb2

from orka import fit
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.models import NodeState, PortProtocol
from orka.rpc import convert
from orka.rpc.client import secure_channel
from orka.rpc.place_reasons import reasons_from_pb
from orka.scheduler.registry import NodeRecord
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from tests.waits import until

MIB = 1 << 20
# Agents here send no heartbeats: intervals long enough that none goes NOT_READY mid-test.
# The offer timeout is what a silent agent costs; a loaded machine still answers within it.
QUIET = {"heartbeat_interval": 5.0, "node_lost_after": 60.0, "offer_timeout": 1.0}


def reasons_text(result: apb.PlaceResult) -> str:
    """The reasons as the controller shows them; "" when the instance was placed."""
    return fit.format_reasons(reasons_from_pb(result)) if result.reasons else ""


class HandAgent:
    """An agent stream driven by the test: `answer` decides each offer (True accepts, a string
    refuses with that reason, None never answers); commands are acknowledged, a start with
    an error when `start_errors` has one for the instance; every message received is kept."""

    def __init__(
        self,
        s: Scheduler,
        certs: Path,
        name: str,
        answer: bool | str | None = True,
    ) -> None:
        self.channel = secure_channel(
            f"127.0.0.1:{s.port}", TlsFiles.for_service(certs, "agent", name), "scheduler"
        )
        self.call = apb_grpc.SchedulerStub(self.channel).Connect()
        self.answer = answer
        self.start_errors: dict[str, str] = {}
        self.received: list[apb.SchedulerMessage] = []
        self.registered: apb.Registered | None = None
        self.task: asyncio.Task[None] | None = None

    async def register(
        self,
        labels: dict[str, str] | None = None,
        running: tuple[str, ...] = (),
        ports: tuple[pb.PortBinding, ...] = (),
        **node_info: Any,
    ) -> apb.SchedulerMessage:
        """Register, announcing `running` as instances of "web" that use 100 m / 64 MiB (and
        have bound `ports`)."""
        res = pb.Resources(cpu_millis=1000, memory_bytes=1024 * MIB)
        instances = [
            apb.InstanceStatus(
                name=name,
                workload="web",
                phase=pb.Instance.RUNNING,
                resources=pb.Resources(cpu_millis=100, memory_bytes=64 * MIB),
                ports=ports,
            )
            for name in running
        ]
        await self.call.write(
            apb.AgentMessage(
                register=apb.Register(
                    node=apb.NodeInfo(
                        capacity=res,
                        allocatable=res,
                        drivers=["fake"],
                        labels=labels or {},
                        **node_info,
                    ),
                    instances=instances,
                )
            )
        )
        first = await self.call.read()
        if first is not grpc.aio.EOF and first.WhichOneof("body") == "registered":
            self.registered = first.registered
            self.task = asyncio.create_task(self._serve())
        return first

    def messages(self, kind: str) -> list[apb.SchedulerMessage]:
        return [m for m in self.received if m.WhichOneof("body") == kind]

    async def _serve(self) -> None:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            inner = list(msg.batch.messages) if msg.WhichOneof("body") == "batch" else [msg]
            self.received.extend(inner)
            for m in inner:
                kind = m.WhichOneof("body")
                if kind in ("start", "stop", "release"):
                    cmd = getattr(m, kind)
                    error = ""
                    if kind == "start":
                        error = self.start_errors.get(cmd.assignment.instance, "")
                    status = (
                        convert.error_status(code_pb2.FAILED_PRECONDITION, error)
                        if error
                        else convert.ok_status()
                    )
                    ack = apb.CommandAck(command_id=cmd.command_id, status=status)
                    await self.call.write(apb.AgentMessage(ack=ack))
                if kind != "offer" or self.answer is None:
                    continue
                if self.answer is True:
                    status = convert.ok_status()
                else:
                    why = self.answer if isinstance(self.answer, str) else ""
                    status = convert.error_status(code_pb2.FAILED_PRECONDITION, why)
                reply = apb.OfferReply(offer_id=m.offer.offer_id, status=status)
                await self.call.write(apb.AgentMessage(offer_reply=reply))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.channel.close()


@pytest.fixture
async def agents() -> AsyncIterator[list[HandAgent]]:
    made: list[HandAgent] = []
    yield made
    for a in made:
        await a.close()


async def start_scheduler(
    certs: Path, clock: Callable[[], float] = time.monotonic, **config: float
) -> Scheduler:
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0", **config),  # type: ignore[arg-type]
        TlsFiles.for_service(certs, "scheduler", "scheduler"),
        clock=clock,
    )
    await s.start()
    return s


async def register_node(
    s: Scheduler, certs: Path, agents: list[HandAgent], **register: Any
) -> NodeRecord:
    """A hand agent connects as node-1 and registers; its record at the scheduler."""
    agents.append(HandAgent(s, certs, "node-1"))
    await agents[-1].register(**register)
    node = s.registry.get("node-1")
    assert node is not None
    return node


@pytest.fixture
async def scheduler(certs_dir: Path) -> AsyncIterator[Scheduler]:
    s = await start_scheduler(certs_dir, **QUIET)
    yield s
    await s.stop()


def held(node: NodeRecord) -> tuple[dict[str, float | None], int, int]:
    """A node's reservations/bindings (instance -> expiry) and the resources they use."""
    return ({k: h.expires_at for k, h in node.holds.items()}, node.cpu_used, node.mem_used)


WEB = pb.WorkloadSpec(
    name="web",
    kind=pb.WorkloadSpec.PROCESS,
    resources=pb.Resources(cpu_millis=100, memory_bytes=64 * MIB),
)


def controller_channel(s: Scheduler, certs: Path) -> grpc.aio.Channel:
    return secure_channel(
        f"127.0.0.1:{s.port}", TlsFiles.for_service(certs, "controller", "controller"), "scheduler"
    )


async def place(s: Scheduler, certs: Path, count: int) -> list[apb.PlaceResult]:
    """Place web-0 .. web-<count-1> (100 m, 64 MiB each) as the controller does."""
    async with controller_channel(s, certs) as channel:
        items = [apb.Assignment(instance=f"web-{i}", spec=WEB) for i in range(count)]
        resp = await apb_grpc.SchedulerStub(channel).Place(apb.PlaceRequest(items=items))
        return list(resp.results)


async def command(s: Scheduler, certs: Path, *commands: apb.NodeCommand) -> list[apb.CommandResult]:
    async with controller_channel(s, certs) as channel:
        req = apb.CommandRequest(commands=commands)
        return list((await apb_grpc.SchedulerStub(channel).Command(req)).results)


def start(node: str, instance: str) -> apb.NodeCommand:
    assignment = apb.Assignment(instance=instance, spec=WEB)
    return apb.NodeCommand(node=node, start=apb.StartInstance(assignment=assignment))


# ---- reservations after refusals and timeouts ----


async def test_refused_and_timed_out_offers_leave_nothing_reserved(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 refuses every offer, node-2 never answers: after Place, neither holds anything
    and the silent one was told to release each instance it was offered."""
    agents += [
        HandAgent(scheduler, certs_dir, "node-1", answer="disk full"),
        HandAgent(scheduler, certs_dir, "node-2", answer=None),
    ]
    for a in agents:
        await a.register()
    results = await place(scheduler, certs_dir, 3)
    assert [r.node for r in results] == ["", "", ""]
    for r in results:
        assert dict(r.refusals) == {"node-1": "refused: disk full", "node-2": "offer timed out"}
        assert reasons_text(r) == "1 node: offer timed out; 1 node: refused: disk full"
    for name in ("node-1", "node-2"):
        node = scheduler.registry.get(name)
        assert node is not None
        assert held(node) == ({}, 0, 0)
        # The ranking sees the nodes as empty again.
        view = scheduler.registry.snapshot().by_name[name]
        assert (view.cpu_used, view.mem_used, view.total_instances) == (0, 0, 0)
    silent = agents[1]
    offered = sorted(m.offer.assignment.instance for m in silent.messages("offer"))
    assert offered == ["web-0", "web-1", "web-2"]
    await until(lambda: len(silent.messages("release")) == 3)
    assert sorted(m.release.instance for m in silent.messages("release")) == offered
    # A refusal is the agent's own answer: nothing to release there.
    assert agents[0].messages("release") == []


async def test_a_refusal_frees_its_node_and_the_taker_holds_the_reservation(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    agents += [
        HandAgent(scheduler, certs_dir, "node-1", answer="disk full"),
        HandAgent(scheduler, certs_dir, "node-2", answer=True),
    ]
    for a in agents:
        await a.register()
    results = await place(scheduler, certs_dir, 2)
    assert [r.node for r in results] == ["node-2", "node-2"]
    # Spread: web-0 is offered to node-1 first, web-1 (ranked with web-0 reserved there) to
    # node-2 at once; web-0 then goes to node-2 too.
    assert [dict(r.refusals) for r in results] == [{"node-1": "refused: disk full"}, {}]
    refuser, taker = scheduler.registry.get("node-1"), scheduler.registry.get("node-2")
    assert refuser is not None and taker is not None
    assert held(refuser) == ({}, 0, 0)
    holds, cpu, mem = held(taker)
    assert sorted(holds) == ["web-0", "web-1"]
    # Still reservations (an expiry) until the controller binds them.
    assert all(expiry is not None for expiry in holds.values())
    assert (cpu, mem) == (200, 128 * MIB)


# ---- the node's name ----


@pytest.mark.parametrize(
    "labels",
    [
        {"node": "node-2", "name": "node-2", "hostname": "node-2"},
        {"kubernetes.io/hostname": "node-2", "node.name": "node-2"},
        # A reserved label may be refused outright; it must never rename the node.
        {"orka.io/node": "node-2"},
    ],
)
async def test_register_takes_the_name_from_the_certificate_not_the_labels(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent], labels: dict[str, str]
) -> None:
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    try:
        await agents[0].register(labels)
    except grpc.aio.AioRpcError as err:
        # Refusing a reserved label is right (PERMISSION_DENIED: orka.io/ is the scheduler's);
        # naming the node after it is not.
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "orka.io/" in (err.details() or "")
        assert "node-2" not in scheduler.registry.nodes
        return
    assert "node-2" not in scheduler.registry.nodes
    assert agents[0].registered is not None
    assert agents[0].registered.node == "node-1"
    assert list(scheduler.registry.nodes) == ["node-1"]


# ---- liveness ----


class StepClock:
    """A monotonic clock the test moves by hand; counts reads so a test can wait for the
    liveness loop to have looked at the time it set."""

    def __init__(self) -> None:
        # Starts at the real clock's time: reservations still expire on time.monotonic.
        self.now = time.monotonic()
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    async def step_to(self, t: float) -> None:
        """Set the time, then wait until liveness has run at least one full pass at it."""
        self.now = t
        seen = self.reads
        await until(lambda: self.reads >= seen + 2)


async def test_silent_node_goes_not_ready_then_lost_at_the_configured_times(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """heartbeat_interval 0.2 s, node_lost_after 1.0 s: NOT_READY once silent for more than two
    intervals (0.4 s), LOST once silent for more than node_lost_after, and those states in that
    order on the controller feed. The clock is stepped, so the bounds are exact."""
    clock = StepClock()
    interval, lost_after = 0.2, 1.0
    s = await start_scheduler(
        certs_dir, clock, heartbeat_interval=interval, node_lost_after=lost_after
    )
    feed: asyncio.Queue[apb.ClusterUpdate | None] = asyncio.Queue()
    s.hub.queues.add(feed)
    try:
        t0 = clock.now
        node = await register_node(s, certs_dir, agents, running=("web-1",))
        assert node.last_seen == t0
        assert held(node) == ({"web-1": None}, 100, 64 * MIB)

        await clock.step_to(t0 + 2 * interval - 0.01)
        assert node.state is NodeState.READY
        await clock.step_to(t0 + 2 * interval + 0.01)
        assert node.state is NodeState.NOT_READY
        assert node.message == "no heartbeat for 0.4s"
        await clock.step_to(t0 + lost_after - 0.01)
        assert node.state is NodeState.NOT_READY
        await clock.step_to(t0 + lost_after + 0.01)
        assert node.state is NodeState.LOST
        assert node.message == "no heartbeat for 1.0s"
        # A lost node holds nothing (its instances are replaced elsewhere) and its stream is
        # cut: an agent that comes back must register again.
        assert held(node) == ({}, 0, 0)
        assert node.reports == {}
        await until(lambda: agents[0].task is not None and agents[0].task.done())
        assert node.session is None
    finally:
        await s.stop()
    states = []
    while not feed.empty():
        update = feed.get_nowait()
        if update is not None and update.WhichOneof("body") == "node":
            if not states or states[-1] != update.node.state:
                states.append(update.node.state)
    assert states == [pb.Node.READY, pb.Node.NOT_READY, pb.Node.LOST]


async def test_a_heartbeat_brings_a_not_ready_node_back(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    clock = StepClock()
    s = await start_scheduler(certs_dir, clock, heartbeat_interval=0.2, node_lost_after=1.0)
    try:
        t0 = clock.now
        node = await register_node(s, certs_dir, agents)
        await clock.step_to(t0 + 0.5)
        assert node.state is NodeState.NOT_READY
        await agents[0].call.write(apb.AgentMessage(heartbeat=apb.Heartbeat()))
        await until(lambda: node.state is NodeState.READY)
        assert node.last_seen == t0 + 0.5
        # Silence is measured from that heartbeat now.
        await clock.step_to(t0 + 0.5 + 0.39)
        assert node.state is NodeState.READY
    finally:
        await s.stop()


# ---- reservations that expire, and re-registering ----


async def test_an_unbound_reservation_expires_and_the_agent_is_told(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """An accepted offer the controller never binds holds its resources for hold_seconds,
    then is dropped and the agent gets a ReleaseOffer for it."""
    s = await start_scheduler(certs_dir, **QUIET, hold_seconds=0.3)
    try:
        agents.append(HandAgent(s, certs_dir, "node-1"))
        await agents[0].register()
        (result,) = await place(s, certs_dir, 1)
        assert result.node == "node-1"
        node = s.registry.get("node-1")
        assert node is not None
        (offer,) = [m.offer for m in agents[0].messages("offer")]
        # The agent is told how long the scheduler holds the reservation for it.
        assert (offer.assignment.instance, offer.hold_seconds) == ("web-0", 0.3)
        assert re.fullmatch(r"o\d+", offer.offer_id), offer.offer_id
        await until(lambda: agents[0].messages("release"))
        assert [m.release.instance for m in agents[0].messages("release")] == ["web-0"]
        assert held(node) == ({}, 0, 0)
    finally:
        await s.stop()


async def test_re_registering_replaces_what_the_node_holds_but_keeps_offers_in_flight(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    first = HandAgent(scheduler, certs_dir, "node-1")
    agents.append(first)
    await first.register(running=("web-old",))
    (result,) = await place(scheduler, certs_dir, 1)
    assert result.node == "node-1"
    node = scheduler.registry.get("node-1")
    assert node is not None
    assert sorted(node.holds) == ["web-0", "web-old"]
    # The same node again on a new stream (an agent restart), no longer running web-old.
    second = HandAgent(scheduler, certs_dir, "node-1")
    agents.append(second)
    await second.register(running=("web-new",))
    holds, cpu, mem = held(node)
    assert sorted(holds) == ["web-0", "web-new"]
    assert holds["web-new"] is None and holds["web-0"] is not None
    assert (cpu, mem) == (200, 128 * MIB)
    assert node.session is not None and node.session is not first
    # The older stream is closed.
    await until(lambda: first.task is not None and first.task.done())


# ---- commands and leaving ----


async def test_a_started_instance_is_bound_and_a_failed_start_frees_its_reservation(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    agents[0].start_errors["web-1"] = "image missing"
    await agents[0].register()
    results = await place(scheduler, certs_dir, 2)
    assert [r.node for r in results] == ["node-1", "node-1"]
    done = await command(scheduler, certs_dir, start("node-1", "web-0"), start("node-1", "web-1"))
    assert [(r.status.code, r.status.message, r.unconfirmed) for r in done] == [
        (code_pb2.OK, "", False),
        (code_pb2.FAILED_PRECONDITION, "image missing", False),
    ]
    node = scheduler.registry.get("node-1")
    assert node is not None
    # web-0 is bound (no expiry: it holds until the instance ends), web-1 holds nothing.
    assert held(node) == ({"web-0": None}, 100, 64 * MIB)


async def test_commands_nobody_answered_say_why_in_their_status(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """The scheduler's own answers: UNAVAILABLE for a node not connected and DEADLINE_EXCEEDED
    for an agent that did not answer in time (both unconfirmed: it may have acted), and
    INVALID_ARGUMENT for a command with nothing in it."""
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register()
    agents[0].task.cancel()  # type: ignore[union-attr]  # connected, but answers nothing now
    scheduler.relay.command_timeout = 0.2
    done = await command(
        scheduler, certs_dir, start("node-9", "web-0"), apb.NodeCommand(node="node-1")
    )
    assert [(r.status.code, r.status.message, r.unconfirmed) for r in done] == [
        (code_pb2.UNAVAILABLE, "node node-9 is not connected", True),
        (code_pb2.INVALID_ARGUMENT, "empty command", False),
    ]
    (silent,) = await command(scheduler, certs_dir, start("node-1", "web-1"))
    assert (silent.status.code, silent.status.message, silent.unconfirmed) == (
        code_pb2.DEADLINE_EXCEEDED,
        "timed out",
        True,
    )


async def test_a_release_command_frees_the_reservation_at_once(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register()
    (result,) = await place(scheduler, certs_dir, 1)
    assert result.node == "node-1"
    release = apb.NodeCommand(node="node-1", release=apb.ReleaseOffer(instance="web-0"))
    (done,) = await command(scheduler, certs_dir, release)
    assert done.status.code == code_pb2.OK
    node = scheduler.registry.get("node-1")
    assert node is not None
    assert held(node) == ({}, 0, 0)
    assert [m.release.instance for m in agents[0].messages("release")] == ["web-0"]


async def test_a_leaving_node_drains_then_is_left_holding_nothing(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """Leave: the node is leaving at once (no new placement, its instances to be moved; not
    `draining`, which is an operator's and outlives the agent), the agent is told there is
    nothing to wait for (no other node), and once its stream ends it is LEFT with nothing held
    and no longer leaving."""
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register(running=("web-old",))
    node = scheduler.registry.get("node-1")
    assert node is not None
    # A snapshot taken before the leave (as by an earlier placement) must not be reused.
    assert scheduler.registry.snapshot().by_name["node-1"].schedulable
    await agents[0].call.write(apb.AgentMessage(leave=apb.Leave(reason="shutting down")))
    await until(lambda: node.leaving)
    assert node.state is NodeState.READY and node.schedulable and not node.draining
    await until(lambda: any(m.HasField("leave_reply") for m in agents[0].received))
    (reply,) = [m.leave_reply for m in agents[0].received if m.HasField("leave_reply")]
    assert (reply.wait, reply.reason) == (False, "no other ready, schedulable node")
    (result,) = await place(scheduler, certs_dir, 1)
    assert (result.node, reasons_text(result)) == ("", "1 node: cordoned")
    assert [(r.code, r.node_count, r.resolvable) for r in result.reasons] == [
        ("NODE_CORDONED", 1, True)
    ]
    # Filtered out by the ranking (its snapshot saw the change), not refused on reserving.
    assert dict(result.refusals) == {}
    await agents[0].call.done_writing()
    await until(lambda: node.state is NodeState.LEFT)
    assert held(node) == ({}, 0, 0)
    assert (node.leaving, node.draining, node.message, node.reports) == (
        False,
        False,
        "agent left",
        {},
    )


async def test_set_node_cordons_for_the_next_ranking_and_changes_only_what_it_names(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register()
    assert scheduler.registry.snapshot().by_name["node-1"].schedulable
    async with controller_channel(scheduler, certs_dir) as channel:
        api = apb_grpc.SchedulerStub(channel)
        node = await api.SetNode(apb.SetNodeRequest(name="node-1", draining=True))
        assert (node.schedulable, node.draining) == (True, True)
        node = await api.SetNode(apb.SetNodeRequest(name="node-1", schedulable=False))
        assert (node.schedulable, node.draining) == (False, True)
        node = await api.SetNode(apb.SetNodeRequest(name="node-1", draining=False))
        assert (node.schedulable, node.draining) == (False, False)
    (result,) = await place(scheduler, certs_dir, 1)
    assert (result.node, reasons_text(result), dict(result.refusals)) == (
        "",
        "1 node: cordoned",
        {},
    )


async def test_heartbeat_usage_reaches_the_controller_feed_at_the_report_interval(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """A heartbeat's usage and time are recorded at once but not published on their own; the
    node (with that usage) goes to the controllers once usage_report_interval has passed."""
    clock = StepClock()
    s = await start_scheduler(
        certs_dir,
        clock,
        heartbeat_interval=1.0,
        node_lost_after=3.0,
        usage_report_interval=0.5,
    )
    feed: asyncio.Queue[apb.ClusterUpdate | None] = asyncio.Queue()
    try:
        t0 = clock.now
        node = await register_node(s, certs_dir, agents)
        registered_wall = node.last_heartbeat_wall
        s.hub.queues.add(feed)
        before = time.time()
        usage = pb.Resources(cpu_millis=250, memory_bytes=100 * MIB)
        await clock.step_to(t0 + 0.2)
        await agents[0].call.write(apb.AgentMessage(heartbeat=apb.Heartbeat(usage=usage)))
        await until(lambda: node.usage.cpu_millis == 250)
        assert (node.usage.cpu_millis, node.usage.memory_bytes) == (250, 100 * MIB)
        assert node.last_seen == t0 + 0.2
        assert node.last_heartbeat_wall >= before > registered_wall
        assert feed.empty()
        await clock.step_to(t0 + 0.2 + 0.5 + 0.01)
        await until(lambda: not feed.empty())
        update = feed.get_nowait()
        assert update is not None and update.WhichOneof("body") == "node"
        assert update.node.name == "node-1" and update.node.state == pb.Node.READY
        assert (update.node.usage.cpu_millis, update.node.usage.memory_bytes) == (250, 100 * MIB)
        sent = convert.node_from_pb(update.node).last_heartbeat
        assert sent == pytest.approx(node.last_heartbeat_wall, abs=1e-6)  # to the microsecond
    finally:
        await s.stop()


async def test_when_the_best_few_refuse_every_other_node_is_offered(
    scheduler: Scheduler,
    certs_dir: Path,
    agents: list[HandAgent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Offers go to the best RANK_FIRST nodes first, then each retry ranks RANK_FIRST more
    than were tried: with the best three of four refusing, the least preferred node still
    gets the instance, and no ranking asked for every node."""
    monkeypatch.setattr("orka.scheduler.placer.RANK_FIRST", 2)
    for name in ("node-1", "node-2", "node-3"):
        agents.append(HandAgent(scheduler, certs_dir, name, answer="busy"))
        await agents[-1].register()
    agents.append(HandAgent(scheduler, certs_dir, "node-4"))
    # Already running one of the workload: spread ranks it last.
    await agents[-1].register(running=("web-old",))
    limits: list[int | None] = []
    rank = scheduler.pipeline.rank

    def counted(*args: object, limit: int | None = None) -> object:
        limits.append(limit)
        return rank(*args, limit=limit)  # type: ignore[arg-type]

    monkeypatch.setattr(scheduler.pipeline, "rank", counted)
    (result,) = await place(scheduler, certs_dir, 1)
    assert result.node == "node-4"
    assert dict(result.refusals) == {f"node-{i}": "refused: busy" for i in (1, 2, 3)}
    # The first offer ranks the best two; the retries one tried + 2, then three tried + 2
    # (which finds only four nodes: every feasible one was ranked).
    assert limits == [2, 3, 5]


async def test_an_instance_is_offered_to_max_offers_nodes_then_comes_back_unplaced(
    scheduler: Scheduler,
    certs_dir: Path,
    agents: list[HandAgent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_OFFERS refusals in one Place call the instance comes back unplaced with them
    (the controller tries again later) instead of being offered to every node in turn."""
    monkeypatch.setattr("orka.scheduler.placer.RANK_FIRST", 2)
    monkeypatch.setattr("orka.scheduler.placer.MAX_OFFERS", 3)
    for name in ("node-1", "node-2", "node-3", "node-4"):
        agents.append(HandAgent(scheduler, certs_dir, name, answer="busy"))
        await agents[-1].register()
    agents.append(HandAgent(scheduler, certs_dir, "node-5"))
    await agents[-1].register(running=("web-old",))  # would take it, but ranks last
    (result,) = await place(scheduler, certs_dir, 1)
    assert result.node == ""
    assert dict(result.refusals) == {f"node-{i}": "refused: busy" for i in (1, 2, 3)}
    assert reasons_text(result) == "3 nodes: refused: busy"
    assert [len(a.messages("offer")) for a in agents] == [1, 1, 1, 0, 0]


# ---- what a state change publishes and logs ----


def feed_of(s: Scheduler) -> list[apb.ClusterUpdate | None]:
    """Subscribe to the controller feed; the returned list fills as updates are published."""
    got: list[apb.ClusterUpdate | None] = []

    class Sink(asyncio.Queue):  # type: ignore[type-arg]
        def put_nowait(self, item: apb.ClusterUpdate | None) -> None:
            got.append(item)

    s.hub.queues.add(Sink())
    return got


def kinds(feed: list[apb.ClusterUpdate | None]) -> list[tuple[str, str, str]]:
    """(body, node state, node message) of each update; a sync as ("sync", node, "")."""
    out = []
    for u in feed:
        assert u is not None
        body = u.WhichOneof("body")
        if body == "node":
            out.append((body, pb.Node.State.Name(u.node.state), u.node.message))
        else:
            out.append((body, u.sync.node if body == "sync" else "", ""))
    return out


async def test_a_heartbeat_after_not_ready_publishes_ready_with_no_message_and_no_sync(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """NOT_READY -> READY on a heartbeat: the node comes back with an empty message, and only
    a node that was LOST or LEFT gets a full sync (this one never lost its stream)."""
    clock = StepClock()
    s = await start_scheduler(certs_dir, clock, heartbeat_interval=0.2, node_lost_after=1.0)
    try:
        t0 = clock.now
        node = await register_node(s, certs_dir, agents, running=("web-1",))
        feed = feed_of(s)
        await clock.step_to(t0 + 0.5)
        assert node.state is NodeState.NOT_READY
        await agents[0].call.write(apb.AgentMessage(heartbeat=apb.Heartbeat()))
        await until(lambda: node.state is NodeState.READY)
        assert node.message == ""
        assert kinds(feed) == [
            ("node", "NOT_READY", "no heartbeat for 0.5s"),
            ("node", "READY", ""),
        ]
    finally:
        await s.stop()


async def test_a_node_that_left_and_went_silent_ends_left_logged_and_without_a_sync(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """Leave, then silence past node_lost_after: LOST (its stream cut), then LEFT when the
    stream ends. Each step is one node update and one "node state" line; no sync is sent
    (there is nothing to reconcile on a node that is gone)."""
    clock = StepClock()
    s = await start_scheduler(certs_dir, clock, heartbeat_interval=0.2, node_lost_after=1.0)
    try:
        t0 = clock.now
        node = await register_node(s, certs_dir, agents)
        feed = feed_of(s)
        with structlog.testing.capture_logs() as logs:
            await agents[0].call.write(apb.AgentMessage(leave=apb.Leave(reason="bye")))
            await until(lambda: node.leaving)
            await clock.step_to(t0 + 1.01)
            await until(lambda: node.state is NodeState.LEFT)
        assert kinds(feed) == [
            ("node", "READY", ""),
            ("node", "LOST", "no heartbeat for 1.0s"),
            ("node", "LEFT", "agent left"),
        ]
        assert node.message == "agent left"
        assert [e for e in logs if e["event"] in ("node state", "agent disconnected")] == [
            {
                "event": "node state",
                "node": "node-1",
                "old": "READY",
                "new": "LOST",
                "log_level": "info",
            },
            {
                "event": "node state",
                "node": "node-1",
                "old": "LOST",
                "new": "LEFT",
                "log_level": "info",
            },
            {"event": "agent disconnected", "node": "node-1", "left": True, "log_level": "info"},
        ]
    finally:
        await s.stop()


async def test_a_dropped_stream_is_logged_and_leaves_the_node_as_it_was(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """An agent whose stream ends without a leave: the node keeps its state and what it
    holds until liveness decides; only its session is gone."""
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register(running=("web-1",))
    node = scheduler.registry.get("node-1")
    assert node is not None
    with structlog.testing.capture_logs() as logs:
        await agents[0].call.done_writing()
        await until(lambda: node.session is None)
    assert [e for e in logs if e["event"] == "agent disconnected"] == [
        {"event": "agent disconnected", "node": "node-1", "left": False, "log_level": "info"}
    ]
    assert (node.state, node.message) == (NodeState.READY, "")
    assert held(node) == ({"web-1": None}, 100, 64 * MIB)


async def test_a_lost_node_back_to_ready_publishes_the_node_then_a_sync(
    certs_dir: Path,
) -> None:
    """Liveness.set_state itself (reached when a heartbeat already read races the stream being cut):
    a LOST node that becomes READY again is published, then synced in full, since the
    controller may have replaced what it runs meanwhile."""
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0"),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    node = s.registry.upsert("node-1")
    node.state = NodeState.LOST
    node.message = "no heartbeat for 9.0s"
    feed = feed_of(s)
    s.liveness.set_state(node, NodeState.READY)
    assert kinds(feed) == [("node", "READY", ""), ("sync", "node-1", "")]
    assert (node.state, node.message) == (NodeState.READY, "")


# ---- placement past nodes that cannot be reserved, and the request itself ----


async def test_a_node_whose_stream_dropped_is_passed_over_for_the_next(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 refuses; node-2's stream ended without a leave (still READY in the ranking
    until liveness decides, but nothing can be reserved there); node-3, ranked last (it
    already runs one of the workload), gets the instance."""
    agents += [
        HandAgent(scheduler, certs_dir, "node-1", answer="busy"),
        HandAgent(scheduler, certs_dir, "node-2"),
        HandAgent(scheduler, certs_dir, "node-3"),
    ]
    await agents[0].register()
    await agents[1].register()
    await agents[2].register(running=("web-old",))
    dropped = scheduler.registry.get("node-2")
    assert dropped is not None
    await agents[1].call.done_writing()
    await until(lambda: dropped.session is None)
    (result,) = await place(scheduler, certs_dir, 1)
    assert result.node == "node-3"
    assert dict(result.refusals) == {"node-1": "refused: busy", "node-2": "not ready"}


async def test_max_per_node_counts_the_instances_of_the_same_workload(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 already runs an instance of "web": with max_per_node 1, web-0 cannot go there."""
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register(running=("web-old",))
    spec = pb.WorkloadSpec()
    spec.CopyFrom(WEB)
    spec.max_per_node = 1
    async with controller_channel(scheduler, certs_dir) as channel:
        req = apb.PlaceRequest(items=[apb.Assignment(instance="web-0", spec=spec)])
        (result,) = (await apb_grpc.SchedulerStub(channel).Place(req)).results
    assert (result.node, reasons_text(result), dict(result.refusals)) == (
        "",
        "1 node: spread: 1 replica already on node",
        {},
    )
    assert agents[0].messages("offer") == []


def fixing(instance: str, *ports: tuple[int, int]) -> apb.Assignment:
    """An assignment of "web" whose instance fixes these (host port, protocol) on its node."""
    spec = pb.WorkloadSpec()
    spec.CopyFrom(WEB)
    spec.ports.extend(
        pb.PortSpec(name=f"p{i}", host_port=port, protocol=protocol)
        for i, (port, protocol) in enumerate(ports)
    )
    return apb.Assignment(instance=instance, spec=spec)


async def test_fixed_host_ports_of_assignments_and_of_reports_are_taken_once_per_node(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 re-announces an instance that bound 53/udp; 53/tcp is another port (protocol
    left out means tcp), and a batch's reservations count as they are made."""
    agents += [
        HandAgent(scheduler, certs_dir, "node-1"),
        HandAgent(scheduler, certs_dir, "node-2"),
    ]
    dns = pb.PortBinding(name="dns", port=53, host_port=53, protocol=pb.PortSpec.UDP)
    await agents[0].register(running=("dns-old",), ports=(dns,))
    await agents[1].register()
    udp, tcp, unset = pb.PortSpec.UDP, pb.PortSpec.TCP, pb.PortSpec.PROTOCOL_UNSPECIFIED
    items = [
        fixing("dns-0", (53, udp)),
        fixing("dns-1", (53, udp), (8080, tcp)),
        fixing("tcp-0", (53, unset)),
        fixing("tcp-1", (53, tcp)),
        fixing("tcp-2", (53, tcp)),
        fixing("any-0", (0, udp)),  # host_port 0: the agent picks, nothing to reserve
    ]
    async with controller_channel(scheduler, certs_dir) as channel:
        req = apb.PlaceRequest(items=items)
        results = (await apb_grpc.SchedulerStub(channel).Place(req)).results
    got = {r.instance: (r.node, reasons_text(r)) for r in results}
    assert got["dns-0"] == ("node-2", "")
    assert got["dns-1"] == ("", "2 nodes: host port 53/udp in use")
    assert {got["tcp-0"][0], got["tcp-1"][0]} == {"node-1", "node-2"}
    assert got["tcp-2"] == ("", "2 nodes: host port 53 in use")
    assert got["any-0"][0] in ("node-1", "node-2")
    node1 = scheduler.registry.get("node-1")
    assert node1 is not None
    assert node1.host_ports >= {(53, PortProtocol.UDP), (53, PortProtocol.TCP)}


@pytest.mark.parametrize(
    ("port", "protocol", "field", "value"),
    [
        (70000, pb.PortSpec.TCP, "host_port", 70000),
        (-1, pb.PortSpec.TCP, "host_port", -1),
        (80, 9, "protocol", 9),
    ],
)
async def test_an_assignment_with_a_host_port_no_controller_sends_is_refused_by_name(
    scheduler: Scheduler, certs_dir: Path, port: int, protocol: int, field: str, value: int
) -> None:
    async with controller_channel(scheduler, certs_dir) as channel:
        req = apb.PlaceRequest(items=[fixing("web-0", (80, pb.PortSpec.TCP), (port, protocol))])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await apb_grpc.SchedulerStub(channel).Place(req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"assignment web-0: spec.ports[1].{field}: {value} is not a port the controller accepts"
    )


async def test_an_assignment_without_a_kind_is_refused_by_name(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    spec = pb.WorkloadSpec()
    spec.CopyFrom(WEB)
    spec.ClearField("kind")
    async with controller_channel(scheduler, certs_dir) as channel:
        req = apb.PlaceRequest(items=[apb.Assignment(instance="web-0", spec=spec)])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await apb_grpc.SchedulerStub(channel).Place(req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(r"^assignment web-0: spec\.kind is required$", info.value.details() or "")


async def test_the_node_selector_of_the_assignment_picks_the_node(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 ranks first by name; only node-2 has the label the assignment selects."""
    agents += [
        HandAgent(scheduler, certs_dir, "node-1"),
        HandAgent(scheduler, certs_dir, "node-2"),
    ]
    await agents[0].register()
    await agents[1].register({"disk": "ssd"})
    spec = pb.WorkloadSpec()
    spec.CopyFrom(WEB)
    spec.node_selector["disk"] = "ssd"
    async with controller_channel(scheduler, certs_dir) as channel:
        req = apb.PlaceRequest(items=[apb.Assignment(instance="web-0", spec=spec)])
        (result,) = (await apb_grpc.SchedulerStub(channel).Place(req)).results
    assert (result.node, dict(result.refusals)) == ("node-2", {})


async def test_volumes_pin_an_instance_to_their_node_or_to_a_node_that_can_create_them(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 (pool fast, ext4, 1 GiB) ranks first by name; node-2 (pool slow, ext4 and qcow2,
    4 GiB) is where bound volumes live or big and qcow2 ones fit."""
    agents += [
        HandAgent(scheduler, certs_dir, "node-1"),
        HandAgent(scheduler, certs_dir, "node-2"),
        HandAgent(scheduler, certs_dir, "node-3"),
    ]
    await agents[0].register(pool="fast", volume_backends=["ext4"], volume_capacity_bytes=1 << 30)
    await agents[1].register(
        pool="slow", volume_backends=["ext4", "qcow2"], volume_capacity_bytes=4 << 30
    )
    # An agent of an older version: no pool announced (default), no volume backends.
    await agents[2].register()

    def item(name: str, *volumes: apb.VolumeAttachment) -> apb.Assignment:
        return apb.Assignment(instance=name, spec=WEB, volumes=volumes)

    def ext4(name: str = "data-1", size: int = 64 * MIB, **kw: Any) -> apb.VolumeAttachment:
        return apb.VolumeAttachment(name=name, size_bytes=size, backend="ext4", **kw)

    items = [
        item("bound", ext4(node="node-2")),
        item("any", ext4()),
        item("slow", ext4(pool="slow")),
        item("big", ext4(size=2 << 30)),
        item("vm", apb.VolumeAttachment(name="disk", size_bytes=MIB, backend="qcow2")),
        item("nowhere", ext4(pool="gpu")),
        item("split", ext4(node="node-1"), ext4("logs", node="node-2")),
        item("plain"),
    ]
    async with controller_channel(scheduler, certs_dir) as channel:
        req = apb.PlaceRequest(items=items)
        results = (await apb_grpc.SchedulerStub(channel).Place(req)).results
    got = {r.instance: r.node or reasons_text(r) for r in results}
    assert got == {
        "bound": "node-2",
        "any": "node-1",
        "slow": "node-2",
        "big": "node-2",
        "vm": "node-2",
        "nowhere": "3 nodes: volume data-1 needs pool gpu",
        "split": "2 nodes: volume data-1 lives on node-1; 1 node: volume logs lives on node-2",
        # Without volumes, a node with no volume backends is as good as any: the emptiest.
        "plain": "node-3",
    }
    nowhere = next(r for r in results if r.instance == "nowhere")
    assert all(not c.resolvable for c in reasons_from_pb(nowhere))


async def test_a_node_announcing_an_unknown_volume_backend_is_refused_by_name(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        first = await agents[0].register(volume_backends=["zfs"])
        if first is not grpc.aio.EOF:
            await agents[0].call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "node.volume_backends[0]: 'zfs' is not one of ext4, qcow2" in (
        info.value.details() or ""
    )
    assert scheduler.registry.get("node-1") is None


async def test_an_instance_placed_in_the_first_round_names_the_nodes_passed_over(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 ranks first but its stream dropped: the first round reserves on node-2, which
    accepts, and the result still says why node-1 was not used."""
    agents += [
        HandAgent(scheduler, certs_dir, "node-1"),
        HandAgent(scheduler, certs_dir, "node-2"),
    ]
    for a in agents:
        await a.register()
    dropped = scheduler.registry.get("node-1")
    assert dropped is not None
    await agents[0].call.done_writing()
    await until(lambda: dropped.session is None)
    (result,) = await place(scheduler, certs_dir, 1)
    assert (result.node, reasons_text(result), dict(result.refusals)) == (
        "node-2",
        "",
        {"node-1": "not ready"},
    )
    assert len(agents[1].messages("offer")) == 1


async def test_a_node_that_left_registers_again_ready_undrained_and_synced(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """After a leave, the same node registering again is READY, no longer leaving, told the
    heartbeat interval, logged with the state it had, and published then synced in full."""
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register()
    node = scheduler.registry.get("node-1")
    assert node is not None
    await agents[0].call.write(apb.AgentMessage(leave=apb.Leave(reason="bye")))
    await until(lambda: node.leaving)
    await agents[0].call.done_writing()
    await until(lambda: node.state is NodeState.LEFT)
    feed = feed_of(scheduler)
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    with structlog.testing.capture_logs() as logs:
        await agents[1].register(running=("web-1",))
    assert agents[1].registered is not None
    assert (agents[1].registered.node, agents[1].registered.heartbeat_interval) == ("node-1", 5.0)
    assert (node.state, node.message, node.leaving, node.draining) == (
        NodeState.READY,
        "",
        False,
        False,
    )
    assert [e for e in logs if e["event"] == "agent registered"] == [
        {
            "event": "agent registered",
            "node": "node-1",
            "instances": 1,
            "was": "LEFT",
            "log_level": "info",
        }
    ]
    assert kinds(feed) == [("node", "READY", ""), ("sync", "node-1", "")]
    (sync,) = [u for u in feed if u is not None and u.WhichOneof("body") == "sync"]
    assert [i.name for i in sync.sync.instances] == ["web-1"]


# ---- liveness at its exact bounds ----


async def test_liveness_bounds_are_strict_and_usage_goes_out_on_the_interval(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """Times chosen exact in binary (heartbeat 0.25 s, lost after 1.0 s, usage every 0.5 s,
    the clock at 1024 s): silent for exactly two intervals is still READY, exactly
    node_lost_after still NOT_READY; the usage report goes out when exactly its interval has
    passed, and only for READY and NOT_READY nodes. A LOST node does not stop the checks of
    the nodes after it."""
    clock = StepClock()
    t0 = clock.now = 1024.0
    s = await start_scheduler(
        certs_dir,
        clock,
        heartbeat_interval=0.25,
        node_lost_after=1.0,
        usage_report_interval=0.5,
    )
    try:
        node = await register_node(s, certs_dir, agents)
        feed = feed_of(s)
        await clock.step_to(t0 + 0.5)
        assert node.state is NodeState.READY
        await clock.step_to(t0 + 0.75)
        assert node.state is NodeState.NOT_READY
        await clock.step_to(t0 + 1.0)
        assert node.state is NodeState.NOT_READY
        await clock.step_to(t0 + 1.25)
        assert node.state is NodeState.LOST
        # node-2 registers after node-1, so it comes after it in the liveness pass.
        agents.append(HandAgent(s, certs_dir, "node-2"))
        await agents[1].register()
        other = s.registry.get("node-2")
        assert other is not None
        await clock.step_to(t0 + 1.5)
        await clock.step_to(t0 + 2.0)
        assert other.state is NodeState.NOT_READY
        assert [k for u, k in zip(feed, kinds(feed), strict=True) if u.node.name == "node-1"] == [
            ("node", "READY", ""),  # usage at t0 + 0.5
            ("node", "NOT_READY", "no heartbeat for 0.8s"),
            ("node", "NOT_READY", "no heartbeat for 0.8s"),  # usage at t0 + 1.0
            ("node", "LOST", "no heartbeat for 1.2s"),
            # none at t0 + 1.5 or t0 + 2.0: a LOST node's usage is not reported
        ]
    finally:
        await s.stop()


async def test_liveness_looks_four_times_per_heartbeat_at_most_every_quarter_second(
    certs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How late liveness may notice a silent node or an expired reservation: it wakes every
    heartbeat_interval / 4, and at least every 0.25 s."""
    sleeps: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay: float, *args: object) -> object:
        task = asyncio.current_task()
        if task is not None and task.get_name() == "liveness":
            sleeps.append(delay)
        return await sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    for interval, tick in ((0.2, 0.05), (5.0, 0.25)):
        sleeps.clear()
        s = await start_scheduler(certs_dir, heartbeat_interval=interval, node_lost_after=60.0)
        try:
            await until(lambda: len(sleeps) >= 2)
        finally:
            await s.stop()
        assert set(sleeps) == {tick}


async def test_a_reservation_expiring_on_a_node_whose_stream_dropped_is_just_dropped(
    certs_dir: Path, agents: list[HandAgent]
) -> None:
    """node-1 accepted an offer, then its stream dropped: when the reservation expires there
    is no one to tell, and liveness goes on (node-2's expired reservation is released)."""
    s = await start_scheduler(certs_dir, **QUIET, hold_seconds=0.3)
    try:
        agents.append(HandAgent(s, certs_dir, "node-1"))
        await agents[0].register()
        (first,) = await place(s, certs_dir, 1)
        assert first.node == "node-1"
        node = s.registry.get("node-1")
        assert node is not None
        await agents[0].call.done_writing()
        await until(lambda: node.session is None)
        await until(lambda: not node.holds)
        agents.append(HandAgent(s, certs_dir, "node-2"))
        await agents[1].register()
        (second,) = await place(s, certs_dir, 1)
        assert second.node == "node-2"
        await until(lambda: agents[1].messages("release"))
        assert [m.release.instance for m in agents[1].messages("release")] == ["web-0"]
        assert agents[0].messages("release") == []
    finally:
        await s.stop()


async def test_a_draining_node_whose_agent_restarts_is_still_draining(
    scheduler: Scheduler, certs_dir: Path, agents: list[HandAgent]
) -> None:
    """Only a node that had left comes back undrained: an operator's drain outlives an agent
    restart (a new stream of the same node)."""
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[0].register()
    async with controller_channel(scheduler, certs_dir) as channel:
        await apb_grpc.SchedulerStub(channel).SetNode(
            apb.SetNodeRequest(name="node-1", draining=True)
        )
    node = scheduler.registry.get("node-1")
    assert node is not None and node.draining
    agents.append(HandAgent(scheduler, certs_dir, "node-1"))
    await agents[1].register()
    assert (node.state, node.draining) == (NodeState.READY, True)
