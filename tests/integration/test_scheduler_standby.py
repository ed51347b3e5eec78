"""Two schedulers on one etcd (in process, real grpc.aio servers): a lost lease hands over.

The active scheduler whose lease is lost closes the agent's stream and the controller's feed
with NOT_LEADER at once, and stands by (refusing Place, health NOT_SERVING); the other takes
over. When the first is elected again, its term starts from an empty registry: nothing of the
nodes it knew in its last term is judged (or reported LOST) by the new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orka.agent.service import Agent, AgentConfig
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.errors import NotFound, NotLeader, from_rpc_error
from orka.rpc.client import secure_channel
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from tests.etcd import EtcdCluster, needs_etcd
from tests.integration.cluster import eventually

pytestmark = needs_etcd


def scheduler(certs: Path, tmp: Path, store_url: str, name: str, ttl: int = 2) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            listen="127.0.0.1:0",
            heartbeat_interval=0.2,
            node_lost_after=1.0,
            store_url=store_url,
            data_dir=tmp / name,
            election_ttl=ttl,
        ),
        TlsFiles.for_service(certs, "scheduler", "scheduler"),
    )


@pytest.fixture
def ttl() -> int:
    """The schedulers' election TTL (a test overrides it by parametrizing `ttl`)."""
    return 2


@pytest.fixture
async def pair(
    certs_dir: Path, tmp_path: Path, etcd: EtcdCluster, etcd_prefix: str, ttl: int
) -> AsyncIterator[tuple[Scheduler, Scheduler]]:
    url = etcd.url + etcd_prefix
    a = scheduler(certs_dir, tmp_path, url, "a", ttl)
    await a.start()
    await eventually(lambda: _active(a), timeout=10)
    b = scheduler(certs_dir, tmp_path, url, "b", ttl)
    await b.start()
    try:
        yield a, b
    finally:
        await b.stop()
        await a.stop()


async def _active(s: Scheduler) -> bool:
    return s.leadership is not None and s.leadership.is_leader


def addr(s: Scheduler) -> str:
    return f"127.0.0.1:{s.port}"


def channel(certs: Path, s: Scheduler, role: str, name: str) -> grpc.aio.Channel:
    return secure_channel(addr(s), TlsFiles.for_service(certs, role, name), "scheduler")


async def health(certs: Path, s: Scheduler) -> int:
    async with channel(certs, s, "controller", "controller") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="orka.v1.Scheduler"), timeout=5
        )
        return int(reply.status)


async def refused(call: object) -> NotLeader:
    """The NOT_LEADER an awaited call or a stream read ends with."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    err = from_rpc_error(caught.value)
    assert isinstance(err, NotLeader), f"{caught.value.code()}: {caught.value.details()}"
    return err


async def test_a_lost_lease_closes_streams_with_not_leader_and_hands_over(
    pair: tuple[Scheduler, Scheduler], certs_dir: Path
) -> None:
    a, b = pair
    SERVING, NOT_SERVING = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert await health(certs_dir, a) == SERVING
    assert await health(certs_dir, b) == NOT_SERVING

    async with (
        channel(certs_dir, a, "agent", "node-1") as agent_ch,
        channel(certs_dir, a, "controller", "controller") as ctl_ch,
        channel(certs_dir, b, "controller", "controller") as ctl_b,
    ):
        # The standby refuses the controller's calls, naming the active one.
        assert (await refused(apb_grpc.SchedulerStub(ctl_b).Place(apb.PlaceRequest()))).leader == (
            addr(a)
        )
        feed_b = apb_grpc.SchedulerStub(ctl_b).Watch(apb.WatchClusterRequest())
        assert (await refused(feed_b.read())).leader == addr(a)

        # An agent's registration is refused with NOT_LEADER, never with a transport error
        # (which would not say where to go), even many at once.
        async with channel(certs_dir, b, "agent", "node-2") as agent_b:
            refusals = await asyncio.gather(
                *(register_refused(agent_b) for _ in range(30)), return_exceptions=True
            )
        assert [r for r in refusals if not isinstance(r, NotLeader)] == []
        assert {r.leader for r in refusals if isinstance(r, NotLeader)} == {addr(a)}

        agent = apb_grpc.SchedulerStub(agent_ch).Connect()
        await agent.write(apb.AgentMessage(register=apb.Register(node=apb.NodeInfo())))
        first = await agent.read()
        assert first.WhichOneof("body") == "registered"
        feed = apb_grpc.SchedulerStub(ctl_ch).Watch(apb.WatchClusterRequest())
        snapshot = await feed.read()
        assert [u.node.name for u in snapshot.updates if u.WhichOneof("body") == "node"] == [
            "node-1"
        ]

        # A's lease goes (as when it cannot reach etcd): both streams end with NOT_LEADER.
        assert a.store is not None and a.election is not None
        await a.store.revoke_lease(a.election.lease_id)

        async def agent_refused() -> NotLeader:
            while True:
                msg = await agent.read()
                assert msg is not grpc.aio.EOF, "the agent stream ended without NOT_LEADER"

        await refused(asyncio.wait_for(agent_refused(), 5))

        async def feed_refused() -> None:
            while True:
                msg = await feed.read()
                assert msg is not grpc.aio.EOF, "the feed ended without NOT_LEADER"

        await refused(asyncio.wait_for(feed_refused(), 5))

        await eventually(lambda: _active(b), timeout=15)
        assert await health(certs_dir, b) == SERVING
        assert await health(certs_dir, a) == NOT_SERVING
        # A stands by, and names B once B's term is recorded.
        refusal = await eventually(
            lambda: _refusal_naming(ctl_ch, addr(b)), timeout=10, interval=0.2
        )
        assert refusal.leader == addr(b)

    # B gives up; A leads again, from nothing: node-1 from its last term is not in its picture,
    # so its liveness never declares it NOT_READY or LOST.
    await b.stop()
    await eventually(lambda: _active(a), timeout=15)
    assert [n.name for n in a.registry] == []


async def register_refused(ch: grpc.aio.Channel) -> NotLeader:
    """An agent's Connect as the agent makes it (register, then read): the error it ends with."""
    call = apb_grpc.SchedulerStub(ch).Connect(timeout=10)
    try:
        # A busy agent writes late: by then a standby that refused at once has ended the
        # stream, and the write fails with INTERNAL instead of the NOT_LEADER.
        await asyncio.sleep(0.2)
        await call.write(apb.AgentMessage(register=apb.Register(node=apb.NodeInfo())))
        await call.read()
    except grpc.aio.AioRpcError as err:
        found = from_rpc_error(err)
        if isinstance(found, NotLeader):
            return found
        raise AssertionError(f"{err.code()}: {err.details()}") from None
    raise AssertionError("the standby accepted a registration")


async def _refusal_naming(ch: grpc.aio.Channel, leader: str) -> NotLeader | None:
    try:
        await apb_grpc.SchedulerStub(ch).Place(apb.PlaceRequest(), timeout=5)
    except grpc.aio.AioRpcError as err:
        found = from_rpc_error(err)
        if isinstance(found, NotLeader) and found.leader == leader:
            return found
    return None


def fake_agent(certs: Path, tmp: Path, *schedulers: Scheduler) -> Agent:
    """Agent node-2 (the fake runtime) given the addresses of `schedulers`, not started."""
    return Agent(
        AgentConfig(
            name="node-2",
            schedulers=[addr(s) for s in schedulers],
            data_dir=tmp / "node-2",
            runtimes=["fake"],
        ),
        TlsFiles.for_service(certs, "agent", "node-2"),
    )


def _connections_to(port: int, status: str | None = None) -> set[int]:
    """Local ports of this host's TCP connections to `port` on loopback, in any state unless
    `status` names one (a closed one lingers in TIME_WAIT on the side that closed it: the
    agent's). gRPC dials over IPv6 sockets, IPv4 addresses mapped."""
    return {
        c.laddr.port
        for c in psutil.net_connections(kind="tcp")
        if c.raddr
        and c.raddr.port == port
        and c.raddr.ip in ("127.0.0.1", "::ffff:127.0.0.1")
        and (status is None or c.status == status)
    }


async def test_an_agent_asks_a_standby_again_on_one_connection(
    pair: tuple[Scheduler, Scheduler], certs_dir: Path, tmp_path: Path
) -> None:
    # An agent that knows only the standby: each ask is refused with NOT_LEADER (the active
    # one it names is not in the agent's list), and it asks again after a short pause; every
    # ask goes over the same connection, so a standby asked by many agents during a failover
    # does not pay a TLS handshake per ask.
    _, b = pair
    before = _connections_to(b.port)
    agent = fake_agent(certs_dir, tmp_path, b)
    with structlog.testing.capture_logs() as logs:
        try:
            await agent.start()

            def refusals() -> list[str]:
                return [
                    e["target"]
                    for e in logs
                    if e["event"] == "scheduler stream ended"
                    and e.get("error_reason") == "NOT_LEADER"
                ]

            await eventually(lambda: asyncio.sleep(0, len(refusals()) >= 4), timeout=15)
            assert set(refusals()) == {addr(b)}
            assert len(_connections_to(b.port) - before) == 1
        finally:
            await agent.stop()


async def test_a_standby_holds_an_agent_whose_active_one_is_gone_until_it_takes_over(
    pair: tuple[Scheduler, Scheduler], certs_dir: Path, tmp_path: Path
) -> None:
    # The active one stops answering but keeps its lease, and its address still accepts
    # connections (a wedged process: nothing proves it dead). The agent finds it gone and
    # tells the standby so when it registers there; the standby holds the stream instead of
    # naming the dead one again and again, and the moment it takes over it asks the agent to
    # register again on that same stream, which it does at once: no refusal at all.
    a, b = pair
    agent = fake_agent(certs_dir, tmp_path, a, b)
    silent: asyncio.Server | None = None
    with structlog.testing.capture_logs() as logs:
        try:
            await agent.start()
            await asyncio.wait_for(agent.connected.wait(), 10)
            assert a._server is not None
            await a._server.stop(None)  # gone, its lease still held
            silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", a.port)
            await eventually(lambda: asyncio.sleep(0, b.held == 1), timeout=10)
            assert not agent.connected.is_set()
            assert b.takeover is not None
            # The standby checked the address and found it listening: no eviction.
            await eventually(lambda: asyncio.sleep(0, addr(a) in b.takeover.found_alive), 10)

            assert a.store is not None and a.election is not None
            await a.store.revoke_lease(a.election.lease_id)
            await eventually(lambda: _active(b), timeout=15)
            await asyncio.wait_for(agent.connected.wait(), 10)
            assert b.held == 0
            assert [n.name for n in b.registry] == ["node-2"]
            ended = [
                e["target"]
                for e in logs
                if e["event"] in ("scheduler stream ended", "scheduler stream failed")
            ]
            # The stream to the dead one, then none: never the dead one's address over and
            # over while the standby waited, nor a refused stream once it led.
            assert ended == [addr(a)]
            registered = [e["scheduler"] for e in logs if e["event"] == "registered"]
            assert registered == [addr(a), addr(b)]
            assert b.takeover.evicted == []  # an address that accepts is no proof of death
        finally:
            await agent.stop()
            if silent is not None:
                silent.close()


async def test_a_held_agent_registers_again_on_its_stream_with_what_it_holds_then(
    pair: tuple[Scheduler, Scheduler], certs_dir: Path
) -> None:
    # Held while the active one was gone, the stream is asked for a new registration once the
    # standby leads, and that one, not the first, is what the node is known by. An agent that
    # does not say it answers RegisterAgain (an older one) is sent away to register again.
    a, b = pair
    async with (
        channel(certs_dir, b, "agent", "node-2") as new_ch,
        channel(certs_dir, b, "agent", "node-3") as old_ch,
    ):
        held = apb_grpc.SchedulerStub(new_ch).Connect()
        await held.write(_register({"v": "first"}, [addr(a)], again=True))
        older = apb_grpc.SchedulerStub(old_ch).Connect()
        await older.write(_register({"v": "first"}, [addr(a)], again=False))
        await eventually(lambda: asyncio.sleep(0, b.held == 2), timeout=10)

        assert a.store is not None and a.election is not None
        await a.store.revoke_lease(a.election.lease_id)
        asked = await asyncio.wait_for(held.read(), 15)
        assert asked.WhichOneof("body") == "register_again"
        assert list(b.registry) == []  # nothing taken from the stale registration
        await held.write(_register({"v": "second"}, [addr(a)], again=True))
        reply = await asyncio.wait_for(held.read(), 10)
        assert reply.WhichOneof("body") == "registered" and reply.registered.node == "node-2"
        node = b.registry.get("node-2")
        assert node is not None and node.labels["v"] == "second"

        refusal = await refused(asyncio.wait_for(older.read(), 10))
        assert refusal.leader == addr(b) and "register again" in refusal.message
        assert [n.name for n in b.registry] == ["node-2"]
        held.cancel()


def _register(labels: dict[str, str], unreachable: list[str], again: bool) -> apb.AgentMessage:
    return apb.AgentMessage(
        register=apb.Register(
            node=apb.NodeInfo(labels=labels), unreachable=unreachable, registers_again=again
        )
    )


@pytest.mark.parametrize("ttl", [30])
async def test_a_standby_ends_the_term_of_an_active_one_whose_address_refuses(
    pair: tuple[Scheduler, Scheduler], certs_dir: Path, tmp_path: Path
) -> None:
    # As when the active scheduler is SIGKILLed: its port refuses, its 30 s lease lives on.
    # The agent tells the standby it cannot reach the active one; the standby finds the port
    # refusing too, ends that term in the store (key deleted, lease revoked) and takes over
    # long before the lease would have run out.
    a, b = pair
    agent = fake_agent(certs_dir, tmp_path, a, b)
    try:
        await agent.start()
        await asyncio.wait_for(agent.connected.wait(), 10)
        assert a._server is not None and a.election is not None and a.store is not None
        lease = a.election.lease_id
        assert lease is not None
        await a._server.stop(None)
        await eventually(lambda: _active(b), timeout=10)
        assert b.takeover is not None and b.takeover.evicted == [addr(a)]
        with pytest.raises(NotFound):
            await a.store.keepalive_lease(lease)
        await asyncio.wait_for(agent.connected.wait(), 10)
        assert [n.name for n in b.registry] == ["node-2"]
    finally:
        await agent.stop()


@pytest.mark.parametrize("ttl", [30])
async def test_an_agent_is_connected_to_the_standby_before_it_fails_over_to_it(
    pair: tuple[Scheduler, Scheduler],
    certs_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Registered at the active scheduler, the agent also holds a connection to the standby
    # (no stream on it); the failover registers over that same connection, so the standby
    # pays no TLS handshake while it takes over. Same local port before and after: the
    # same TCP connection. Only established ones count: a first dial that failed (and was
    # tried again after the short backoff set here) may linger in TIME_WAIT.
    monkeypatch.setattr("orka.agent.stream.WARM_EVERY", 0.05)
    monkeypatch.setattr("orka.agent.stream.WARM_BACKOFF", 0.2)
    a, b = pair
    agent = fake_agent(certs_dir, tmp_path, a, b)
    up = psutil.CONN_ESTABLISHED
    try:
        await agent.start()
        await asyncio.wait_for(agent.connected.wait(), 10)
        await eventually(lambda: asyncio.sleep(0, len(_connections_to(b.port, up)) == 1), 10)
        warm = _connections_to(b.port, up)
        assert [n.name for n in a.registry] == ["node-2"]
        assert list(b.registry) == [] and b.held == 0  # connected, never asked

        assert a._server is not None
        await a._server.stop(None)  # refuses from now on: the standby takes over
        await eventually(lambda: _active(b), timeout=10)
        await eventually(lambda: asyncio.sleep(0, [n.name for n in b.registry] == ["node-2"]), 10)
        await asyncio.wait_for(agent.connected.wait(), 10)
        assert _connections_to(b.port, up) == warm
    finally:
        await agent.stop()
