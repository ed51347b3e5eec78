"""A real gRPC server with Orka's mTLS credentials: who gets in, and who they are."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from orka.rpc.client import secure_channel
from orka.security.identity import peer_identity
from orka.security.issue import init_certs, issue_cert
from orka.security.tls import TlsFiles, channel_credentials, server_credentials
from tests.integration.identities import write_cert

WHO = "/orka.test.Probe/Who"


async def _who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    ident = peer_identity(context)
    return f"{ident.role}/{ident.name}".encode()


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    init_certs(d, ["node-1"])
    return d


@pytest.fixture
async def server(certs: Path) -> AsyncIterator[str]:
    srv = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    srv.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "orka.test.Probe", {"Who": grpc.unary_unary_rpc_method_handler(_who)}
            )
        ]
    )
    files = TlsFiles.for_service(certs, "controller", "controller")
    port = srv.add_secure_port("127.0.0.1:0", server_credentials(files))
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


async def _call_who(target: str, creds: grpc.ChannelCredentials) -> str:
    async with grpc.aio.secure_channel(target, creds) as channel:
        reply = await channel.unary_unary(WHO)(b"", timeout=5)
        return reply.decode()


async def test_admin_is_admitted_and_identified(server: str, certs: Path) -> None:
    creds = channel_credentials(TlsFiles.for_service(certs, "admin", "admin"))
    assert await _call_who(server, creds) == "admin/admin"
    async with grpc.aio.secure_channel(server, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_agent_identity(server: str, certs: Path) -> None:
    creds = channel_credentials(TlsFiles.for_service(certs, "agent", "node-1"))
    assert await _call_who(server, creds) == "agent/node-1"


async def _assert_refused(target: str, creds: grpc.ChannelCredentials) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _call_who(target, creds)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_cert_from_another_ca_is_refused(
    server: str, certs: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    init_certs(other, [])
    # Trust the real server, but present an admin cert that a foreign CA signed.
    files = TlsFiles(ca=certs / "ca.crt", cert=other / "admin.crt", key=other / "admin.key")
    await _assert_refused(server, channel_credentials(files))


async def test_client_without_cert_is_refused(server: str, certs: Path) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.crt").read_bytes())
    await _assert_refused(server, creds)


async def test_expired_client_cert_is_refused(server: str, certs: Path) -> None:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    issue_cert(
        certs, "admin", "old", not_valid_before=start, not_valid_after=start + dt.timedelta(days=1)
    )
    await _assert_refused(server, channel_credentials(TlsFiles.for_service(certs, "admin", "old")))


# What gRPC's TLS stack (BoringSSL) itself enforces of the extended key usage, found out here
# and pinned: a server certificate without serverAuth and a client certificate without
# clientAuth are refused at the handshake; a certificate with no EKU extension passes both
# ways. So a client-only Orka certificate cannot serve; the role-name check (see
# test_identity_clients.py) is what refuses a server certificate of the wrong role.
SERVER_AUTH = ExtendedKeyUsageOID.SERVER_AUTH
CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH


@pytest.mark.parametrize(
    ("server_usage", "client_usage", "served"),
    [
        ([SERVER_AUTH, CLIENT_AUTH], [CLIENT_AUTH], True),
        ([CLIENT_AUTH], [CLIENT_AUTH], False),
        ([SERVER_AUTH, CLIENT_AUTH], [SERVER_AUTH], False),
        (None, None, True),
    ],
    ids=["as-issued", "server-lacks-serverAuth", "client-lacks-clientAuth", "no-EKU"],
)
async def test_grpc_enforces_extended_key_usage(
    certs: Path,
    server_usage: list[x509.ObjectIdentifier] | None,
    client_usage: list[x509.ObjectIdentifier] | None,
    served: bool,
) -> None:
    server_files = write_cert(
        certs, "scheduler", "eku", "eku-server", server_usage, ["scheduler.orka"]
    )
    client_files = write_cert(certs, "admin", "eku", "eku-client", client_usage, [])
    srv = grpc.aio.server()
    srv.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "orka.test.Probe", {"Who": grpc.unary_unary_rpc_method_handler(_who)}
            )
        ]
    )
    port = srv.add_secure_port("127.0.0.1:0", server_credentials(server_files))
    await srv.start()
    try:
        async with secure_channel(f"127.0.0.1:{port}", client_files, "scheduler") as channel:
            call = channel.unary_unary(WHO)(b"", timeout=5)
            if served:
                assert await call == b"admin/eku"
            else:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop(None)
