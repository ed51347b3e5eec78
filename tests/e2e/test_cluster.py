"""End to end: controller, scheduler and three agents as separate OS processes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from orka.scheduler.service import SchedulerConfig
from tests.e2e.procs import ProcessCluster, host_copies, kill_host_copies, nodes_ready
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

WORKLOAD = "e2e-sleep"
NODES = ["node-1", "node-2", "node-3"]


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[ProcessCluster]:
    c = ProcessCluster(certs_dir, tmp_path)
    c.start_scheduler()
    c.start_controller()
    for name in NODES:
        c.start_agent(name)
    await c.connect()
    try:
        await eventually(lambda: nodes_ready(c, NODES), timeout=30)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
        kill_host_copies(WORKLOAD)


async def _spread(c: ProcessCluster, count: int, exclude: str = "") -> list[pb.Instance] | None:
    running = await c.running(WORKLOAD)
    nodes = {i.node for i in running}
    if len(running) == count and len(nodes) == count and exclude not in nodes:
        return running
    return None


def _host(count: int) -> dict[str, int] | None:
    copies = host_copies(WORKLOAD)
    return copies if len(copies) == count else None


async def test_heal_leave_delete(cluster: ProcessCluster) -> None:
    api = cluster.api
    assert api is not None
    running, copies = await _three_on_host(cluster)
    assert set(copies) == {i.name for i in running}

    # SIGKILL one agent: its instance keeps running on the host, but comes back elsewhere.
    victim = running[0].node
    cluster.services[victim].signal(signal.SIGKILL)
    cluster.services[victim].wait()
    killed_at = time.monotonic()
    await eventually(lambda: _running_without(cluster, 3, victim), timeout=30)
    healed_after = time.monotonic() - killed_at
    print(f"node-loss replacement took {healed_after:.2f}s (node_lost_after 5s)")
    nodes = await cluster.nodes()
    assert nodes[victim] == pb.Node.LOST

    # The agent returns under the same name: it re-adopts the orphan, is told to stop it,
    # and the host ends with exactly `replicas` copies.
    cluster.start_agent(victim)
    await eventually(lambda: nodes_ready(cluster, NODES), timeout=30)

    async def settled() -> bool:
        # The host and the API agree on exactly `replicas` copies; between the orphan's stop
        # and the API's next read they may briefly differ, which is not the failure looked for.
        running = await _running_without(cluster, 3, "")
        copies = _host(3)
        return (
            running is not None and copies is not None and set(copies) == {i.name for i in running}
        )

    await eventually(settled, timeout=30)

    # SIGTERM an agent: a leave notice, its instance is replaced, then it exits.
    leaver = running[0].node
    cluster.services[leaver].signal(signal.SIGTERM)
    assert cluster.services[leaver].wait(timeout=60) == 0
    running = await eventually(lambda: _running_without(cluster, 3, leaver), timeout=30)
    assert (await cluster.nodes())[leaver] == pb.Node.LEFT
    await eventually(lambda: _asyncify(_host(3)), timeout=30)

    # Delete: every process of the workload is gone from the host.
    await api.DeleteWorkload(pb.DeleteWorkloadRequest(name=WORKLOAD))
    await eventually(lambda: _asyncify(host_copies(WORKLOAD) == {}), timeout=30)
    await eventually(lambda: _no_workloads(cluster), timeout=30)


async def _running_without(c: ProcessCluster, count: int, node: str) -> list[pb.Instance] | None:
    running = await c.running(WORKLOAD)
    if len(running) == count and all(i.node != node for i in running):
        return running
    return None


async def _no_workloads(c: ProcessCluster) -> bool:
    assert c.api is not None
    return not (await c.api.ListWorkloads(pb.ListWorkloadsRequest())).workloads


async def _create_three(c: ProcessCluster) -> list[pb.Instance]:
    """Three replicas of `sleep`; returns them once RUNNING on three distinct nodes."""
    assert c.api is not None
    spec = pb.WorkloadSpec(
        name=WORKLOAD,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=3,
        resources=pb.Resources(cpu_millis=100, memory_bytes=16 << 20),
    )
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
    return await eventually(lambda: _spread(c, 3), timeout=30)


async def _three_on_host(c: ProcessCluster) -> tuple[list[pb.Instance], dict[str, int]]:
    """`_create_three`, then the instance -> pid map once all three processes are on the host."""
    running = await _create_three(c)
    return running, await eventually(lambda: _asyncify(_host(3)))


async def _asyncify(value: object) -> object:
    return value


async def test_controller_restart_loses_and_duplicates_nothing(cluster: ProcessCluster) -> None:
    running, pids = await _three_on_host(cluster)
    before = {i.name: i.node for i in running}

    cluster.services["controller"].signal(signal.SIGKILL)
    cluster.services["controller"].wait()
    cluster.start_controller()
    await cluster.connect()
    after = await eventually(lambda: _spread(cluster, 3), timeout=30)
    assert {i.name: i.node for i in after} == before
    assert host_copies(WORKLOAD) == pids  # the same processes: nothing restarted

    assert cluster.api is not None
    await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name=WORKLOAD))
    await eventually(lambda: _asyncify(host_copies(WORKLOAD) == {}), timeout=30)


async def _watching(c: ProcessCluster) -> tuple[list[pb.Event], asyncio.Task[None]]:
    """Every event the controller sends from now on, collected until the task is cancelled.
    Returns once the subscription is known to be there: a marker workload (no replicas) has
    been seen ADDED on it."""
    assert c.api is not None
    seen: list[pb.Event] = []
    stream = c.api.WatchEvents(pb.WatchEventsRequest())

    async def collect() -> None:
        try:
            async for ev in stream:
                seen.append(ev)
        finally:
            stream.cancel()

    task = asyncio.create_task(collect())
    marker = pb.WorkloadSpec(name="watch-marker", kind=pb.WorkloadSpec.PROCESS, command=["true"])
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=marker))
    await eventually(
        lambda: _asyncify(any(e.workload.spec.name == "watch-marker" for e in seen)), timeout=10
    )
    return seen, task


async def test_agent_restart_readopts_without_restarting(cluster: ProcessCluster) -> None:
    running, pids = await _three_on_host(cluster)
    before = {i.name: i.node for i in running}
    seen, watcher = await _watching(cluster)

    # SIGKILL the agent (its processes keep running) and bring it straight back.
    victim = running[0].node
    cluster.services[victim].signal(signal.SIGKILL)
    killed = time.monotonic()
    cluster.services[victim].wait()
    log = cluster.services[victim].log
    registrations = log.read_text().count('"registered"')
    cluster.start_agent(victim)

    async def registered_again() -> bool:
        # The restarted agent's own log says when it is back on the stream.
        return log.read_text().count('"registered"') > registrations

    await eventually(registered_again, timeout=30)
    away = time.monotonic() - killed
    # Watch on past node_lost_after (counted from the kill, the last moment the scheduler can
    # have heard the old agent), and past a reconcile after it: a node declared lost in that
    # time would show LOST here and its instance would be replaced.
    lost_after = SchedulerConfig.node_lost_after
    await asyncio.sleep(max(0.0, killed + lost_after + 2.0 - time.monotonic()))
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    print(f"\nagent away {away:.2f}s; watched {time.monotonic() - killed:.2f}s from the kill")

    node_states = {n: [e.node.state for e in seen if e.node.name == n] for n in NODES}
    # The node is never lost, and a short absence at most makes it NOT_READY (no heartbeat
    # for two intervals: only possible when the restart took about that long).
    assert pb.Node.LOST not in node_states[victim]
    if away < SchedulerConfig.heartbeat_interval:
        assert set(node_states[victim]) <= {pb.Node.READY}, node_states[victim]
    else:
        assert set(node_states[victim]) <= {pb.Node.READY, pb.Node.NOT_READY}
    for other in set(NODES) - {victim}:
        assert set(node_states[other]) <= {pb.Node.READY}, (other, node_states[other])
    # No instance of the workload moved, restarted, stopped or was added meanwhile.
    changes = [e for e in seen if e.instance.workload == WORKLOAD]
    assert all(
        (e.type, e.instance.name, e.instance.node, e.instance.phase, e.instance.restarts)
        == (pb.Event.MODIFIED, e.instance.name, before.get(e.instance.name), pb.Instance.RUNNING, 0)
        for e in changes
    ), [(e.type, e.instance.name, e.instance.node, e.instance.phase) for e in changes]

    after = await cluster.running(WORKLOAD)
    assert {i.name: i.node for i in after} == before
    assert all(i.restarts == 0 for i in after)
    assert host_copies(WORKLOAD) == pids
    assert (await cluster.nodes())[victim] == pb.Node.READY
