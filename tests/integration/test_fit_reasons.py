"""Why an instance is not placed, end to end on real grpc.aio servers: the scheduler sends the
reasons structured, the controller words them, and an instance that only a cluster change can
place waits for one instead of being offered again on every node event."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.controller.placement import PlacementConfig
from tests.integration.cluster import Cluster, eventually

MI = 1 << 20


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, offer_timeout=0.5)
    await c.scheduler.start()
    # Backoff long enough that only a cluster change can bring a retry within a test.
    await c.start_controller(placement=PlacementConfig(backoff_start=120.0, backoff_max=120.0))
    yield c
    await c.stop()


async def add(c: Cluster, name: str, memory: int = 1 << 30, **opts: object) -> None:
    await c.add_agent(name, runtimes=["fake"], cpu_millis=4000, memory_bytes=memory, **opts)


def spec(name: str, replicas: int, memory: int, **kw: object) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=replicas,
        resources=pb.Resources(cpu_millis=100, memory_bytes=memory),
        **kw,  # type: ignore[arg-type]
    )


async def status(c: Cluster, workload: str) -> list[str] | None:
    assert c.api is not None
    w = await c.api.GetWorkload(pb.GetWorkloadRequest(name=workload))
    return list(w.status.unschedulable_reasons) or None


async def test_a_workload_that_fits_nowhere_says_why_per_node(cluster: Cluster) -> None:
    for i in (1, 2, 3):
        await add(cluster, f"node-{i}")
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("big", 3, 600 * MI)))
    await eventually(lambda: _count(cluster.running("big"), 3))
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("more", 1, 600 * MI)))
    assert await eventually(lambda: status(cluster, "more")) == ["3 nodes: insufficient memory"]
    [inst] = await cluster.instances("more")
    assert (inst.phase, inst.reason, inst.message) == (
        pb.Instance.PENDING,
        "Unschedulable",
        "3 nodes: insufficient memory",
    )
    # Room can free up: the instance is not waiting for the cluster's shape to change.
    assert cluster.controller is not None
    assert inst.name not in cluster.controller.queue.parked


async def test_an_unresolvable_refusal_waits_for_a_node_that_can_take_it(
    cluster: Cluster,
) -> None:
    await add(cluster, "node-1")
    controller = cluster.controller
    assert controller is not None and cluster.api is not None
    placed: list[list[str]] = []
    place = controller.link.place

    async def counting(items: list[apb.Assignment], *args: object) -> apb.PlaceResponse:
        placed.append([a.instance for a in items])
        return await place(items, *args)  # type: ignore[arg-type]

    controller.link.place = counting  # type: ignore[method-assign]
    selector = {"zone": "mars"}
    await cluster.api.CreateWorkload(
        pb.CreateWorkloadRequest(spec=spec("rover", 1, 16 * MI, node_selector=selector))
    )
    assert await eventually(lambda: status(cluster, "rover")) == ["1 node: label zone != mars"]
    [inst] = await cluster.instances("rover")
    queue = controller.queue
    await eventually(lambda: _value(inst.name in queue.parked))
    offers = len(placed)
    # Node events that cannot help: a cordon and an uncordon (which retries what waits).
    await cluster.api.CordonNode(pb.CordonNodeRequest(name="node-1"))
    await cluster.api.UncordonNode(pb.UncordonNodeRequest(name="node-1"))
    assert inst.name in queue.parked and inst.name in queue.backoff
    assert len(placed) == offers
    # A node with the label joins: offered at once, placed there.
    await add(cluster, "node-2", labels={"zone": "mars"})
    running = await eventually(lambda: _count(cluster.running("rover"), 1))
    assert [i.node for i in running] == ["node-2"]
    assert len(placed) > offers


async def _count(coro: object, n: int) -> list[pb.Instance] | None:
    got = await coro  # type: ignore[misc]
    return got if len(got) == n else None


async def _value(ok: bool) -> bool | None:
    return ok or None
