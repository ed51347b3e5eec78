"""Process workload isolation through the whole cluster: the agent's admission of a workload's
user, and an OOM kill reported back to the API (real agents, real processes, real cgroups)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from tests.cgroups import detect_mounts, remove_cgroup_parent, unique_parent
from tests.integration.cluster import Cluster, eventually

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or detect_mounts()[0] == 0,
    reason="needs root and a writable memory+cpu cgroup hierarchy, as a production agent has",
)


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    """node-1 keeps the default (no root workloads); node-2's operator allows them."""
    parent = unique_parent()
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        await c.add_agent("node-1", runtimes=["process"], cgroup_parent=f"{parent}/node-1")
        await c.add_agent(
            "node-2",
            runtimes=["process"],
            cgroup_parent=f"{parent}/node-2",
            allow_root_workloads=True,
        )
        yield c
    finally:
        await c.stop()
        for node in ("node-1", "node-2"):
            remove_cgroup_parent(f"{parent}/{node}")


def _spec(name: str, **fields: object) -> pb.WorkloadSpec:
    spec = pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=1,
        resources=pb.Resources(cpu_millis=100, memory_bytes=64 << 20),
    )
    for key, value in fields.items():
        if isinstance(value, dict):
            getattr(spec, key).update(value)
        elif isinstance(value, list):
            del getattr(spec, key)[:]
            getattr(spec, key).extend(value)
        elif isinstance(value, pb.Resources):
            getattr(spec, key).CopyFrom(value)
        else:
            setattr(spec, key, value)
    return spec


async def test_root_workload_only_where_the_operator_allows_it(cluster: Cluster) -> None:
    assert cluster.api is not None
    # Pinned to node-1, which does not allow root: refused with the agent's reason.
    pinned = _spec("pinned", user="root", node_selector={"orka.io/node": "node-1"})
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))

    async def reasons() -> list[str] | None:
        assert cluster.api is not None
        w = await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="pinned"))
        return list(w.status.unschedulable_reasons) or None

    # (node-2 is filtered out by the selector; how the scheduler words that is not ours.)
    [reason] = await eventually(reasons)
    assert (
        "1 node: refused: user 'root' is root and this node does not allow root workloads"
        " (the agent's --allow-root-workloads)"
    ) in reason
    assert await cluster.running("pinned") == []

    # Free to go anywhere: every replica lands on node-2, the only node that takes it.
    free = _spec("free", user="root", replicas=2)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=free))

    async def two() -> list[pb.Instance] | None:
        r = await cluster.running("free")
        return r if len(r) == 2 else None

    assert {i.node for i in await eventually(two)} == {"node-2"}


async def test_unknown_user_is_refused_not_a_crash(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=_spec("ghost", user="ghost9")))

    async def reasons() -> list[str] | None:
        assert cluster.api is not None
        w = await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="ghost"))
        return list(w.status.unschedulable_reasons) or None

    assert await eventually(reasons) == [
        "2 nodes: refused: user 'ghost9' does not exist on this node"
    ]
    # Both agents still serve: a workload as their default user runs.
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=_spec("plain")))
    assert await eventually(lambda: cluster.running("plain"))


async def test_oom_kill_reported_through_the_api(cluster: Cluster) -> None:
    assert cluster.api is not None
    spec = _spec(
        "hog",
        command=["tail", "/dev/zero"],  # buffers an endless line
        resources=pb.Resources(cpu_millis=100, memory_bytes=32 << 20),
        restart_policy=pb.WorkloadSpec.NEVER,
    )
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))

    async def failed() -> pb.Instance | None:
        insts = await cluster.instances("hog")
        return insts[0] if insts and insts[0].phase == pb.Instance.FAILED else None

    inst = await eventually(failed, timeout=30)
    assert inst.reason == "OOMKilled"
    assert inst.exit_code == 137
    assert "OOM killer" in inst.message


async def test_oom_killed_instance_is_restarted_by_its_policy(cluster: Cluster) -> None:
    assert cluster.api is not None
    spec = _spec(
        "hog",
        command=["tail", "/dev/zero"],
        resources=pb.Resources(cpu_millis=100, memory_bytes=32 << 20),
        restart_policy=pb.WorkloadSpec.ON_FAILURE,
    )
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))

    async def backing_off() -> pb.Instance | None:
        insts = await cluster.instances("hog")
        if insts and insts[0].reason == "BackOff" and insts[0].message.startswith("OOMKilled"):
            return insts[0]
        return None

    # Exit code 137 is a failure: ON_FAILURE restarts it, saying why it died.
    inst = await eventually(backing_off, timeout=30)
    assert inst.phase == pb.Instance.STARTING
    assert "restarting in" in inst.message
