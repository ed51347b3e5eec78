"""Offer-until-accept placement on real grpc.aio servers with mutual TLS."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.agent.admission import Admission
from orka.agent.service import Agent
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.models import WorkloadSpec
from tests.integration.cluster import Cluster, eventually

MI = 1 << 20


class RefusingAdmission(Admission):
    """An agent's own admission check that says no, whatever the scheduler believes."""

    def admit(self, name: str, spec: WorkloadSpec) -> str | None:
        return "disk image missing"


class RefusingAgent(Agent):
    admission_class = RefusingAdmission


class SilentAdmission(Admission):
    """Never answers offers, so every offer to the agent times out."""

    def on_offer(self, offer: apb.Offer) -> None:
        return None


class SilentAgent(Agent):
    admission_class = SilentAdmission


def spec(name: str, replicas: int = 1, cpu: int = 100, **kw: object) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=replicas,
        resources=pb.Resources(cpu_millis=cpu, memory_bytes=16 * MI),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, offer_timeout=0.5)
    await c.start(agents=0)
    yield c
    await c.stop()


async def add(c: Cluster, name: str, cls: type[Agent] = Agent, cpu: int = 1000) -> Agent:
    return await c.add_agent(name, cls=cls, runtimes=["fake"], cpu_millis=cpu, memory_bytes=1 << 30)


async def unschedulable(c: Cluster, workload: str) -> list[str] | None:
    assert c.api is not None
    w = await c.api.GetWorkload(pb.GetWorkloadRequest(name=workload))
    return list(w.status.unschedulable_reasons) or None


async def _placed_past(c: Cluster, first: type[Agent]) -> list[pb.Instance]:
    """A roomy node-1 of class `first` (spread ranks it first) and a small ordinary node-2;
    one replica of "web", returned once RUNNING."""
    await add(c, "node-1", first, cpu=4000)
    await add(c, "node-2", cpu=1000)
    assert c.api is not None
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))
    return await eventually(lambda: c.running("web"))


async def test_refusal_moves_on_to_the_next_node(cluster: Cluster) -> None:
    # node-1 has the most free room, so spread ranks it first; it refuses.
    running = await _placed_past(cluster, RefusingAgent)
    assert [i.node for i in running] == ["node-2"]


async def test_all_refuse_gives_reasons_per_node(cluster: Cluster) -> None:
    await add(cluster, "node-1", RefusingAgent)
    await add(cluster, "node-2", RefusingAgent)
    await add(cluster, "node-3", cpu=50)  # filtered out by the scheduler: too small
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))
    reasons = await eventually(lambda: unschedulable(cluster, "web"))
    assert reasons == [
        "2 nodes: refused: disk image missing; 1 node: cpu request exceeds node capacity"
    ]
    insts = await cluster.instances("web")
    assert [i.phase for i in insts] == [pb.Instance.PENDING]
    assert insts[0].reason == "Unschedulable"


async def test_offer_timeout_moves_on(cluster: Cluster) -> None:
    running = await _placed_past(cluster, SilentAgent)
    assert [i.node for i in running] == ["node-2"]


async def test_only_silent_nodes_report_timeouts(cluster: Cluster) -> None:
    await add(cluster, "node-1", SilentAgent)
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))
    reasons = await eventually(lambda: unschedulable(cluster, "web"))
    assert reasons == ["1 node: offer timed out"]


async def test_concurrent_placements_never_overbook(cluster: Cluster) -> None:
    for i in range(1, 4):
        await add(cluster, f"node-{i}", cpu=1000)
    assert cluster.api is not None
    # 20 instances of 300m over 3 nodes of 1000m: exactly 3 fit per node.
    await asyncio.gather(
        *(
            cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(f"w{i}", 4, cpu=300)))
            for i in range(5)
        )
    )

    async def settled() -> list[pb.Instance] | None:
        insts = await cluster.instances()
        running = [i for i in insts if i.phase == pb.Instance.RUNNING]
        pending = [i for i in insts if i.phase == pb.Instance.PENDING and i.message]
        return running if len(running) + len(pending) == 20 and len(running) == 9 else None

    running = await eventually(settled)
    per_node = Counter(i.node for i in running)
    assert per_node == {"node-1": 3, "node-2": 3, "node-3": 3}
    for name, agent in cluster.agents.items():
        assert agent.admission.allocated().cpu_millis <= 1000, name


async def test_spread_rule_places_one_per_node(cluster: Cluster) -> None:
    for i in range(1, 3):
        await add(cluster, f"node-{i}")
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3, max_per_node=1)))
    reasons = await eventually(lambda: unschedulable(cluster, "web"))
    assert reasons == ["2 nodes: spread: 1 replica already on node"]
    running = await cluster.running("web")
    assert sorted(i.node for i in running) == ["node-1", "node-2"]
