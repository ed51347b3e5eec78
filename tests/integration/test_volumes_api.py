"""The Volume resource end to end on a real in-process controller and scheduler: create, get,
list, delete, bad input, and what the controller makes of an agent's volume reports (node
lost and back), with a scripted agent speaking the real agent protocol over mutual TLS."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from google.rpc import code_pb2

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.controller.repo import Change
from orka.models import Volume, VolumeSpec, VolumeState
from orka.rpc.client import secure_channel
from orka.security.tls import TlsFiles
from tests.integration.cluster import Cluster, eventually, process_spec
from tests.integration.orka_cli import orka

MI = 1 << 20


class ScriptedAgent:
    """An agent that holds the volumes a test says it holds: it registers with them, reports
    changes when told, and answers volume commands (refusing deletes of held volumes)."""

    def __init__(self, cluster: Cluster, certs: Path, name: str) -> None:
        self.name = name
        self.target = f"127.0.0.1:{cluster.scheduler.port}"
        self.tls = TlsFiles.for_service(certs, "agent", name)
        self.volumes: dict[str, apb.VolumeStatus] = {}
        self.commands: list[apb.SchedulerMessage] = []
        self.registered = asyncio.Event()
        self._outbox: asyncio.Queue[apb.AgentMessage] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.registered.clear()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._task

    def report(self, name: str, state: int, attached_to: tuple[str, ...] = ()) -> None:
        status = apb.VolumeStatus(
            name=name, state=state, size_bytes=64 * MI, backend="ext4", attached_to=attached_to
        )
        self.volumes[name] = status
        self._outbox.put_nowait(apb.AgentMessage(volume_status=status))

    async def _run(self) -> None:
        async with secure_channel(self.target, self.tls, "scheduler") as channel:
            call = apb_grpc.SchedulerStub(channel).Connect(self._messages())
            async for msg in call:
                for m in msg.batch.messages if msg.HasField("batch") else [msg]:
                    self._on(m)

    async def _messages(self) -> AsyncIterator[apb.AgentMessage]:
        yield apb.AgentMessage(
            register=apb.Register(
                node=apb.NodeInfo(
                    capacity=pb.Resources(cpu_millis=1000, memory_bytes=1 << 30),
                    allocatable=pb.Resources(cpu_millis=1000, memory_bytes=1 << 30),
                    drivers=["fake"],
                    volume_backends=["ext4"],
                    volume_capacity_bytes=1 << 30,
                ),
                volumes=list(self.volumes.values()),
            )
        )
        while True:
            try:
                yield await asyncio.wait_for(self._outbox.get(), 0.2)
            except TimeoutError:
                yield apb.AgentMessage(heartbeat=apb.Heartbeat())

    def _on(self, m: apb.SchedulerMessage) -> None:
        which = m.WhichOneof("body")
        if which == "registered":
            self.registered.set()
        elif which == "delete_volume":
            self.commands.append(m)
            held = self.volumes.get(m.delete_volume.volume)
            status = apb.CommandAck(command_id=m.delete_volume.command_id)
            status.status.code = code_pb2.OK
            if held is not None and held.attached_to:
                status.status.code = code_pb2.FAILED_PRECONDITION
                status.status.message = f"held by {held.attached_to[0]}"
            else:
                self.volumes.pop(m.delete_volume.volume, None)
            self._outbox.put_nowait(apb.AgentMessage(ack=status))
        elif which == "provision_volume":
            self.commands.append(m)
            ack = apb.CommandAck(command_id=m.provision_volume.command_id)
            ack.status.code = code_pb2.OK
            self._outbox.put_nowait(apb.AgentMessage(ack=ack))


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, heartbeat_interval=0.2, node_lost_after=1.0)
    try:
        await c.start(agents=0)
        yield c
    finally:
        await c.stop()


async def _error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def test_volume_lifecycle(cluster: Cluster, certs_dir: Path) -> None:
    api = cluster.api
    controller = cluster.controller
    assert api is not None and controller is not None
    repo = controller.api.repo
    for cls in (
        pb.Class(
            name="fast", volume=pb.Class.Volume(min_size_bytes=16 * MI, max_size_bytes=256 * MI)
        ),
        pb.Class(name="now", volume=pb.Class.Volume(immediate=True, backends=["ext4"])),
        pb.Class(name="small", compute=pb.Class.Compute(resources=pb.Resources(cpu_millis=100))),
    ):
        await api.CreateClass(pb.CreateClassRequest(spec=cls))

    agent = ScriptedAgent(cluster, certs_dir, "node-1")
    agent.start()
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        await eventually(lambda: _known(repo, "node-1"))

        # Create, get, list.
        made = await api.CreateVolume(
            pb.CreateVolumeRequest(
                spec=pb.VolumeSpec(name="data-1", size_bytes=64 * MI, class_name="fast")
            )
        )
        assert (made.spec.name, made.state, made.node) == ("data-1", pb.Volume.PENDING, "")
        assert made.created_by and made.etag and made.revision > 0
        got = await api.GetVolume(pb.GetVolumeRequest(name="data-1"))
        assert got == made

        # Bad input: a clear error naming the field, nothing stored.
        bad = [
            (pb.VolumeSpec(name="x", size_bytes=64 * MI, class_name="nope"), "spec.class_name"),
            (pb.VolumeSpec(name="x", size_bytes=8 * MI, class_name="fast"), "spec.size_bytes"),
            (pb.VolumeSpec(name="x", size_bytes=512 * MI, class_name="fast"), "spec.size_bytes"),
            (pb.VolumeSpec(name="x", size_bytes=1), "spec.size_bytes"),
            (pb.VolumeSpec(name="X!", size_bytes=64 * MI), "spec.name"),
            (pb.VolumeSpec(name="x", size_bytes=64 * MI, backend="zfs"), "spec.backend"),
            (pb.VolumeSpec(name="x", size_bytes=64 * MI, class_name="small"), "spec.class_name"),
            (pb.VolumeSpec(name="x", size_bytes=2 << 30), "spec.size_bytes: 2Gi is larger than"),
        ]
        for spec, field in bad:
            err = await _error(api.CreateVolume(pb.CreateVolumeRequest(spec=spec)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (spec, err.details())
            assert err.details().startswith(field), (spec, err.details())
        err = await _error(api.CreateVolume(pb.CreateVolumeRequest(spec=made.spec)))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        listed = await api.ListVolumes(pb.ListVolumesRequest())
        assert [v.spec.name for v in listed.volumes] == ["data-1"]

        # A class with `immediate`: placed on a node and provisioned there at once.
        await api.CreateVolume(
            pb.CreateVolumeRequest(
                spec=pb.VolumeSpec(name="early", size_bytes=64 * MI, class_name="now")
            )
        )
        sent = await eventually(
            lambda: _async([c for c in agent.commands if c.HasField("provision_volume")])
        )
        att = sent[0].provision_volume.volume
        assert (att.name, att.node, att.backend, att.size_bytes) == (
            "early",
            "node-1",
            "ext4",
            64 * MI,
        )
        agent.report("early", pb.Volume.AVAILABLE)
        v = await eventually(lambda: _state(api, "early", pb.Volume.AVAILABLE))
        assert (v.node, v.pool, v.backend) == ("node-1", "default", "ext4")
        await api.DeleteVolume(pb.DeleteVolumeRequest(name="early"))
        await eventually(lambda: _absent(api, "early"))
        agent.commands.clear()

        # Placement binds it to node-1 (the vol-place slice's job; written here as it does).
        vol = repo.volumes["data-1"]
        bound = vol.model_copy(update={"node": "node-1", "pool": "default", "backend": "ext4"})
        await repo.mutate(lambda: [Change("volumes", "data-1", bound)])
        page = await api.ListVolumes(pb.ListVolumesRequest(node="node-1"))
        assert [v.spec.name for v in page.volumes] == ["data-1"]
        assert not (await api.ListVolumes(pb.ListVolumesRequest(node="node-2"))).volumes

        # The agent's reports become the volume's state.
        agent.report("data-1", pb.Volume.AVAILABLE)
        await eventually(lambda: _state(api, "data-1", pb.Volume.AVAILABLE))
        agent.report("data-1", pb.Volume.ATTACHED, ("web-abc",))
        v = await eventually(lambda: _state(api, "data-1", pb.Volume.ATTACHED))
        assert list(v.attached_to) == ["web-abc"]

        # Deleting an ATTACHED volume: FAILED_PRECONDITION, nothing changed, nothing sent.
        err = await _error(api.DeleteVolume(pb.DeleteVolumeRequest(name="data-1")))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ATTACHED" in err.details()
        assert await api.GetVolume(pb.GetVolumeRequest(name="data-1")) == v
        assert not [c for c in agent.commands if c.HasField("delete_volume")]

        # Its node lost: LOST; back with the volume: its reported state again.
        await agent.stop()
        v = await eventually(lambda: _state(api, "data-1", pb.Volume.LOST), timeout=10)
        assert "node-1 is lost" in v.message and not v.attached_to
        agent.volumes["data-1"] = apb.VolumeStatus(
            name="data-1", state=pb.Volume.AVAILABLE, size_bytes=64 * MI, backend="ext4"
        )
        agent.start()
        v = await eventually(lambda: _state(api, "data-1", pb.Volume.AVAILABLE), timeout=10)
        assert v.message == ""

        # A stale etag is ABORTED; then a delete goes to its node and the record goes on OK.
        err = await _error(api.DeleteVolume(pb.DeleteVolumeRequest(name="data-1", etag="x")))
        assert err.code() == grpc.StatusCode.ABORTED
        gone = await api.DeleteVolume(pb.DeleteVolumeRequest(name="data-1", etag=v.etag))
        assert gone.state == pb.Volume.DELETING
        await eventually(lambda: _absent(api, "data-1"))
        sent = [c.delete_volume.volume for c in agent.commands if c.HasField("delete_volume")]
        assert sent == ["data-1"]
        assert "data-1" not in agent.volumes

        # Never provisioned (PENDING, no node): removed at once, nothing sent.
        await api.CreateVolume(
            pb.CreateVolumeRequest(spec=pb.VolumeSpec(name="data-2", size_bytes=64 * MI))
        )
        await api.DeleteVolume(pb.DeleteVolumeRequest(name="data-2"))
        err = await _error(api.GetVolume(pb.GetVolumeRequest(name="data-2")))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert len([c for c in agent.commands if c.HasField("delete_volume")]) == 1

        # Deleting a workload keeps its volumes (a template one is RELEASED) unless asked.
        for name, workload in (("keep", ""), ("t-db-0", "db"), ("drop", "")):
            made = Volume(
                spec=VolumeSpec(name=name, size_bytes=64 * MI),
                state=VolumeState.AVAILABLE,
                node="node-1",
                workload=workload,
            )
            await repo.mutate(lambda made=made: [Change("volumes", made.name, made, create=True)])
            agent.report(name, pb.Volume.AVAILABLE)
        mounts = [pb.VolumeMount(volume="keep")]
        await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec("db", volumes=mounts)))
        await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="db"))
        await eventually(lambda: _state(api, "t-db-0", pb.Volume.RELEASED))
        assert (await api.GetVolume(pb.GetVolumeRequest(name="keep"))).state == pb.Volume.AVAILABLE
        mounts = [pb.VolumeMount(volume="keep"), pb.VolumeMount(volume="drop")]
        for name in ("a", "b"):
            spec = process_spec(name, volumes=mounts[: 1 if name == "b" else 2])
            await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
        await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="a", with_volumes=True))
        await eventually(lambda: _absent(api, "drop"))
        # `keep` is named by workload b too: kept.
        assert (await api.GetVolume(pb.GetVolumeRequest(name="keep"))).state == pb.Volume.AVAILABLE
        assert "drop" not in agent.volumes and "keep" in agent.volumes

        # The CLI: apply a kind: volume, get, describe, delete.
        doc = b"kind: volume\nname: logs\nsize: 32Mi\nclass: fast\n"
        code, out, err = await orka(cluster, "apply", "-f", "-", stdin=doc)
        assert (code, out, err) == (0, b"volume/logs created\n", b"")
        code, out, _ = await orka(cluster, "apply", "-f", "-", stdin=doc.replace(b"32", b"48"))
        assert code == 1
        code, out, _ = await orka(cluster, "get", "volumes")
        assert out.decode().splitlines() == [
            "NAME     SIZE   STATE       NODE     BACKEND   ATTACHED",
            "keep     64Mi   AVAILABLE   node-1   ext4      <none>",
            "logs     32Mi   PENDING     <none>   <none>    <none>",
            "t-db-0   64Mi   RELEASED    node-1   ext4      <none>",
        ]
        code, out, _ = await orka(cluster, "get", "volumes", "--workload", "db", "-o", "yaml")
        assert [v["spec"]["name"] for v in yaml.safe_load(out)] == ["t-db-0"]
        code, out, _ = await orka(cluster, "describe", "volume", "keep")
        assert "Data lives on node node-1's disk only" in out.decode()
        code, out, err = await orka(cluster, "delete", "volume", "keep", "--wait")
        assert code == 0, err
        assert out.decode().splitlines()[-1] == "volume/keep deleted"
        code, out, _ = await orka(cluster, "get", "volume", "logs", "-o", "json")
        assert json.loads(out)["spec"]["size_bytes"] == 32 * MI
    finally:
        await agent.stop()


async def _async(value: object) -> object:
    return value


async def _known(repo: object, node: str) -> bool:
    return node in repo.nodes  # type: ignore[attr-defined]


async def _state(api: object, name: str, state: int) -> pb.Volume | None:
    v = await api.GetVolume(pb.GetVolumeRequest(name=name))  # type: ignore[attr-defined]
    return v if v.state == state else None


async def _absent(api: object, name: str) -> bool:
    try:
        await api.GetVolume(pb.GetVolumeRequest(name=name))  # type: ignore[attr-defined]
    except grpc.aio.AioRpcError as err:
        return err.code() == grpc.StatusCode.NOT_FOUND
    return False
