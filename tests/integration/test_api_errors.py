"""Errors as a client of the real controller sees them: the exact class with its details, never
INTERNAL for what the user caused, and a CLI that acts on details rather than on prose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.cli.client import AdminClient
from orka.cli.main import main
from orka.controller.repo import Change
from orka.errors import (
    MORE_VIOLATIONS,
    Conflict,
    FieldViolation,
    Invalid,
    NotLeader,
    OrkaError,
    rich_status,
)
from orka.rpc.client import call
from orka.rpc.server import boundaries, start_server, unary
from orka.security.identity import Identity
from orka.security.tls import TlsFiles
from tests.integration.cluster import Cluster, eventually
from tests.integration.cluster import process_spec as spec


def api_of(cluster: Cluster) -> pb_grpc.ControllerStub:
    assert cluster.api is not None
    return cluster.api


async def test_a_bad_spec_names_each_bad_field_and_stores_nothing(cluster: Cluster) -> None:
    api = api_of(cluster)
    bad = spec("web", command=["sleep", "a\0b"], resources=pb.Resources(cpu_millis=-5))
    with pytest.raises(Invalid) as err:
        await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=bad))
    assert err.value.fields == [
        FieldViolation("spec.command[1]", "contains a NUL byte"),
        FieldViolation("spec.resources.cpu_millis", "Input should be greater than or equal to 0"),
    ]
    with pytest.raises(Invalid) as err:
        await call(api.GetWorkload, pb.GetWorkloadRequest(name="Bad_Name"))
    assert err.value.fields == [
        FieldViolation(
            "name",
            "'Bad_Name' must be 1-63 lowercase letters, digits or '-',"
            " starting and ending with a letter or digit",
        )
    ]
    assert cluster.controller is not None and not cluster.controller.repo.workloads


async def test_bad_volume_mounts_name_their_field_and_store_nothing(cluster: Cluster) -> None:
    api = api_of(cluster)
    relative = spec("db", volumes=[pb.VolumeMount(volume="data-1", mount_path="data")])
    with pytest.raises(Invalid) as err:
        await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=relative))
    assert err.value.fields == [
        FieldViolation(
            "spec.volumes[0].mount_path",
            "'data' must be an absolute, normalised path other than / (no '..', '.' or '//')",
        )
    ]
    both = [
        pb.VolumeMount(volume="data-1", mount_path="/data"),
        pb.VolumeMount(volume="data-2", mount_path="/data"),
    ]
    with pytest.raises(Invalid) as err:
        await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=spec("db", volumes=both)))
    assert err.value.message.endswith("volumes[1].mount_path: '/data' is used by two volumes")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.controller is not None and not cluster.controller.repo.workloads
    assert not cluster.controller.repo.volumes


async def test_updating_a_workload_being_deleted_is_a_conflict_not_internal(
    cluster: Cluster,
) -> None:
    api = api_of(cluster)
    assert cluster.controller is not None
    servicer = cluster.controller.api
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))

    async def idle() -> None:  # the deleting record stays until the update
        return None

    servicer.reconciler.reconcile_once = idle  # type: ignore[method-assign]
    old = servicer.repo.workloads["web"]
    changes = [Change("workloads", "web", old.model_copy(update={"deleting": True}))]
    await servicer.repo.mutate(lambda: changes)
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 1)))
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    status = rich_status(raw.value)
    assert status is not None and status.details, raw.value
    with pytest.raises(OrkaError) as err:
        await call(api.UpdateWorkload, pb.UpdateWorkloadRequest(spec=spec("web", 1)))
    assert (type(err.value), err.value.message) == (Conflict, "workload 'web' is being deleted")


# ---- a follower, as the CLI meets it ----


@boundaries(ListNodes=unary(roles={"admin"}), ListWorkloads=unary(roles={"admin"}))
class Follower(pb_grpc.ControllerServicer):
    """A controller that does not lead: its message points somewhere wrong on purpose, its
    details at the real leader, so a client that parses the prose goes astray."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.calls = 0

    async def ListNodes(self, request: pb.ListNodesRequest, who: Identity) -> pb.ListNodesResponse:
        self.calls += 1
        raise NotLeader("not the leader; the leader is at 127.0.0.1:1", leader=self.leader)

    async def ListWorkloads(
        self, request: pb.ListWorkloadsRequest, who: Identity
    ) -> pb.ListWorkloadsResponse:
        raise Invalid(
            "spec.replicas: must be >= 0; spec.image: is required",
            fields=[
                FieldViolation("spec.replicas", "must be >= 0"),
                FieldViolation("spec.image", "is required"),
            ],
            metadata={MORE_VIOLATIONS: "3"},
        )


@pytest.fixture
async def follower(cluster: Cluster, certs_dir: Path) -> AsyncIterator[tuple[Follower, str]]:
    assert cluster.controller is not None
    servicer = Follower(f"127.0.0.1:{cluster.controller.port}")
    server, port, _ = await start_server(
        "127.0.0.1:0",
        TlsFiles.for_service(certs_dir, "controller", "controller"),
        [lambda s: pb_grpc.add_ControllerServicer_to_server(servicer, s)],
        ["orka.v1.Controller"],
    )
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_the_cli_follows_not_leader_by_its_metadata_not_its_message(
    cluster: Cluster, certs_dir: Path, follower: tuple[Follower, str]
) -> None:
    servicer, address = follower
    async with AdminClient(address, certs_dir) as client:
        nodes = await eventually(client.list_nodes)
        assert [n.name for n in nodes] == ["node-1"]
        assert client.address == servicer.leader
    assert servicer.calls >= 1


async def test_the_cli_prints_each_field_violation_on_its_own_line(
    certs_dir: Path, follower: tuple[Follower, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, address = follower
    argv = ["get", "workloads", "--controller", address, "--certs", str(certs_dir)]
    assert await asyncio.to_thread(main, argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: spec.replicas: must be >= 0",
        "error: spec.image: is required",
        "error: and 3 more",
    ]
