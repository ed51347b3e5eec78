"""The certificate table for every client: the agent and the controller's scheduler link must
reach only a `scheduler`, the CLI only a `controller`. Each real client dials a real server
that presents one certificate of the table; a refused server never sees a call, and the
client says why. The right certificate is the control row: the same server is reached.

The revoked row is different, and says exactly what holds: grpc-python's clients cannot
check a CRL in the handshake nor see the server's certificate, so no client refuses a revoked
server certificate. An honest Orka server refuses to start on one (and stops when a CRL
revokes it: test_certlife), so it is never reached; a thief serving a stolen key without the
CRL IS reached (`test_limit_...` pins that documented limit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from orka.agent.service import Agent, AgentConfig
from orka.api import agent_pb2 as apb
from orka.cli.client import AdminClient
from orka.controller.link import SchedulerLink
from orka.errors import Invalid, OrkaError
from orka.rpc.server import start_server
from orka.security.tls import TlsFiles
from tests.integration.cluster import eventually
from tests.integration.identities import (
    BAD,
    NAMES,
    Certs,
    make_certs,
)

REACHED = "reached the server"


class Server:
    """A TLS server holding any certificate; it records each call and answers FAILED_PRECONDITION,
    so a client that gets through is seen (and goes no further)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.calls.append(details.method)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, REACHED)

        if details.method.endswith("/Connect"):
            return grpc.stream_stream_rpc_method_handler(refuse)
        if details.method.endswith("/Watch"):
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class _Generic(grpc.GenericRpcHandler):
    def __init__(self, server: Server) -> None:
        self.server = server

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return self.server.service(details)


@asynccontextmanager
async def serving(certs: Certs, files: TlsFiles) -> AsyncIterator[tuple[str, Server]]:
    seen = Server()
    srv = grpc.aio.server()
    srv.add_generic_rpc_handlers([_Generic(seen)])
    # Like Orka's servers: the cluster CA, client certificates required.
    creds = grpc.ssl_server_credentials(
        [(files.key.read_bytes(), files.cert.read_bytes())],
        root_certificates=(certs.dir / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    port = srv.add_secure_port("127.0.0.1:0", creds)
    await srv.start()
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        await srv.stop(None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("identity"))


def server_rows(certs: Certs, role: str) -> dict[str, TlsFiles]:
    """Every certificate a server could present to a client that wants `role`."""
    rows: dict[str, TlsFiles | None] = {"right": certs.role(role)}
    # A server always presents a certificate, so "none" is not a row here.
    rows |= {kind: certs.bad(kind, role) for kind in BAD if kind != "none"}
    rows["legacy-agent"] = certs.legacy_agent()
    for other in ("admin", "viewer", "agent", "controller", "scheduler"):
        if other != role:
            rows[other] = certs.role(other)
    return {k: v for k, v in rows.items() if v is not None}


# What each refused row makes the client say. A certificate of the wrong role fails the
# role-name check (or, for client-only certificates, the serverAuth check first); a bad one
# fails the chain or validity check.
WRONG_NAME = "does not name role"
NOT_SERVING = "not for serving (no serverAuth)"
NOT_STARTED = "not reached: the Orka server refuses to start on its revoked certificate"


async def orka_server(files: TlsFiles) -> str:
    """What an honest Orka server does with a revoked certificate (the client has nothing to
    dial: no port was ever opened)."""
    try:
        server, _, _ = await start_server("127.0.0.1:0", files, [], [])
    except Invalid as e:
        assert e.message.startswith(f"certs: {files.cert} (serial ")
        assert f"is revoked by {files.crl}" in e.message
        return NOT_STARTED
    await server.stop(None)
    return "an Orka server started on a revoked certificate"


def expected(role: str) -> dict[str, str]:
    want = {
        "right": "served",
        "other-ca": "refused: unable to get local issuer certificate",
        "expired": "refused: certificate has expired",
        "not-yet-valid": "refused: certificate is not yet valid",
        "revoked": NOT_STARTED,
        # The attack of the issue: an agent certificate with serverAuth and 127.0.0.1.
        "legacy-agent": f"refused: {WRONG_NAME}",
        "admin": f"refused: {NOT_SERVING}",
        "viewer": f"refused: {NOT_SERVING}",
        "agent": f"refused: {NOT_SERVING}",
    }
    other = "controller" if role == "scheduler" else "scheduler"
    want[other] = f"refused: {WRONG_NAME}"
    return want


def classify(seen: Server, said: str, needles: Sequence[str]) -> str:
    if seen.calls:
        return "served"
    for needle in needles:
        if needle in said:
            return f"refused: {needle}"
    return f"refused, unexplained: {said[:300]}"


NEEDLES = (
    WRONG_NAME,
    NOT_SERVING,
    "unable to get local issuer certificate",
    "certificate has expired",
    "certificate is not yet valid",
)


@contextmanager
def logs() -> Iterator[list[dict[str, Any]]]:
    with capture_logs() as captured:
        yield captured


def _said(entries: list[dict[str, Any]], events: set[str]) -> str:
    return " | ".join(
        f"{e['event']}: {e.get('reason') or e.get('details') or ''}"
        for e in entries
        if e.get("event") in events
    )


async def _until(check: Callable[[], bool]) -> None:
    async def ok() -> bool:
        return check()

    await eventually(ok, timeout=15, interval=0.02)


CLIENT_EVENTS = {"refusing the scheduler", "scheduler stream ended", "scheduler feed lost"}


async def run_agent(certs: Certs, target: str, seen: Server, data: Path) -> str:
    agent = Agent(
        AgentConfig(name=NAMES["agent"], schedulers=[target], data_dir=data, runtimes=["fake"]),
        certs.role("agent"),
    )
    with logs() as entries:
        await agent.start()
        try:
            await _until(lambda: bool(seen.calls) or bool(_said(entries, CLIENT_EVENTS)))
            said = _said(entries, CLIENT_EVENTS)
            assert not agent.connected.is_set()
        finally:
            await agent.stop()
    if not seen.calls:
        # A refusal is an error naming the target, not a quiet retry.
        refusals = [e for e in entries if e["event"] == "refusing the scheduler"]
        assert all(e["log_level"] == "error" and e["target"] == target for e in refusals)
    return classify(seen, said, NEEDLES)


async def run_link(certs: Certs, target: str, seen: Server, data: Path) -> str:
    async def updates(batch: Sequence[apb.ClusterUpdate]) -> None:
        raise AssertionError(f"a refused scheduler fed the controller: {batch}")

    link = SchedulerLink([target], certs.role("controller"), updates)
    with logs() as entries:
        link.start()
        try:
            await _until(lambda: bool(seen.calls) or bool(_said(entries, CLIENT_EVENTS)))
            said = _said(entries, CLIENT_EVENTS)
            assert not link.connected.is_set()
        finally:
            await link.close()
    return classify(seen, said, NEEDLES)


async def run_cli(certs: Certs, target: str, seen: Server, data: Path) -> str:
    async with AdminClient(target, certs.dir, timeout=10) as client:
        with pytest.raises(OrkaError) as err:
            await client.list_nodes()
    if seen.calls:
        assert err.value.message == REACHED
    return classify(seen, err.value.message, NEEDLES)


Runner = Callable[[Certs, str, Server, Path], Awaitable[str]]


@pytest.mark.parametrize(
    ("client", "role", "run"),
    [
        ("agent", "scheduler", run_agent),
        ("controller-link", "scheduler", run_link),
        ("cli", "controller", run_cli),
    ],
)
async def test_client_table(
    certs: Certs, tmp_path: Path, client: str, role: str, run: Runner
) -> None:
    got: dict[str, str] = {}
    for row, files in server_rows(certs, role).items():
        if row == "revoked":
            got[row] = await orka_server(files)
            continue
        async with serving(certs, files) as (target, seen):
            got[row] = await run(certs, target, seen, tmp_path / row)
    assert got == expected(role)


@pytest.mark.parametrize(
    ("client", "role", "run"),
    [
        ("agent", "scheduler", run_agent),
        ("controller-link", "scheduler", run_link),
        ("cli", "controller", run_cli),
    ],
)
async def test_limit_a_thief_serving_a_revoked_key_without_the_crl_is_reached(
    certs: Certs, tmp_path: Path, client: str, role: str, run: Runner
) -> None:
    """The documented limit, pinned so that it is not forgotten (and so that a future gRPC
    with client-side CRLs shows up here): a server of the thief's own, presenting a stolen
    and since revoked certificate, is reached by every Orka client. Rotate the key and revoke
    the old serial still matters: honest servers then stop presenting it."""
    stolen = certs.bad("revoked", role)
    assert stolen is not None
    async with serving(certs, stolen) as (target, seen):
        assert await run(certs, target, seen, tmp_path / "thief") == "served"


async def test_cli_error_names_the_refusal(certs: Certs) -> None:
    async with serving(certs, certs.role("scheduler")) as (target, seen):
        async with AdminClient(target, certs.dir, timeout=10) as client:
            with pytest.raises(OrkaError) as err:
                await client.list_nodes()
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert err.value.message == (
        f"refusing the server at {target}: the server's certificate does not name role "
        "controller (controller.orka); it is not this cluster's controller"
    )
    assert seen.calls == []
