"""Revocation and rotation on real grpc.aio servers (port 0, mutual TLS), no restart anywhere."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from orka.agent.service import Agent, AgentConfig
from orka.api import agent_pb2_grpc as apb_grpc
from orka.errors import OrkaError
from orka.rpc.server import start_server
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.identity import peer_identity
from orka.security.issue import init_certs
from orka.security.revoke import revoke, serial_of
from orka.security.rotate import rotate
from orka.security.tls import TlsFiles, channel_credentials
from tests.integration.cluster import eventually
from tests.integration.test_scheduler_input import register

INTERVAL = 0.3
# Scheduling noise on a shared 2-core machine; the bound checked is INTERVAL + SLACK.
SLACK = 1.0
WHO = "/orka.test.Probe/Who"


async def _who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    try:
        ident = peer_identity(context)
    except OrkaError as err:  # what orka.rpc.server's boundary does for the real services
        await context.abort(err.code, err.message)
    # The client's address names the TCP connection: the same after a rotation means the
    # connection was kept, not re-made.
    return f"{ident.role}/{ident.name} {context.peer()}".encode()


def _probe(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "orka.test.Probe", {"Who": grpc.unary_unary_rpc_method_handler(_who)}
            )
        ]
    )


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    init_certs(d, ["node-1", "node-2"])
    return d


def files(certs: Path, role: str, name: str) -> TlsFiles:
    return dataclasses.replace(TlsFiles.for_service(certs, role, name), reload_interval=INTERVAL)


@pytest.fixture
async def server(certs: Path) -> AsyncIterator[str]:
    # The real start-up path: start_server -> tls.server_credentials (rotating, CRL watched).
    srv, port, _ = await start_server(
        "127.0.0.1:0", files(certs, "controller", "controller"), [_probe], ["orka.test.Probe"]
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


async def who(channel: grpc.aio.Channel) -> str:
    reply = await channel.unary_unary(WHO)(b"", timeout=5)
    return reply.decode()


def channel(target: str, certs: Path, role: str, name: str) -> grpc.aio.Channel:
    # Plain grpc (the server verified by its 127.0.0.1 SAN): this file is about the server side.
    return grpc.aio.secure_channel(target, channel_credentials(files(certs, role, name)))


async def test_a_revoked_admin_is_refused_within_one_reload_interval(
    server: str, certs: Path
) -> None:
    old = channel(server, certs, "admin", "admin")
    async with old:
        assert (await who(old)).startswith("admin/admin ")
        revoke(certs, [serial_of(certs, "admin", "admin")])
        revoked_at = time.monotonic()

        async def refused() -> grpc.aio.AioRpcError | None:
            async with channel(server, certs, "admin", "admin") as fresh:
                try:
                    await who(fresh)
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                        return err
                    raise
            return None

        err = await eventually(refused, timeout=INTERVAL + SLACK, interval=0.02)
        took = time.monotonic() - revoked_at
        assert err.details() == "certificate revoked"
        assert took <= INTERVAL + SLACK, took
        # The connection made before the revocation is refused as well, per call.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await who(old)
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "certificate revoked",
        )
    # Everyone else is still served.
    async with channel(server, certs, "agent", "node-1") as agent:
        assert (await who(agent)).startswith("agent/node-1 ")
    print(f"admin refused {took:.2f}s after the CRL was written (interval {INTERVAL}s)")


async def test_a_revoked_agents_stream_is_cut(certs: Path) -> None:
    scheduler = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0", register_timeout=2.0),
        files(certs, "scheduler", "scheduler"),
    )
    await scheduler.start()
    try:
        target = f"127.0.0.1:{scheduler.port}"
        ch = channel(target, certs, "agent", "node-1")
        async with ch:
            call = apb_grpc.SchedulerStub(ch).Connect()
            await call.write(register())
            first = await asyncio.wait_for(call.read(), 5)
            assert first.HasField("registered"), first
            with capture_logs() as entries:
                revoke(certs, [serial_of(certs, "agent", "node-1")])
                revoked_at = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async with asyncio.timeout(INTERVAL + SLACK):
                        while (msg := await call.read()) is not grpc.aio.EOF:
                            assert not msg.HasField("registered"), msg
                        await call.code()

                async def ended() -> bool:
                    return any(e["event"] == "agent disconnected" for e in entries)

                # The reader logs before the session's end is recorded.
                await eventually(ended, timeout=5, interval=0.02)
            # One warning line, no traceback: the cut is expected, not a failure.
            said = [
                {k: v for k, v in e.items() if k != "timestamp"}
                for e in entries
                if e["event"].startswith("agent") and e["event"] != "agent disconnected"
            ]
            assert said == [
                {
                    "event": "agent certificate revoked; stream ended",
                    "log_level": "warning",
                    "node": "node-1",
                }
            ]
            took = time.monotonic() - revoked_at
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "certificate revoked",
            ), info.value
        # And it cannot come back: a new stream is refused at once.
        ch = channel(target, certs, "agent", "node-1")
        async with ch:
            call = apb_grpc.SchedulerStub(ch).Connect()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                # The refusal may come before the write completes: either raises it.
                await call.write(register())
                await asyncio.wait_for(call.read(), 5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details() == "certificate revoked"
        print(f"agent stream cut {took:.2f}s after the CRL was written ({info.value.code()})")
    finally:
        await scheduler.stop()


def served_serial(target: str, certs: Path) -> int:
    """A fresh TLS handshake with Python's ssl module: the serial the server presents now."""
    host, port = target.rsplit(":", 1)
    admin = TlsFiles.for_service(certs, "admin", "admin")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(admin.ca))
    ctx.load_cert_chain(str(admin.cert), str(admin.key))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_a_rotated_server_keeps_its_connections_and_serves_the_new_serial(
    server: str, certs: Path
) -> None:
    before = serial_of(certs, "controller", "controller")
    assert await asyncio.to_thread(served_serial, server, certs) == before
    old = channel(server, certs, "admin", "admin")
    async with old:
        first = await who(old)
        written = rotate(certs, role="controller", name="controller")
        assert [p.name for p in written] == ["controller.crt", "controller.key"]
        after = serial_of(certs, "controller", "controller")
        assert after != before
        # The next handshake presents the re-issued certificate...
        assert await asyncio.to_thread(served_serial, server, certs) == after
        # ...and the connection made before the rotation is still the one answering.
        assert await who(old) == first
        # A client that connects now verifies the new certificate and is served.
        async with channel(server, certs, "admin", "admin") as fresh:
            assert (await who(fresh)).startswith("admin/admin ")


async def test_an_agent_moves_to_its_rotated_key_when_the_old_one_is_revoked(
    certs: Path, tmp_path: Path
) -> None:
    """Key compromise, answered without restarting anything: re-issue the node's key, revoke
    the old one; the old stream is cut and the agent reconnects with the files now on disk."""
    scheduler = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0"), files(certs, "scheduler", "scheduler")
    )
    await scheduler.start()
    agent = Agent(
        AgentConfig(
            name="node-1",
            schedulers=[f"127.0.0.1:{scheduler.port}"],
            data_dir=tmp_path / "agent",
            runtimes=["fake"],
        ),
        files(certs, "agent", "node-1"),
    )
    try:
        await agent.start()
        await asyncio.wait_for(agent.connected.wait(), 10)
        old = serial_of(certs, "agent", "node-1")
        rotate(certs, role="agent", name="node-1")
        assert serial_of(certs, "agent", "node-1") != old
        # A rotated client keeps its session: nothing on the wire changes until it reconnects.
        # (A wait for something that must not happen: two reload intervals.)
        await asyncio.sleep(2 * INTERVAL)
        assert agent.connected.is_set()

        revoke(certs, [old])
        revoked_at = time.monotonic()

        async def cut() -> bool:
            return not agent.connected.is_set()

        await eventually(cut, timeout=INTERVAL + SLACK, interval=0.01)
        await asyncio.wait_for(agent.connected.wait(), 10)  # only the new key can get in
        node = scheduler.registry.get("node-1")
        assert node is not None
        print(f"node-1 back on its new key {time.monotonic() - revoked_at:.2f}s after the CRL")
    finally:
        await agent.stop()
        await scheduler.stop()


async def test_a_server_stops_serving_when_its_own_certificate_is_revoked(
    server: str, certs: Path
) -> None:
    """The operator revoked the controller's certificate and forgot to re-issue it: the
    server stops presenting it (clients cannot check a CRL themselves: own_cert.py)."""
    async with channel(server, certs, "admin", "admin") as admin:
        assert (await who(admin)).startswith("admin/admin ")
        with capture_logs() as entries:
            revoke(certs, [serial_of(certs, "controller", "controller")])

            async def stopped() -> grpc.aio.AioRpcError | None:
                async with channel(server, certs, "admin", "admin") as fresh:
                    try:
                        await who(fresh)
                    except grpc.aio.AioRpcError as err:
                        # A call the stopping server was still serving ends CANCELLED; the
                        # next one finds no server.
                        return None if err.code() == grpc.StatusCode.CANCELLED else err
                return None

            err = await eventually(stopped, timeout=INTERVAL + SLACK, interval=0.02)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        said = [e for e in entries if e["event"].startswith("this server's own certificate")]
        assert [(e["log_level"], e["event"], e["fix"]) for e in said] == [
            (
                "error",
                "this server's own certificate is revoked; stopping the server",
                "orka certs rotate --role controller --name controller",
            )
        ]


async def test_a_server_rotated_before_its_old_serial_is_revoked_keeps_serving(
    server: str, certs: Path
) -> None:
    """The right order (rotate, then revoke the old serial) must not stop the server: it
    serves the re-issued certificate from the next handshake."""
    old = serial_of(certs, "controller", "controller")
    rotate(certs, role="controller", name="controller")
    revoke(certs, [old])
    # A wait for something that must not happen: three reload intervals.
    await asyncio.sleep(3 * INTERVAL)
    async with channel(server, certs, "admin", "admin") as fresh:
        assert (await who(fresh)).startswith("admin/admin ")


async def _health(channel: grpc.aio.Channel) -> str:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _reflection(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(timeout=5)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    return sorted(s.name for s in reply.list_services_response.service)


async def _refusal(rpc: Awaitable[object]) -> tuple[grpc.StatusCode, str] | None:
    try:
        await rpc
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return None


async def test_a_revoked_admin_is_refused_by_health_and_reflection(
    server: str, certs: Path
) -> None:
    """Standard services have no Orka handler reading the peer: the interceptor that
    start_server installs checks the serial for them (orka/rpc/revocation_check.py)."""
    async with channel(server, certs, "admin", "admin") as admin:
        assert await _health(admin) == "SERVING"
        assert "grpc.health.v1.Health" in await _reflection(admin)
        revoke(certs, [serial_of(certs, "admin", "admin")])

        async def refused() -> tuple[grpc.StatusCode, str] | None:
            return await _refusal(_health(admin))

        revoked = (grpc.StatusCode.UNAUTHENTICATED, "certificate revoked")
        assert await eventually(refused, timeout=INTERVAL + SLACK, interval=0.02) == revoked
        assert await _refusal(_reflection(admin)) == revoked
    # Everyone else is still served by both.
    async with channel(server, certs, "agent", "node-1") as agent:
        assert await _health(agent) == "SERVING"
        assert "orka.test.Probe" in await _reflection(agent)


async def test_a_revoked_admins_health_watch_is_cut(server: str, certs: Path) -> None:
    """A stream of a standard service is cut like Orka's own when a CRL revokes its peer."""
    async with channel(server, certs, "admin", "admin") as admin:
        watch = health_pb2_grpc.HealthStub(admin).Watch(health_pb2.HealthCheckRequest())
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        revoke(certs, [serial_of(certs, "admin", "admin")])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(INTERVAL + SLACK):
                while await watch.read() is not grpc.aio.EOF:
                    pass
                await watch.code()
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "certificate revoked",
        )
