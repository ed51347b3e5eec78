"""Volumes in placement on a real in-process cluster (two agents, fake runtime): an instance
waits for a volume that does not exist, goes where its volume is bound and nowhere else, every
time it is deleted and made again; per-replica template volumes follow their replica."""

from __future__ import annotations

import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.agent.service import Agent
from orka.agent.stream import Stream
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.controller.placement import PlacementConfig
from orka.controller.repo import Change
from orka.models import Volume, VolumeSpec
from tests.integration.cluster import Cluster, eventually

MIB = 1 << 20


class _VolumeStream(Stream):
    """Announces the node's pool (from its `pool` label) and, when the agent announces none
    itself (before its volume manager: the vol-agent slice), an ext4 backend with 1 GiB."""

    def register_message(self) -> apb.AgentMessage:
        msg = super().register_message()
        node = msg.register.node
        node.pool = self.labels.get("pool", "default")
        if not node.volume_backends:
            node.volume_backends.append("ext4")
            node.volume_capacity_bytes = 1 << 30
        return msg


class _VolumeAgent(Agent):
    stream_class = _VolumeStream


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, offer_timeout=2.0)
    await c.scheduler.start()
    # Retries after a long backoff only: what places a waiting instance is its volume changing.
    await c.start_controller(placement=PlacementConfig(backoff_start=60.0, backoff_max=60.0))
    try:
        for name, pool in (("node-1", "a"), ("node-2", "b")):
            await c.add_agent(name, _VolumeAgent, runtimes=["fake"], labels={"pool": pool})
        yield c
    finally:
        await c.stop()
        _unmount_under(tmp_path)


def _unmount_under(root: Path) -> None:
    """An agent with a volume manager mounts real ext4 volumes under its data dir, and keeps
    them across its own restarts: the test takes them down (and their loop devices)."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", "-d", point], check=False, capture_output=True)


def spec(name: str, replicas: int = 1, **kw: object) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=replicas,
        resources=pb.Resources(cpu_millis=10, memory_bytes=MIB),
        **kw,  # type: ignore[arg-type]
    )


async def make_volume(c: Cluster, name: str, pool: str = "", node: str = "") -> None:
    """A volume as CreateVolume (the vol-api slice) stores it: PENDING on no node; or one
    already bound to `node`."""
    assert c.controller is not None
    vol = Volume(spec=VolumeSpec(name=name, size_bytes=64 * MIB, pool=pool), node=node)
    await c.controller.api.repo.mutate(lambda: [Change("volumes", name, vol, create=True)])


def volume(c: Cluster, name: str) -> Volume | None:
    assert c.controller is not None
    return c.controller.api.repo.volumes.get(name)


async def running_on(c: Cluster, workload: str, replicas: int) -> dict[int, str] | None:
    """Ordinal -> node of the workload's RUNNING instances, once all `replicas` run."""
    running = await c.running(workload)
    if len(running) != replicas:
        return None
    return {i.ordinal: i.node for i in running}


async def recreate(c: Cluster, s: pb.WorkloadSpec) -> None:
    assert c.api is not None
    await c.api.DeleteWorkload(pb.DeleteWorkloadRequest(name=s.name))

    async def gone() -> bool:
        assert c.api is not None
        try:
            await c.api.GetWorkload(pb.GetWorkloadRequest(name=s.name))
        except grpc.aio.AioRpcError as err:
            return err.code() == grpc.StatusCode.NOT_FOUND
        return False

    await eventually(gone)
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=s))


async def test_instances_follow_their_volumes_and_wait_for_missing_ones(cluster: Cluster) -> None:
    c = cluster
    assert c.api is not None
    started = time.monotonic()
    db = spec("db", volumes=[pb.VolumeMount(volume="data-1", mount_path="/data")])
    # 1. The volume does not exist: the workload is stored, its instance waits and says why.
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=db))

    async def waiting() -> pb.Instance | None:
        insts = await c.instances("db")
        return insts[0] if insts and insts[0].reason == "VolumeUnavailable" else None

    inst = await eventually(waiting)
    assert (inst.phase, inst.node, inst.message) == (
        pb.Instance.PENDING,
        "",
        "volume data-1 does not exist",
    )
    # 2. Made: the instance is placed at once (not after its backoff), and the volume is bound
    # to its node in the same write.
    await make_volume(c, "data-1")
    placed = await eventually(lambda: running_on(c, "db", 1), timeout=10)
    home = placed[0]
    vol = volume(c, "data-1")
    assert vol is not None
    assert (vol.node, vol.backend, vol.pool) == (home, "ext4", "a" if home == "node-1" else "b")
    other = "node-2" if home == "node-1" else "node-1"
    # Load on the volume's node, so that everything else would rank the other node first.
    filler = spec("filler", replicas=3)
    filler.node_selector["pool"] = vol.pool
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=filler))
    await eventually(lambda: running_on(c, "filler", 3))
    # 3. Deleted and made again, several times: always the volume's node, never the other.
    for _ in range(3):
        await recreate(c, db)
        assert await eventually(lambda: running_on(c, "db", 1)) == {0: home}
        # One instance, the one on the volume's node: none was tried elsewhere.
        assert [(i.node, i.phase) for i in await c.instances("db")] == [(home, pb.Instance.RUNNING)]
        assert not [n for n in c.agents[other].instances if n.startswith("db-")]
    # 4. Per-replica volumes: made at first use (named after template, workload, ordinal),
    # bound where their replica went, and each replica goes back to its own after re-creation.
    tpl = pb.VolumeTemplate(name="cache", size_bytes=8 * MIB, mount_path="/cache")
    kv = spec("kv", replicas=2, max_per_node=1, volume_template=tpl)
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=kv))
    first = await eventually(lambda: running_on(c, "kv", 2))
    assert sorted(first) == [0, 1] and sorted(first.values()) == ["node-1", "node-2"]
    for n in (0, 1):
        v = volume(c, f"cache-kv-{n}")
        assert v is not None
        assert (v.node, v.workload, v.ordinal, v.spec.size_bytes) == (first[n], "kv", n, 8 * MIB)
    # Made again without the spread rule: each replica still goes to its own volume's node.
    kv2 = spec("kv", replicas=2, volume_template=tpl)
    await recreate(c, kv2)
    assert await eventually(lambda: running_on(c, "kv", 2)) == first
    # A rolling update (surge 1) replaces each replica beside its predecessor, on its volume's
    # node (ext4: shared there), and completes: no deadlock on the pinned volumes.
    kv2.env["REVISION"] = "2"
    await c.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=kv2))

    async def rolled() -> bool:
        assert c.api is not None
        w = await c.api.GetWorkload(pb.GetWorkloadRequest(name="kv"))
        return w.rollout.state == pb.RolloutStatus.COMPLETE and w.rollout.revision == 2

    await eventually(rolled)
    now = await c.running("kv")
    assert {i.ordinal: (i.node, i.generation) for i in now} == {
        n: (node, 2) for n, node in first.items()
    }
    # 5. A volume asking for a pool no node is in: unschedulable, saying so for every node.
    await make_volume(c, "data-2", pool="gpu")
    await c.api.CreateWorkload(
        pb.CreateWorkloadRequest(spec=spec("gpu", volumes=[pb.VolumeMount(volume="data-2")]))
    )

    async def reasons(workload: str) -> list[str] | None:
        assert c.api is not None
        w = await c.api.GetWorkload(pb.GetWorkloadRequest(name=workload))
        return list(w.status.unschedulable_reasons) or None

    assert await eventually(lambda: reasons("gpu")) == ["2 nodes: volume data-2 needs pool gpu"]
    vol2 = volume(c, "data-2")
    assert vol2 is not None and vol2.node == ""
    # 6. An instance asking for pool a whose volume lives on node-2 (pool b): both reasons.
    await make_volume(c, "data-3", node="node-2")
    pinned = spec("pinned", pool="a", volumes=[pb.VolumeMount(volume="data-3")])
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))
    assert await eventually(lambda: reasons("pinned")) == [
        "1 node: node is in pool b; 1 node: volume data-3 lives on node-2"
    ]
    print(f"scenario took {time.monotonic() - started:.1f}s")
