"""`orka health ADDR`, the real command against real mutual-TLS servers (start_server)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc_health.v1 import health, health_pb2

from orka.rpc.server import start_server
from orka.security.issue import init_certs
from orka.security.tls import TlsFiles


@dataclass
class Server:
    address: str
    health: health.aio.HealthServicer


async def _serve(certs: Path, role: str) -> AsyncIterator[Server]:
    files = TlsFiles.for_service(certs, role, role)
    srv, port, servicer = await start_server("127.0.0.1:0", files, [], [])
    try:
        yield Server(f"127.0.0.1:{port}", servicer)
    finally:
        await srv.stop(None)


@pytest.fixture
async def controller(certs_dir: Path) -> AsyncIterator[Server]:
    async for s in _serve(certs_dir, "controller"):
        yield s


@pytest.fixture
async def scheduler(certs_dir: Path) -> AsyncIterator[Server]:
    async for s in _serve(certs_dir, "scheduler"):
        yield s


async def orka_health(*args: str) -> tuple[int, str]:
    """Run the real CLI (a subprocess, so this loop keeps serving); exit code and output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORKA_", "GRPC_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        "health",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode().strip()


async def test_serving_with_the_admin_pair_and_with_a_services_own_folder(
    certs_dir: Path, controller: Server, scheduler: Server
) -> None:
    code, out = await orka_health(controller.address, "--certs", str(certs_dir))
    assert (code, out) == (0, f"{controller.address} (controller): SERVING")
    # Inside a container: only ca.crt and the service's own pair; auto finds the scheduler.
    code, out = await orka_health(scheduler.address, "--certs", str(certs_dir / "scheduler"))
    assert (code, out) == (0, f"{scheduler.address} (scheduler): SERVING")
    # An agent's folder probes its scheduler with the agent's certificate.
    agent_dir = certs_dir / "agent-node-1"
    code, out = await orka_health(scheduler.address, "--certs", str(agent_dir))
    assert (code, out) == (0, f"{scheduler.address} (scheduler): SERVING")


async def test_not_serving_exits_1_naming_the_status(certs_dir: Path, controller: Server) -> None:
    await controller.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    code, out = await orka_health(controller.address, "--certs", str(certs_dir / "controller"))
    assert code == 1
    assert out == f"unhealthy: {controller.address} (controller) is NOT_SERVING"


async def test_the_wrong_role_is_refused(certs_dir: Path, scheduler: Server) -> None:
    code, out = await orka_health(
        scheduler.address, "--role", "controller", "--certs", str(certs_dir)
    )
    assert code == 1
    assert out.startswith(f"unhealthy: refusing the server at {scheduler.address}: ")
    assert "does not name role controller" in out


async def test_unreachable_exits_1(certs_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, out = await orka_health(f"127.0.0.1:{port}", "--certs", str(certs_dir))
    assert code == 1
    assert out.startswith(f"unhealthy: cannot reach 127.0.0.1:{port}: "), out
    assert "\n" not in out


async def test_a_silent_peer_is_given_up_on_after_the_timeout(certs_dir: Path) -> None:
    # Accepts TCP and never speaks: the handshake hangs, the probe must not.
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        code, out = await orka_health(
            f"127.0.0.1:{port}", "--certs", str(certs_dir), "--timeout", "1"
        )
        took = loop.time() - started
    finally:
        silent.close()
    assert code == 1
    assert out == f"unhealthy: 127.0.0.1:{port} did not answer within 1s"
    assert took < 8


async def test_bad_certs(certs_dir: Path, controller: Server, tmp_path: Path) -> None:
    # Another cluster's CA: the server refuses the client and the client the server.
    other = tmp_path / "other"
    init_certs(other, [])
    code, out = await orka_health(controller.address, "--certs", str(other))
    assert code == 1
    assert out.startswith(f"unhealthy: cannot reach {controller.address}: "), out
    # No certs at all: said before dialling, naming the file.
    code, out = await orka_health(controller.address, "--certs", str(tmp_path / "none"))
    assert code == 1
    assert "ca.crt does not exist" in out
    # A dir with two service pairs and no admin pair: which one is not guessed.
    both = tmp_path / "both"
    both.mkdir()
    for stem in ("controller", "scheduler"):
        for suffix in (".crt", ".key"):
            src = certs_dir / stem / f"{stem}{suffix}"
            (both / src.name).write_bytes(src.read_bytes())
    (both / "ca.crt").write_bytes((certs_dir / "ca.crt").read_bytes())
    code, out = await orka_health(controller.address, "--certs", str(both))
    assert code == 1
    assert "no certificate for admin" in out
