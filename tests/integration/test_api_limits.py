"""Limits on the public API, against a real controller: oversized and malformed specs,
quotas and slow watchers are refused with the right code, and leave the store as it was."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.controller import events
from orka.controller.api import Quotas
from orka.validation import MAX_SPEC_BYTES
from tests.integration.cluster import Cluster, eventually
from tests.integration.cluster import process_spec as spec


async def names(cluster: Cluster) -> list[str]:
    assert cluster.api is not None
    resp = await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())
    return [w.spec.name for w in resp.workloads]


async def create_error(cluster: Cluster, s: pb.WorkloadSpec) -> grpc.aio.AioRpcError:
    assert cluster.api is not None
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=s))
    return info.value


async def test_a_huge_name_is_invalid_with_a_short_message(cluster: Cluster) -> None:
    err = await create_error(cluster, spec(name="a" * 1_000_000))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("spec.name: name 'aaa")
    assert len(err.details() or "") < 250
    assert await names(cluster) == []


async def test_nul_in_a_command_is_refused_and_nothing_is_stored(cluster: Cluster) -> None:
    err = await create_error(cluster, spec(command=["sh", "-c", "a\0b"]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "spec.command[2]: contains a NUL byte"
    assert await names(cluster) == []


async def test_a_relative_working_dir_is_refused(cluster: Cluster) -> None:
    err = await create_error(cluster, spec(working_dir="../root"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("spec.working_dir: must be an absolute path")


async def test_a_spec_over_a_mib_names_the_field(cluster: Cluster) -> None:
    big = spec(env={f"K{i}": "v" * 100_000 for i in range(12)})
    assert MAX_SPEC_BYTES < big.ByteSize() < 4 << 20
    err = await create_error(cluster, big)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("spec.env: is 1200")
    assert await names(cluster) == []


async def test_a_60_mb_env_value_is_refused_and_listing_keeps_working(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(name="small")))
    err = await create_error(cluster, spec(env={"BIG": "x" * (60 << 20)}))
    # Past the API's per-message bound gRPC refuses it before it is even parsed.
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await names(cluster) == ["small"]


async def test_quotas_refuse_with_resource_exhausted_naming_the_quota(cluster: Cluster) -> None:
    assert cluster.api is not None and cluster.controller is not None
    cluster.controller.api.quotas = Quotas(max_workloads=2, max_instances=3)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("a", replicas=2)))
    err = await create_error(cluster, spec("b", replicas=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.details() or "").startswith("quota max_instances: 4 replicas")
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("b", replicas=1)))
    err = await create_error(cluster, spec("c"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.details() or "").startswith("quota max_workloads: the cluster already holds 2")
    # Scaling up past the instance quota is refused too, and leaves the spec as it was.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("b", replicas=2)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    got = await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="b"))
    assert got.spec.replicas == 1
    assert await names(cluster) == ["a", "b"]
    # Scaling down is always allowed.
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("a", replicas=1)))


async def test_the_specs_together_have_a_quota_so_listing_keeps_fitting(cluster: Cluster) -> None:
    assert cluster.api is not None and cluster.controller is not None
    cluster.controller.api.quotas = Quotas(max_spec_bytes=1_850_000)
    big = {f"K{i}": "v" * 100_000 for i in range(9)}  # about 900 kB
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("a", env=big)))
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("b", env=big)))
    err = await create_error(cluster, spec("c", env=big))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.details() or "").startswith("quota max_spec_bytes: the workloads' specs would")
    # Growing a spec past it is refused too; a small one still fits.
    bigger = {**big, "K9": "v" * 100_000}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("b", env=bigger)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("c")))
    assert await names(cluster) == ["a", "b", "c"]


async def test_a_watcher_that_never_reads_is_cut_off_by_bytes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each update of a ~900 KB workload queues one ~900 KB event for a subscriber that does
    not read: past the byte bound (lowered to 4 MiB here) it is cut off, long before the
    event-count bound (100,000) is reached."""
    assert cluster.api is not None and cluster.controller is not None
    monkeypatch.setattr(events, "MAX_BACKLOG_BYTES", 4 << 20)
    hub = cluster.controller.events
    stream = cluster.api.WatchEvents(pb.WatchEventsRequest(workload="big"))
    await eventually(lambda: _true(len(hub.subscribers) == 1))
    for i in range(12):
        s = spec("big", env={f"V{j}": f"{i}-" + "x" * 120_000 for j in range(7)})
        if i == 0:
            await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=s))
        else:
            await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=s))
    # Cut off: the hub no longer holds it, whatever the client does next.
    await eventually(lambda: _true(not hub.subscribers))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with asyncio.timeout(30):
            async for _ in stream:
                pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "bytes) and was cut off" in (info.value.details() or "")
    # The controller keeps serving.
    assert await names(cluster) == ["big"]


async def _true(value: bool) -> bool:
    return value
