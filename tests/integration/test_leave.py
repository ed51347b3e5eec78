"""Leaving (SIGTERM) on an in-process cluster: the agent waits for replacements only while
waiting can help, logs why it does not or when its wait expires, and a node that comes back
after a leave is schedulable again while an operator's cordon is kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from orka.api import controller_pb2 as pb
from orka.controller.reconciler import History
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from orka.validation import NODE_LABEL
from tests.integration.cluster import Cluster, crash, eventually

FAST = {"heartbeat_interval": 0.2, "node_lost_after": 1.0, "offer_timeout": 0.5}
LONG_LEAVE = 60.0  # what an agent waits at most; every "at once" below is far under it
AT_ONCE = 10.0


def spec(name: str, replicas: int, **fields: Any) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=replicas,
        **fields,
    )


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, **FAST)
    await c.scheduler.start()
    await c.start_controller()
    yield c
    await c.stop()


async def running_nodes(c: Cluster, workload: str, count: int) -> list[str] | None:
    nodes = sorted(i.node for i in await c.running(workload))
    return nodes if len(nodes) == count else None


async def node(c: Cluster, name: str) -> pb.Node:
    assert c.api is not None
    return await c.api.GetNode(pb.GetNodeRequest(name=name))


def leave_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        line
        for line in logs
        if line["event"].startswith(("leaving without waiting", "leave timeout expired"))
    ]


async def timed_leave(c: Cluster, name: str) -> tuple[float, list[dict[str, Any]]]:
    agent = c.agents.pop(name)
    with structlog.testing.capture_logs() as logs:
        began = time.monotonic()
        await agent.stop(leave=True)
        took = time.monotonic() - began
    return took, leave_lines(logs)


async def test_the_only_node_leaves_at_once(cluster: Cluster) -> None:
    """Nothing can take the instances: the agent stops them at once, and says why."""
    assert cluster.api is not None
    await cluster.add_agent("node-1", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    await eventually(lambda: running_nodes(cluster, "web", 2))
    took, lines = await timed_leave(cluster, "node-1")
    assert took < AT_ONCE, f"the only node took {took:.1f}s to leave"
    assert [(line["why"], line["count"]) for line in lines] == [
        ("no other ready, schedulable node", 2)
    ]


async def test_leave_timeout_expiring_is_logged(cluster: Cluster) -> None:
    """Another node is there but cannot take the instance (pinned here): the wait runs out,
    and the agent logs it with how many instances are still here."""
    assert cluster.api is not None
    await cluster.add_agent("node-1", runtimes=["fake"], leave_timeout=1.0)
    await cluster.add_agent("node-2", runtimes=["fake"])
    pinned = spec("pinned", 1, node_selector={NODE_LABEL: "node-1"})
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))
    await eventually(lambda: running_nodes(cluster, "pinned", 1))
    took, lines = await timed_leave(cluster, "node-1")
    assert 1.0 <= took < AT_ONCE
    assert [(line["event"], line["count"], line["timeout"]) for line in lines] == [
        ("leave timeout expired; stopping what is still here", 1, 1.0)
    ]


async def test_scheduler_gone_before_the_leave(cluster: Cluster) -> None:
    """Two nodes, but no scheduler to place replacements: the agent does not wait."""
    assert cluster.api is not None
    await cluster.add_agent("node-1", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.add_agent("node-2", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    await eventually(lambda: running_nodes(cluster, "web", 2))
    await cluster.scheduler.stop()
    took, lines = await timed_leave(cluster, "node-1")
    assert took < AT_ONCE, f"leaving without a scheduler took {took:.1f}s"
    assert len(lines) == 1 and lines[0]["count"] == 1
    assert lines[0]["why"] in ("scheduler unreachable", "scheduler stream lost")


async def test_node_back_after_a_leave_is_schedulable_and_a_cordon_is_kept(
    cluster: Cluster, certs_dir: Path
) -> None:
    """As `docker-compose down` does it: an agent leaves, and the scheduler stops before it
    could tell the controller the node left. Back up, the node is schedulable (a leave is no
    drain) and gets instances. A node an operator cordoned stays cordoned across its
    agent's restart."""
    assert cluster.api is not None
    await cluster.add_agent("node-1", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.add_agent("node-2", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    assert await eventually(lambda: running_nodes(cluster, "web", 2)) == ["node-1", "node-2"]

    # node-2 leaves; the controller hears of it; then the scheduler goes away mid-leave.
    leaving = asyncio.create_task(cluster.agents.pop("node-2").stop(leave=True))

    async def seen_leaving() -> bool:
        return (await node(cluster, "node-2")).leaving

    await eventually(seen_leaving)
    began = time.monotonic()
    port = cluster.scheduler.port
    await cluster.scheduler.stop()
    await asyncio.wait_for(leaving, AT_ONCE)
    assert time.monotonic() - began < AT_ONCE

    # Everything comes back: a new scheduler on the same address, node-2's agent again.
    cluster.scheduler = Scheduler(
        SchedulerConfig(listen=f"127.0.0.1:{port}", **FAST),  # type: ignore[arg-type]
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    await cluster.scheduler.start()
    await cluster.add_agent("node-2", runtimes=["fake"], leave_timeout=LONG_LEAVE)

    async def back() -> pb.Node | None:
        n = await node(cluster, "node-2")
        ok = n.state == pb.Node.READY and n.schedulable and not n.draining and not n.leaving
        return n if ok else None

    await eventually(back)
    pinned = spec("pinned", 1, node_selector={NODE_LABEL: "node-2"})
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))
    assert await eventually(lambda: running_nodes(cluster, "pinned", 1)) == ["node-2"]

    # An operator's cordon outlives the agent's restart (and its leave).
    await cluster.api.CordonNode(pb.CordonNodeRequest(name="node-1"))
    await cluster.agents.pop("node-1").stop(leave=True)
    await cluster.add_agent("node-1", runtimes=["fake"])
    await eventually(lambda: _ready(cluster, "node-1"))
    await asyncio.sleep(3 * FAST["heartbeat_interval"])  # a few beats: nothing uncordons it
    n = await node(cluster, "node-1")
    assert (n.schedulable, n.draining, n.leaving) == (False, False, False)
    record = cluster.scheduler.registry.get("node-1")
    assert record is not None and not record.takes_new


async def _ready(c: Cluster, name: str) -> bool:
    return (await node(c, name)).state == pb.Node.READY


async def test_instance_history_is_bounded_across_node_restarts(
    certs_dir: Path, tmp_path: Path
) -> None:
    """A 3-replica workload on two nodes, each node restarted twice (once leaving, once
    killed): the finished instances left behind (LOST, STOPPED, replaced) are bounded by
    the controller's --keep-finished, and every replica still runs."""
    c = Cluster(certs_dir, tmp_path, **FAST)
    await c.scheduler.start()
    await c.start_controller(history=History(keep=2))
    try:
        assert c.api is not None
        for name in ("node-1", "node-2"):
            await c.add_agent(name, runtimes=["fake"], leave_timeout=LONG_LEAVE)
        await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3)))
        await eventually(lambda: running_nodes(c, "web", 3))
        for restart in range(2):
            for name in ("node-1", "node-2"):
                agent = c.agents.pop(name)
                if restart == 0:
                    await agent.stop(leave=True)
                else:
                    # As SIGKILL: its instances go LOST, the node comes back READY with them
                    # still there, is told to stop them, and only then may their rows go.
                    await crash(agent)
                await eventually(lambda n=name: _state(c, n, (pb.Node.LOST, pb.Node.LEFT)))
                await eventually(lambda: running_nodes(c, "web", 3))
                await c.add_agent(name, runtimes=["fake"], leave_timeout=LONG_LEAVE)

        async def bounded() -> list[tuple[str, int]] | None:
            rows = await c.instances("web")
            finished = [(i.name, i.phase) for i in rows if i.phase != pb.Instance.RUNNING]
            running = [i for i in rows if i.phase == pb.Instance.RUNNING]
            return finished if len(finished) <= 2 and len(running) == 3 else None

        await eventually(bounded)
    finally:
        await c.stop()


async def _state(c: Cluster, name: str, states: tuple[int, ...]) -> bool:
    return (await node(c, name)).state in states


async def test_a_leave_stops_waiting_when_its_last_taker_goes(cluster: Cluster) -> None:
    """node-2 could take the instances when node-1 began to leave; cordoned, it cannot: the
    scheduler tells the leaving agent, which stops at once rather than at its timeout."""
    assert cluster.api is not None
    await cluster.add_agent("node-1", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.add_agent("node-2", runtimes=["fake"])
    pinned = spec("pinned", 1, node_selector={NODE_LABEL: "node-1"})
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))
    await eventually(lambda: running_nodes(cluster, "pinned", 1))
    agent = cluster.agents.pop("node-1")
    with structlog.testing.capture_logs() as logs:
        leaving = asyncio.create_task(agent.stop(leave=True))
        await eventually(lambda: _leaving(cluster, "node-1"))
        await asyncio.sleep(0.5)
        assert not leaving.done()  # node-2 could still take it: waiting
        began = time.monotonic()
        await cluster.api.CordonNode(pb.CordonNodeRequest(name="node-2"))
        await asyncio.wait_for(leaving, AT_ONCE)
    assert time.monotonic() - began < AT_ONCE
    assert [(line["why"], line["count"]) for line in leave_lines(logs)] == [
        ("no other ready, schedulable node", 1)
    ]


async def _leaving(c: Cluster, name: str) -> bool:
    return (await node(c, name)).leaving


async def test_no_controller_no_wait(cluster: Cluster) -> None:
    """Another node could take the instances, but no controller is there to place them."""
    assert cluster.api is not None and cluster.controller is not None
    await cluster.add_agent("node-1", runtimes=["fake"], leave_timeout=LONG_LEAVE)
    await cluster.add_agent("node-2", runtimes=["fake"])
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    await eventually(lambda: running_nodes(cluster, "web", 2))
    await cluster.controller.stop()
    took, lines = await timed_leave(cluster, "node-1")
    assert took < AT_ONCE, f"leaving without a controller took {took:.1f}s"
    assert [(line["why"], line["count"]) for line in lines] == [("no controller connected", 1)]
