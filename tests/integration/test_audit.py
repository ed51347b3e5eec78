"""The audit log and created_by/updated_by through the real API: real grpc.aio servers on
port 0, mutual TLS, the callers' own certificates."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.security.issue import init_certs, issue_cert
from orka.security.tls import TlsFiles, channel_credentials
from tests.integration.cluster import Cluster, eventually


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A CA of this test's own, with a second admin (alice) to tell creator and updater apart."""
    d = tmp_path / "certs"
    init_certs(d, nodes=["node-1"])
    issue_cert(d, "admin", "alice")
    return d


@pytest.fixture
def audit_path(tmp_path: Path) -> Path:
    return tmp_path / "audit" / "audit.jsonl"


@pytest.fixture
async def cluster(certs: Path, tmp_path: Path, audit_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs, tmp_path / "data")
    try:
        await c.scheduler.start()
        await c.start_controller(audit_log=audit_path)
        await c.add_agent("node-1", runtimes=["fake"])
        yield c
    finally:
        await c.stop()


def serial_of(certs: Path, role: str, name: str) -> str:
    cert = x509.load_pem_x509_certificate(TlsFiles.for_service(certs, role, name).cert.read_bytes())
    return format(cert.serial_number, "X")


def stub(cluster: Cluster, certs: Path, role: str, name: str) -> tuple[grpc.aio.Channel, Any]:
    """A plain gRPC client holding `role/name`'s certificate (no client-side role checks)."""
    assert cluster.controller is not None
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{cluster.controller.port}",
        channel_credentials(TlsFiles.for_service(certs, role, name)),
    )
    return channel, pb_grpc.ControllerStub(channel)


async def records(path: Path, count: int) -> list[dict[str, Any]]:
    """The first `count` records, once the writer thread has put them in the file."""

    def read() -> list[str]:
        return path.read_text().splitlines() if path.exists() else []

    async def ready() -> list[dict[str, Any]] | None:
        lines = await asyncio.to_thread(read)
        return [json.loads(line) for line in lines] if len(lines) >= count else None

    return await eventually(ready, timeout=10)


def spec(name: str = "web", replicas: int = 1) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "100"],
        replicas=replicas,
        resources=pb.Resources(cpu_millis=10, memory_bytes=1 << 20),
    )


def parse_time(value: str) -> dt.datetime:
    assert value.endswith("Z"), value  # RFC 3339 in UTC
    return dt.datetime.fromisoformat(value)


async def test_create_update_delete_are_recorded_with_the_admin_identity(
    cluster: Cluster, certs: Path, audit_path: Path
) -> None:
    assert cluster.api is not None
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec()))
    await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="web"))  # reads: not audited
    await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec(replicas=2)))
    await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))
    got = await records(audit_path, 3)
    after = dt.datetime.now(dt.UTC)

    assert [r["method"] for r in got] == ["CreateWorkload", "UpdateWorkload", "DeleteWorkload"]
    admin_serial = serial_of(certs, "admin", "admin")
    for r in got:
        assert set(r) == {"time", "method", "caller", "object", "outcome"}
        peer = r["caller"].pop("peer")
        assert peer.startswith(("ipv4:127.0.0.1:", "ipv6:")), peer
        assert r["caller"] == {
            "identity": "admin/admin",
            "role": "admin",
            "name": "admin",
            "serial": admin_serial,
        }
        assert r["object"] == {"kind": "workload", "name": "web"}
        assert r["outcome"] == {"code": "OK", "message": ""}
        assert before <= parse_time(r["time"]) <= after
    assert [parse_time(r["time"]) for r in got] == sorted(parse_time(r["time"]) for r in got)
    assert os.stat(audit_path).st_mode & 0o777 == 0o600


async def test_refused_calls_are_recorded_with_their_code(
    cluster: Cluster, audit_path: Path
) -> None:
    assert cluster.api is not None
    bad = spec()
    bad.replicas = -1
    for request, method, code in [
        (pb.CreateWorkloadRequest(spec=bad), "CreateWorkload", grpc.StatusCode.INVALID_ARGUMENT),
        (pb.DeleteWorkloadRequest(name="nope"), "DeleteWorkload", grpc.StatusCode.NOT_FOUND),
        (pb.CordonNodeRequest(name="node-9"), "CordonNode", grpc.StatusCode.NOT_FOUND),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await getattr(cluster.api, method)(request)
        assert info.value.code() is code

    got = await records(audit_path, 3)
    assert [(r["method"], r["object"], r["outcome"]["code"]) for r in got] == [
        ("CreateWorkload", {"kind": "workload", "name": "web"}, "INVALID_ARGUMENT"),
        ("DeleteWorkload", {"kind": "workload", "name": "nope"}, "NOT_FOUND"),
        ("CordonNode", {"kind": "node", "name": "node-9"}, "NOT_FOUND"),
    ]
    assert got[0]["outcome"]["message"].startswith("spec.replicas:")
    assert got[1]["outcome"]["message"] == "workload 'nope' not found"
    assert all(r["caller"]["identity"] == "admin/admin" for r in got)


async def test_a_role_the_api_refuses_is_recorded_with_its_identity(
    cluster: Cluster, certs: Path, audit_path: Path
) -> None:
    assert cluster.api is not None
    channel, agent = stub(cluster, certs, "agent", "node-1")
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("stolen")))
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED

    [r] = await records(audit_path, 1)
    assert r["method"] == "CreateWorkload"
    assert r["caller"]["identity"] == "agent/node-1"
    assert (r["caller"]["role"], r["caller"]["name"]) == ("agent", "node-1")
    assert r["caller"]["serial"] == serial_of(certs, "agent", "node-1")
    assert r["object"] == {"kind": "workload", "name": "stolen"}
    assert r["outcome"]["code"] == "PERMISSION_DENIED"
    assert "role agent may not call this API" in r["outcome"]["message"]
    # ... and the refusal left nothing behind.
    assert not (await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())).workloads


async def test_node_actions_are_recorded(cluster: Cluster, audit_path: Path) -> None:
    assert cluster.api is not None
    await cluster.api.CordonNode(pb.CordonNodeRequest(name="node-1"))
    await cluster.api.DrainNode(pb.DrainNodeRequest(name="node-1"))
    await cluster.api.UncordonNode(pb.UncordonNodeRequest(name="node-1"))
    got = await records(audit_path, 3)
    assert [(r["method"], r["object"]["kind"], r["object"]["name"]) for r in got] == [
        ("CordonNode", "node", "node-1"),
        ("DrainNode", "node", "node-1"),
        ("UncordonNode", "node", "node-1"),
    ]
    assert {r["outcome"]["code"] for r in got} == {"OK"}


async def test_created_by_and_updated_by_name_the_callers(cluster: Cluster, certs: Path) -> None:
    assert cluster.api is not None
    created = await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec()))
    assert (created.created_by, created.updated_by) == ("admin/admin", "admin/admin")

    channel, alice = stub(cluster, certs, "admin", "alice")
    async with channel:
        updated = await alice.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec(replicas=3)))
    assert (updated.created_by, updated.updated_by) == ("admin/admin", "admin/alice")

    got = await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="web"))
    assert (got.created_by, got.updated_by) == ("admin/admin", "admin/alice")
    [listed] = (await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())).workloads
    assert (listed.created_by, listed.updated_by) == ("admin/admin", "admin/alice")


async def test_reads_and_streams_are_recorded_when_asked(certs: Path, tmp_path: Path) -> None:
    """--audit-reads: unary reads as they end, a watch when it ends (the hook exec and logs
    streams will use)."""
    path = tmp_path / "reads.jsonl"
    c = Cluster(certs, tmp_path / "reads")
    try:
        await c.scheduler.start()
        await c.start_controller(audit_log=path, audit_reads=True)
        assert c.api is not None
        await c.api.ListWorkloads(pb.ListWorkloadsRequest())
        watch = c.api.WatchEvents(pb.WatchEventsRequest(workload="web"))
        await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec()))
        first = await anext(aiter(watch))  # subscribed and reading
        assert first.workload.spec.name == "web"
        watch.cancel()
        got = await records(path, 3)
    finally:
        await c.stop()
    assert [(r["method"], r["object"], r["outcome"]["code"]) for r in got] == [
        ("ListWorkloads", {"kind": "workloads", "name": ""}, "OK"),
        ("CreateWorkload", {"kind": "workload", "name": "web"}, "OK"),
        ("WatchEvents", {"kind": "events", "name": ""}, "CANCELLED"),
    ]
    assert {r["caller"]["identity"] for r in got} == {"admin/admin"}
