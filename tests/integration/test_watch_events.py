"""WatchEvents and WatchEventBatches as a client sees them: the changes of what it asked for,
in order, and a clear error (not a silent end) for a subscriber that fell too far behind."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.controller import events
from tests.integration.cluster import Cluster, eventually


@pytest.fixture
def cluster_agents() -> int:
    return 2


async def subscribed(cluster: Cluster, count: int) -> None:
    """Wait until the controller holds `count` subscribers: the changes made after this reach
    them (a stream call starts at once, but its subscriber is added when the server runs it)."""
    assert cluster.controller is not None
    subs = cluster.controller.events.subscribers

    async def there() -> int | None:
        return len(subs) if len(subs) >= count else None

    assert await eventually(there, timeout=10) == count


def spec(name: str, replicas: int) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "100"],
        replicas=replicas,
        resources=pb.Resources(cpu_millis=10, memory_bytes=1 << 20),
    )


async def test_a_workload_subscriber_sees_its_instances_through_running(cluster: Cluster) -> None:
    assert cluster.api is not None
    stream = cluster.api.WatchEvents(pb.WatchEventsRequest(workload="web"))
    seen: list[pb.Event] = []

    async def read() -> None:
        async for ev in stream:
            seen.append(ev)
            running = {e.instance.name for e in seen if e.instance.phase == pb.Instance.RUNNING}
            if len(running) == 2:
                return

    reader = asyncio.create_task(read())
    await subscribed(cluster, 1)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("other", 1)))
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    async with asyncio.timeout(30):
        await reader
    stream.cancel()

    assert seen[0].type == pb.Event.ADDED and seen[0].workload.spec.name == "web"
    assert all(e.workload.spec.name == "web" or e.instance.workload == "web" for e in seen)
    for name in {e.instance.name for e in seen if e.HasField("instance")}:
        phases = [e.instance.phase for e in seen if e.instance.name == name]
        assert phases[0] == pb.Instance.PENDING and phases[-1] == pb.Instance.RUNNING
        # Phases only move forward (a PENDING instance may be MODIFIED while still PENDING).
        assert phases == sorted(phases)


@pytest.mark.parametrize("rpc", ["WatchEvents", "WatchEventBatches"])
async def test_a_subscriber_that_falls_behind_gets_resource_exhausted(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, rpc: str
) -> None:
    assert cluster.api is not None
    monkeypatch.setattr(events, "MAX_BACKLOG", 5)
    stream = getattr(cluster.api, rpc)(pb.WatchEventsRequest())
    await subscribed(cluster, 1)  # but reading nothing yet
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 10)))
    received: list[pb.Event] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with asyncio.timeout(30):
            async for msg in stream:
                received += msg.events if rpc == "WatchEventBatches" else [msg]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details() or ""
    assert "fell 5 events behind" in details
    # What was queued before the cut still arrived, up to a whole revision: the ten instances
    # were one commit, cut in the middle, so none of them came, and the error names the
    # revision to resume from.
    match = re.search(r"since_revision=(\d+)", details)
    assert match is not None
    last = int(match.group(1))
    assert [e.workload.spec.name for e in received] == ["web"]
    assert received[-1].revision == last
    monkeypatch.setattr(events, "MAX_BACKLOG", 1000)
    resumed = getattr(cluster.api, rpc)(pb.WatchEventsRequest(since_revision=last))
    added: list[pb.Event] = []
    async with asyncio.timeout(30):
        async for msg in resumed:
            added += msg.events if rpc == "WatchEventBatches" else [msg]
            if len([e for e in added if e.type == pb.Event.ADDED]) >= 10:
                break
    resumed.cancel()
    first_ten = [e for e in added if e.type == pb.Event.ADDED][:10]
    assert sorted(e.instance.name for e in first_ten) == sorted(
        i.name for i in await cluster.instances("web")
    )
    assert all(e.revision > last for e in added)


def _key(ev: pb.Event) -> tuple[int, str, str, int]:
    which = ev.WhichOneof("object")
    if which == "instance":
        return (ev.type, which, ev.instance.name, ev.instance.phase)
    if which == "workload":
        return (ev.type, which, ev.workload.spec.name, ev.workload.status.running)
    return (ev.type, which or "", ev.node.name, ev.node.state)


async def test_batches_carry_the_same_events_in_the_same_order(cluster: Cluster) -> None:
    assert cluster.api is not None
    single = cluster.api.WatchEvents(pb.WatchEventsRequest(workload="web"))
    batched = cluster.api.WatchEventBatches(pb.WatchEventsRequest(workload="web"))
    one_by_one: list[pb.Event] = []
    batches: list[list[pb.Event]] = []

    def all_running(events: list[pb.Event]) -> bool:
        phases = {e.instance.name: e.instance.phase for e in events if e.HasField("instance")}
        return len(phases) == 20 and set(phases.values()) == {pb.Instance.RUNNING}

    async def read_single() -> None:
        async for ev in single:
            one_by_one.append(ev)
            if all_running(one_by_one):
                return

    async def read_batched() -> None:
        async for batch in batched:
            batches.append(list(batch.events))
            if all_running([e for b in batches for e in b]):
                return

    readers = [asyncio.create_task(read_single()), asyncio.create_task(read_batched())]
    await subscribed(cluster, 2)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("other", 1)))
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 20)))
    async with asyncio.timeout(30):
        await asyncio.gather(*readers)
    single.cancel()
    batched.cancel()

    flat = [e for b in batches for e in b]
    assert [_key(e) for e in flat] == [_key(e) for e in one_by_one]
    assert [e.event_time for e in flat] == [
        e.event_time for e in one_by_one
    ]  # the very same events
    # The 20 instances are stored in one commit: their ADDED events travel together.
    assert max(len(b) for b in batches) >= 20
    assert all(b for b in batches)  # never an empty message
