"""Fixed host ports as a node resource, as users see it through the controller API: two
instances wanting host port N never share a node, the rest wait with "host port N in use",
and a port comes free when its instance is deleted or its node is lost."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster, crash, eventually, process_spec

FAST = {"heartbeat_interval": 0.2, "node_lost_after": 1.0, "offer_timeout": 0.5}
HTTP = [pb.PortSpec(name="http", host_port=8080)]  # never bound: the agents' driver is fake
IN_USE = "2 nodes: host port 8080 in use"


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, **FAST)
    await c.start(agents=2, runtimes=["fake"])
    yield c
    await c.stop()


async def running_on(c: Cluster, workload: str, count: int, exclude: str = "") -> list[str] | None:
    nodes = [i.node for i in await c.running(workload)]
    return sorted(nodes) if len(nodes) == count and exclude not in nodes else None


async def reasons(c: Cluster, workload: str) -> list[str] | None:
    assert c.api is not None
    w = await c.api.GetWorkload(pb.GetWorkloadRequest(name=workload))
    return list(w.status.unschedulable_reasons) or None


async def test_a_fixed_host_port_is_taken_once_per_node(cluster: Cluster) -> None:
    api = cluster.api
    assert api is not None
    # Three replicas wanting host port 8080 on two nodes: one each, the third waits.
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec("web", 3, ports=HTTP)))
    assert await eventually(lambda: running_on(cluster, "web", 2)) == ["node-1", "node-2"]
    assert await eventually(lambda: reasons(cluster, "web")) == [IN_USE]
    (waiting,) = [i for i in await cluster.instances("web") if not i.node]
    assert (waiting.phase, waiting.reason, waiting.message) == (
        pb.Instance.PENDING,
        "Unschedulable",
        IN_USE,
    )
    # Another workload wanting the same port finds it taken on every node too.
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec("api", 1, ports=HTTP)))
    assert await eventually(lambda: reasons(cluster, "api")) == [IN_USE]

    # Deleting the first frees its ports: the second places.
    await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))
    (first,) = await eventually(lambda: running_on(cluster, "api", 1))
    assert await reasons(cluster, "api") is None
    other = "node-2" if first == "node-1" else "node-1"

    # Its node is lost: the replacement places on the other node, which has the port free.
    await crash(cluster.agents[first])
    assert await eventually(lambda: running_on(cluster, "api", 1, exclude=first)) == [other]
    lost = [i.node for i in await cluster.instances("api") if i.phase == pb.Instance.LOST]
    assert lost == [first]
    # The node comes back; its agent is told to stop the copy that was replaced, and the
    # port it held there is free again: a third workload wanting it runs there.
    await cluster.add_agent(first, runtimes=["fake"])

    async def old_copy_gone() -> bool:
        return not any(i.holds_resources for i in cluster.agents[first].instances.values())

    await eventually(old_copy_gone)
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec("db", 1, ports=HTTP)))
    assert await eventually(lambda: running_on(cluster, "db", 1)) == [first]
    assert await eventually(lambda: running_on(cluster, "api", 1)) == [other]
