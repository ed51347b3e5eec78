"""Paged lists (AIP-158) as a client sees them: every object exactly once in a stable order at
any page size, also while objects are created and deleted; clear errors for a bad size or
token; and the CLI following the tokens."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.controller import paging
from orka.controller.repo import Change, instance_key
from orka.models import Instance
from orka.rpc import convert
from orka.rpc.pages import list_all
from tests.integration.cluster import Cluster, eventually, process_spec

# Five workloads of 500: several workloads, so the order by workload is tested too.
WORKLOADS = {f"w{i}": 500 for i in range(5)}
TOTAL = sum(WORKLOADS.values())


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    """No agents: the instances stay PENDING, and listing is all the test loads."""
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start(agents=0)
        assert c.api is not None
        for name, replicas in WORKLOADS.items():
            await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec(name, replicas)))
        await stored(c, TOTAL)
        yield c
    finally:
        await c.stop()


async def stored(cluster: Cluster, count: int) -> None:
    assert cluster.controller is not None
    repo = cluster.controller.repo

    async def there() -> int | None:
        return len(repo.instances) if len(repo.instances) == count else None

    await eventually(there, timeout=60)


def server_order(cluster: Cluster) -> list[str]:
    """The order the API promises, from the controller's own cache."""
    assert cluster.controller is not None
    instances = cluster.controller.repo.instances.values()
    return [i.name for i in sorted(instances, key=instance_key)]


async def pages(cluster: Cluster, size: int, **filters: object) -> list[pb.ListInstancesResponse]:
    assert cluster.api is not None
    out: list[pb.ListInstancesResponse] = []
    token = ""
    # A server that never ends the listing fails here, not by a timeout.
    while len(out) <= 2 * TOTAL:
        resp = await cluster.api.ListInstances(
            pb.ListInstancesRequest(page_size=size, page_token=token, **filters)  # type: ignore[arg-type]
        )
        out.append(resp)
        token = resp.next_page_token
        if not token:
            return out
    raise AssertionError(f"no last page after {len(out)} pages")


@pytest.mark.parametrize("size", [1, 7, 1000, 0])
async def test_every_page_size_returns_each_instance_once_in_a_stable_order(
    cluster: Cluster, size: int
) -> None:
    listed = await pages(cluster, size)
    names = [i.name for p in listed for i in p.instances]
    assert names == server_order(cluster)
    assert len(set(names)) == TOTAL
    # Full pages of the size asked for (0: the default), the last one possibly shorter.
    expected = size or paging.DEFAULT_PAGE_SIZE
    assert [len(p.instances) for p in listed[:-1]] == [expected] * (len(listed) - 1)
    assert 0 < len(listed[-1].instances) <= expected
    assert len(listed) == -(-TOTAL // expected)
    # Each page says the revision it was read at, and each instance the revision of its write.
    assert cluster.controller is not None
    repo = cluster.controller.repo
    assert all(0 < p.revision <= repo.revision for p in listed)
    for p in listed:
        for i in p.instances:
            # (The placement queue may have written it again since.)
            assert 0 < i.revision <= min(p.revision, repo.revision_of("instances", i.name))


async def test_one_workload_and_filters_page_the_same_way(cluster: Cluster) -> None:
    listed = await pages(cluster, 7, workload="w3")
    names = [i.name for p in listed for i in p.instances]
    assert names == [n for n in server_order(cluster) if n.startswith("w3-")]
    assert len(names) == WORKLOADS["w3"]
    pending = await pages(cluster, 333, phase=pb.Instance.PENDING)
    assert [i.name for p in pending for i in p.instances] == server_order(cluster)
    assert not [i for p in await pages(cluster, 50, node="node-9") for i in p.instances]


async def test_a_page_size_above_the_maximum_is_taken_as_the_maximum(cluster: Cluster) -> None:
    assert cluster.api is not None
    resp = await cluster.api.ListInstances(pb.ListInstancesRequest(page_size=1_000_000))
    assert len(resp.instances) == paging.MAX_PAGE_SIZE and resp.next_page_token


def _model_key(i: Instance) -> tuple[str, tuple[int, int], str]:
    """The list order's key of a stored instance, at the wire's precision (microseconds)."""
    t = convert.timestamp_fields(i.created_at) or {"seconds": 0, "nanos": 0}
    return (i.workload, (t["seconds"], t["nanos"]), i.name)


def _wire_key(i: pb.Instance) -> tuple[str, tuple[int, int], str]:
    return (i.workload, (i.create_time.seconds, i.create_time.nanos), i.name)


async def test_listing_while_instances_are_created_and_deleted(cluster: Cluster) -> None:
    """Every instance that exists for the whole listing is seen exactly once; none twice."""
    assert cluster.api is not None and cluster.controller is not None
    api, repo = cluster.api, cluster.controller.repo
    # Instances by their whole key: a name (a random suffix) may come back on a new instance.
    before = {_model_key(i) for i in repo.instances.values()}
    churned = {"created": 0, "deleted": 0}
    done = asyncio.Event()

    async def churn() -> None:
        # Scale workloads that sort before, inside and after the cursor up and down, and
        # create new ones, for as long as the listing runs.
        step = 0
        while not done.is_set():
            step += 1
            name = f"w{step % 5}"
            replicas = 500 + (37 if step % 2 else -41)
            await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=process_spec(name, replicas)))
            if step % 7 == 0:
                await api.CreateWorkload(
                    pb.CreateWorkloadRequest(spec=process_spec(f"n{step:03d}", 30))
                )
            await asyncio.sleep(0.01)

    def count(change: Change, old: object) -> None:
        if change.kind == "instances" and old is None:
            churned["created"] += 1
        elif change.kind == "instances" and change.value is None:
            churned["deleted"] += 1

    repo.listeners.append(count)
    writer = asyncio.create_task(churn())
    try:
        listed = await pages(cluster, 7)
    finally:
        done.set()
        await writer
        repo.listeners.remove(count)
    after = {_model_key(i) for i in repo.instances.values()}
    keys = [_wire_key(i) for p in listed for i in p.instances]
    # The churn really overlapped the listing.
    assert churned["created"] > 100 and churned["deleted"] > 100
    assert listed[-1].revision > listed[0].revision
    assert len(keys) == len(set(keys)), "an instance was listed twice"
    missing = (before & after) - set(keys)
    assert not missing, f"{len(missing)} instances that existed throughout were skipped"
    # And in the promised order.
    assert keys == sorted(keys)


async def test_a_bad_page_size_or_token_is_invalid_naming_the_field(cluster: Cluster) -> None:
    assert cluster.api is not None
    api = cluster.api

    async def refused(call: object) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call  # type: ignore[misc]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return info.value.details() or ""

    for rpc, req in (
        (api.ListInstances, pb.ListInstancesRequest),
        (api.ListWorkloads, pb.ListWorkloadsRequest),
        (api.ListNodes, pb.ListNodesRequest),
    ):
        assert (await refused(rpc(req(page_size=-1)))).startswith("page_size: must be >= 0")
        for token in ("!!not-base64!!", "e30", base64.urlsafe_b64encode(b"[1,2]").decode()):
            assert (await refused(rpc(req(page_token=token)))).startswith("page_token: not a")
    # A well-formed token whose key has the wrong types (a forged one) is refused, not a crash.
    fingerprint = paging.fingerprint("instances", "", "", 0)
    forged = json.dumps({"k": ["w1", "not a time", 3], "f": fingerprint}).encode()
    details = await refused(
        api.ListInstances(pb.ListInstancesRequest(page_token=base64.urlsafe_b64encode(forged)))
    )
    assert details.startswith("page_token: not a")

    # A token made for other filters, or for another list, is refused.
    first = await api.ListInstances(pb.ListInstancesRequest(workload="w1", page_size=3))
    assert first.next_page_token
    for other in (
        pb.ListInstancesRequest(workload="w2", page_token=first.next_page_token),
        pb.ListInstancesRequest(page_token=first.next_page_token),
        pb.ListInstancesRequest(
            workload="w1", phase=pb.Instance.PENDING, page_token=first.next_page_token
        ),
    ):
        assert "page_token: was issued for a listing with other filters" in await refused(
            api.ListInstances(other)
        )
    workloads = await api.ListWorkloads(pb.ListWorkloadsRequest(page_size=1))
    assert "other filters" in await refused(
        api.ListNodes(pb.ListNodesRequest(page_token=workloads.next_page_token))
    )
    # The same filters resume.
    second = await api.ListInstances(
        pb.ListInstancesRequest(workload="w1", page_size=3, page_token=first.next_page_token)
    )
    assert [i.name for i in second.instances] == [
        n for n in server_order(cluster) if n.startswith("w1-")
    ][3:6]


async def test_workloads_and_nodes_page_by_name(cluster: Cluster) -> None:
    assert cluster.api is not None
    workloads, revision = await list_all(
        cluster.api.ListWorkloads, pb.ListWorkloadsRequest(page_size=2), "workloads"
    )
    assert [w.spec.name for w in workloads] == sorted(WORKLOADS)
    assert revision > 0
    for n in (3, 1, 2):
        await cluster.add_agent(f"node-{n}", runtimes=["fake"])
    api = cluster.api

    async def three() -> list[str] | None:
        nodes, _ = await list_all(api.ListNodes, pb.ListNodesRequest(page_size=1), "nodes")
        return [n.name for n in nodes] if len(nodes) == 3 else None

    # Nodes reach the controller through the scheduler's feed, a moment after they join.
    assert await eventually(three) == ["node-1", "node-2", "node-3"]


async def test_orka_get_instances_follows_the_pages(cluster: Cluster, certs_dir: Path) -> None:
    """The CLI as a user runs it: more instances than a page holds, all of them printed."""
    assert cluster.controller is not None
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        "get",
        "instances",
        "-o",
        "json",
        "--controller",
        f"127.0.0.1:{cluster.controller.port}",
        "--certs",
        str(certs_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    printed = [i["name"] for i in json.loads(out)]
    assert TOTAL > paging.DEFAULT_PAGE_SIZE
    assert sorted(printed) == sorted(server_order(cluster))
