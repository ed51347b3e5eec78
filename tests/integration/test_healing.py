"""Node loss, leave, drain, delete and controller restart on an in-process cluster."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from orka.runtime.base import RunSpec, TaskInfo
from orka.runtime.fake import FakeDriver
from tests.integration.cluster import Cluster, crash, eventually

FAST = {"heartbeat_interval": 0.2, "node_lost_after": 1.0, "offer_timeout": 0.5}
LEAVE_TIMEOUT = 10.0


def spec(name: str, replicas: int) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name, kind=pb.WorkloadSpec.PROCESS, command=["sleep", "1000"], replicas=replicas
    )


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, **FAST)
    await c.start(agents=3, runtimes=["fake"], leave_timeout=LEAVE_TIMEOUT)
    yield c
    await c.stop()


async def running_on(c: Cluster, workload: str, count: int, exclude: str = "") -> list[str] | None:
    nodes = [i.node for i in await c.running(workload)]
    if len(nodes) == count and exclude not in nodes:
        return sorted(nodes)
    return None


async def test_lost_node_instances_come_back_elsewhere(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    nodes = await eventually(lambda: running_on(cluster, "web", 2))
    victim = nodes[0]
    await crash(cluster.agents[victim])
    await eventually(lambda: running_on(cluster, "web", 2, exclude=victim))
    lost = [i for i in await cluster.instances("web") if i.phase == pb.Instance.LOST]
    assert [i.node for i in lost] == [victim]
    node = await cluster.api.GetNode(pb.GetNodeRequest(name=victim))
    assert node.state == pb.Node.LOST


async def test_returning_node_stops_what_was_replaced(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 1)))
    (victim,) = await eventually(lambda: running_on(cluster, "web", 1))
    agent = cluster.agents[victim]
    # Silence the agent without stopping its task: it comes back with the instance running.
    await crash(agent)
    await eventually(lambda: running_on(cluster, "web", 1, exclude=victim))
    revived = await cluster.add_agent(victim, runtimes=["fake"])
    assert revived is not agent

    async def one_copy() -> bool:
        running = await cluster.running("web")
        live = [n for n, a in cluster.agents.items() if "web" in str(list(a.instances))]
        return len(running) == 1 and len(live) == 1

    await eventually(one_copy)


@pytest.fixture
def task_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """What the fake drivers of every agent did, in order: ("start", instance) once a task
    runs, ("stop", instance) when a stop is asked for."""
    events: list[tuple[str, str]] = []
    start, stop = FakeDriver.start, FakeDriver.stop

    async def recording_start(self: FakeDriver, run: RunSpec) -> TaskInfo:
        info = await start(self, run)
        events.append(("start", run.instance))
        return info

    async def recording_stop(self: FakeDriver, instance: str, grace: float) -> TaskInfo:
        events.append(("stop", instance))
        return await stop(self, instance, grace)

    monkeypatch.setattr(FakeDriver, "start", recording_start)
    monkeypatch.setattr(FakeDriver, "stop", recording_stop)
    return events


async def test_leave_replaces_before_stopping(
    cluster: Cluster, task_events: list[tuple[str, str]]
) -> None:
    """A leaving agent's instance is replaced first: the replacement runs before the old
    copy is stopped, and the agent is done long before its leave timeout (an agent that just
    gives up after the timeout stops the old copy first)."""
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 1)))
    (victim,) = await eventually(lambda: running_on(cluster, "web", 1))
    (old,) = [i.name for i in await cluster.running("web")]
    began = time.monotonic()
    await cluster.agents.pop(victim).stop(leave=True)
    took = time.monotonic() - began
    # stop(leave=True) returns once the replacement runs and the old copy stopped.
    nodes = await eventually(lambda: running_on(cluster, "web", 1, exclude=victim))
    assert victim not in nodes
    (new,) = [i.name for i in await cluster.running("web")]
    assert new != old
    assert task_events.index(("start", new)) < task_events.index(("stop", old))
    assert took < LEAVE_TIMEOUT / 2, f"leave took {took:.1f}s"
    node = await eventually(lambda: _node_state(cluster, victim, pb.Node.LEFT))
    assert node


async def _node_state(c: Cluster, name: str, state: int) -> bool:
    assert c.api is not None
    return (await c.api.GetNode(pb.GetNodeRequest(name=name))).state == state


async def test_drain_moves_instances_and_cordons(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3)))
    nodes = await eventually(lambda: running_on(cluster, "web", 3))
    victim = nodes[0]
    node = await cluster.api.DrainNode(pb.DrainNodeRequest(name=victim))
    assert not node.schedulable and node.draining
    record = cluster.scheduler.registry.get(victim)
    assert record is not None and record.draining and not record.schedulable
    await eventually(lambda: running_on(cluster, "web", 3, exclude=victim))
    # Nothing is left held on the drained node, and the agent runs nothing any more.
    await eventually(lambda: _async(not record.holds and not cluster.agents[victim].instances))
    await cluster.api.UncordonNode(pb.UncordonNodeRequest(name=victim))
    node = await cluster.api.GetNode(pb.GetNodeRequest(name=victim))
    assert node.schedulable and not node.draining


async def _async(value: bool) -> bool:
    return value


async def test_cordon_keeps_instances_and_gets_no_new_placement(cluster: Cluster) -> None:
    """Cordon is not drain: the node keeps what it runs (not draining, nothing moved) and
    the scheduler places nothing new there."""
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3)))
    await eventually(lambda: running_on(cluster, "web", 3))
    before = {(i.name, i.node) for i in await cluster.running("web")}
    victim = sorted(before)[0][1]
    node = await cluster.api.CordonNode(pb.CordonNodeRequest(name=victim))
    assert (node.schedulable, node.draining) == (False, False)
    record = cluster.scheduler.registry.get(victim)
    assert record is not None and (record.schedulable, record.draining) == (False, False)
    # Were it schedulable, spread would put one of the three new replicas on it.
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 6)))
    await eventually(lambda: running_on(cluster, "web", 6))
    after = {(i.name, i.node) for i in await cluster.running("web")}
    assert before <= after
    assert [n for _, n in after - before].count(victim) == 0
    assert [name for name, n in after if n == victim] == [name for name, n in before if n == victim]
    node = await cluster.api.GetNode(pb.GetNodeRequest(name=victim))
    assert (node.schedulable, node.draining) == (False, False)
    assert len(cluster.agents[victim].instances) == 1


async def test_delete_stops_everything(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3)))
    await eventually(lambda: running_on(cluster, "web", 3))
    await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))

    async def gone() -> bool:
        listed = await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())  # type: ignore[union-attr]
        tasks = sum(len(a.instances) for a in cluster.agents.values())
        return not listed.workloads and not await cluster.instances() and tasks == 0

    await eventually(gone)


async def test_scale_up_and_down(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 1)))
    await eventually(lambda: running_on(cluster, "web", 1))
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 3)))
    await eventually(lambda: running_on(cluster, "web", 3))
    w = await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="web"))
    assert w.generation == 1  # replicas alone is not a new generation
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 1)))
    await eventually(lambda: running_on(cluster, "web", 1))


async def test_update_rolls_instances(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 2)))
    await eventually(lambda: running_on(cluster, "web", 2))
    old = {i.name for i in await cluster.running("web")}
    new_spec = spec("web", 2)
    new_spec.env["VERSION"] = "2"
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=new_spec))

    async def rolled() -> bool:
        running = await cluster.running("web")
        return len(running) == 2 and all(i.generation == 2 and i.name not in old for i in running)

    await eventually(rolled)


async def test_controller_restart_loses_and_duplicates_nothing(cluster: Cluster) -> None:
    assert cluster.api is not None and cluster.controller is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3)))
    await eventually(lambda: running_on(cluster, "web", 3))
    before = sorted((i.name, i.node) for i in await cluster.running("web"))
    await cluster.controller.stop()
    await cluster.start_controller()
    after = sorted((i.name, i.node) for i in await cluster.running("web"))
    assert after == before
    # And it keeps reconciling: one more replica gets placed.
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 4)))
    await eventually(lambda: running_on(cluster, "web", 4))
    names = [i.name for i in await cluster.running("web")]
    assert len(set(names)) == 4


async def test_delete_removes_finished_tasks_from_nodes(cluster: Cluster) -> None:
    assert cluster.api is not None
    finished = spec("job", 2)
    finished.restart_policy = pb.WorkloadSpec.NEVER
    finished.env["FAKE_EXIT_AFTER"] = "0.05"
    finished.env["FAKE_EXIT_CODE"] = "3"
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=finished))

    async def failed() -> bool:
        insts = await cluster.instances("job")
        return len(insts) == 2 and all(i.phase == pb.Instance.FAILED for i in insts)

    await eventually(failed)
    insts = await cluster.instances("job")
    assert {i.exit_code for i in insts} == {3}
    assert sum(len(a.instances) for a in cluster.agents.values()) == 2
    await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="job"))

    async def forgotten() -> bool:
        return sum(len(a.instances) for a in cluster.agents.values()) == 0

    await eventually(forgotten)
