"""End to end, services as processes: a controller or scheduler whose own certificate the
operator revoked (and forgot to re-issue) stops presenting it. The running process logs why
and exits 1 within one reload interval; started again, it refuses, naming the fix."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.security.issue import init_certs
from orka.security.revoke import revoke, serial_of
from tests.e2e.procs import ProcessCluster
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

INTERVAL = 0.3


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ProcessCluster]:
    monkeypatch.setenv("ORKA_TLS_RELOAD_INTERVAL", str(INTERVAL))
    certs = tmp_path / "certs"
    init_certs(certs, [])
    c = ProcessCluster(certs, tmp_path / "data")
    c.data.mkdir()
    c.start_scheduler()
    c.start_controller()
    await c.connect()
    try:
        await eventually(lambda: _serving(c), timeout=30)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()


async def _serving(c: ProcessCluster) -> bool:
    return (await c.nodes()) == {}


@pytest.mark.parametrize("role", ["scheduler", "controller"])
async def test_a_server_exits_when_its_own_certificate_is_revoked(
    cluster: ProcessCluster, role: str
) -> None:
    service = cluster.services[role]
    assert service.proc is not None and service.proc.poll() is None
    serial = serial_of(cluster.certs, role, role)
    revoke(cluster.certs, [serial])

    async def exited() -> int | None:
        assert service.proc is not None
        return service.proc.poll()

    assert await eventually(exited, timeout=INTERVAL + 10) == 1
    lines = [json.loads(line) for line in service.log.read_text().splitlines() if line[:1] == "{"]
    said = [e for e in lines if e["event"].startswith("this server's own certificate")]
    assert [(e["level"], e["serial"], e["fix"]) for e in said] == [
        ("error", format(serial, "x"), f"orka certs rotate --role {role} --name {role}")
    ]
    crt = cluster.certs / role / f"{role}.crt"
    refusal = (
        f"error: certs: {crt} (serial {serial:x}) is revoked by {crt.parent / 'crl.pem'}; "
        "a server does not present a revoked certificate: re-issue it with "
        f"`orka certs rotate --role {role} --name {role}`"
    )
    assert refusal in service.log.read_text()

    # A supervisor restarting it gets the same refusal at once, and no port is opened.
    again = cluster._service(f"{role}-again", service.args)
    assert again.proc is not None
    assert await asyncio.to_thread(again.proc.wait, 30) == 1
    assert refusal in again.log.read_text()
