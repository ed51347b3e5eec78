"""UpdateWorkload through the real API: what an update may not change.

A workload's kind is fixed at creation (a running PROCESS cannot become a VM in place), and its
name is its key: an update naming another workload touches only that one. Every refused update
answers INVALID_ARGUMENT naming the field and leaves the stored workload exactly as it was.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.models import Workload
from tests.integration.cluster import Cluster

KINDS = {
    "PROCESS": pb.WorkloadSpec.PROCESS,
    "CONTAINER": pb.WorkloadSpec.CONTAINER,
    "VM": pb.WorkloadSpec.VM,
}


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


def spec(kind: str, name: str = "app", image: str = "/images/app-1.img") -> pb.WorkloadSpec:
    # An absolute path is a valid image for every kind (a VM's disk must be one). No replicas:
    # the stored workload is all the update can change.
    return pb.WorkloadSpec(
        name=name, kind=KINDS[kind], image=image, command=["sleep", "100"], replicas=0
    )


def stored(cluster: Cluster, name: str) -> Workload:
    assert cluster.controller is not None
    return cluster.controller.repo.workloads[name]


async def update_code(cluster: Cluster, sent: pb.WorkloadSpec) -> tuple[grpc.StatusCode, str]:
    assert cluster.api is not None
    try:
        await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=sent), timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("old", "new"),
    [pytest.param(old, new, id=f"{old}->{new}") for old, new in itertools.permutations(KINDS, 2)],
)
async def test_kind_cannot_change(cluster: Cluster, old: str, new: str) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(old)), timeout=10)
    before = stored(cluster, "app")
    # Alone, and together with a change that would be allowed on its own.
    for sent in (spec(new), spec(new, image="/images/app-2.img")):
        code, details = await update_code(cluster, sent)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("spec.kind: cannot change")
        assert stored(cluster, "app") == before
    # Control: the same image change with the kind kept is accepted, so only the kind refused.
    code, _ = await update_code(cluster, spec(old, image="/images/app-2.img"))
    assert code is grpc.StatusCode.OK
    after = stored(cluster, "app")
    assert after.spec.kind.value == old
    assert after.spec.image == "/images/app-2.img"
    assert after.generation == before.generation + 1


async def test_the_name_is_the_key_and_the_origin_stays(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("PROCESS")), timeout=10)
    before = stored(cluster, "app")
    # Another name is another workload: not found, and nothing is renamed or created.
    code, details = await update_code(cluster, spec("PROCESS", name="other"))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "workload 'other' not found")
    assert cluster.controller is not None
    assert sorted(cluster.controller.repo.workloads) == ["app"]
    assert stored(cluster, "app") == before
    # An accepted update keeps who created it and when.
    code, _ = await update_code(cluster, spec("PROCESS", image="/images/app-2.img"))
    assert code is grpc.StatusCode.OK
    after = stored(cluster, "app")
    assert (after.created_at, after.created_by) == (before.created_at, before.created_by)
    assert after.updated_at >= before.updated_at
