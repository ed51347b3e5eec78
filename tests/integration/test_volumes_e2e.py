"""A volume's whole life through every part, on a real agent with a real ext4 loop mount: the
controller's records follow what the agent reports (PENDING, ATTACHED, AVAILABLE), a workload
deleted without --with-volumes leaves the data, and with it the node deletes the volume."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.runtime.volume_ext4 import Ext4Backend
from tests.integration.cluster import Cluster, eventually, process_spec

MI = 1 << 20

pytestmark = pytest.mark.skipif(
    bool(Ext4Backend(Path("/")).unavailable()), reason="ext4 volumes need root and loop devices"
)


@pytest.fixture
def volume_dir(tmp_path: Path) -> Iterator[Path]:
    # Under /tmp on purpose: the process instance's private /tmp must not hide it (the
    # launcher binds it back in), as for `orka up --data-dir /tmp/...`.
    path = tmp_path / "volumes"
    yield path
    asyncio.run(Ext4Backend(path / "ext4").unmount_all())


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path, volume_dir: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start(agents=0)
        await c.add_agent("node-1", runtimes=["process"], volume_dir=volume_dir)
        yield c
    finally:
        await c.stop()


async def test_volume_follows_the_real_agent_and_goes_with_its_workload(
    cluster: Cluster, volume_dir: Path
) -> None:
    api = cluster.api
    assert api is not None

    async def volume(state: int) -> pb.Volume | None:
        v = await api.GetVolume(pb.GetVolumeRequest(name="data-1"))
        return v if v.state == state else None

    await api.CreateVolume(
        pb.CreateVolumeRequest(spec=pb.VolumeSpec(name="data-1", size_bytes=16 * MI))
    )
    mounts = [pb.VolumeMount(volume="data-1")]
    script = 'echo kept > "$ORKA_VOLUME_DATA_1/note"; exec sleep 1000'
    spec = process_spec("web", replicas=1, volumes=mounts, command=["sh", "-c", script])
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
    v = await eventually(lambda: volume(pb.Volume.ATTACHED), timeout=30)
    (inst,) = await cluster.instances("web")
    assert (v.node, v.backend, list(v.attached_to)) == ("node-1", "ext4", [inst.name])
    note = volume_dir / "ext4" / "data-1" / "mnt" / "note"
    await eventually(lambda: _async(note.exists()))

    # Refused while in use: nothing changed on the node or in the record.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await api.DeleteVolume(pb.DeleteVolumeRequest(name="data-1"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await api.GetVolume(pb.GetVolumeRequest(name="data-1"))).state == pb.Volume.ATTACHED

    # The workload goes, the volume and its data stay (AVAILABLE once its instance let go).
    await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))
    await eventually(lambda: volume(pb.Volume.AVAILABLE), timeout=30)
    assert note.read_text() == "kept\n"

    # Back, then deleted with its volumes: the node deletes the volume and its data.
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
    await eventually(lambda: volume(pb.Volume.ATTACHED), timeout=30)
    await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web", with_volumes=True))
    await eventually(lambda: _gone(api), timeout=30)
    assert not (volume_dir / "ext4" / "data-1").exists()


async def _async(value: object) -> object:
    return value


async def _gone(api: object) -> bool:
    try:
        await api.GetVolume(pb.GetVolumeRequest(name="data-1"))  # type: ignore[attr-defined]
    except grpc.aio.AioRpcError as err:
        return err.code() == grpc.StatusCode.NOT_FOUND
    return False
