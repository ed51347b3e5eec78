"""The agent's VolumeManager on a backend the test controls: states reported, provisioning
shared, failures kept to the volume, deletes refused while held."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from google.rpc import code_pb2, status_pb2

from orka.agent.volumes import VolumeManager
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import RuntimeFailure
from orka.models import VolumeAttachment, VolumeState, WorkloadKind
from orka.runtime.volumes import ProvisionedVolume

MIB = 1 << 20


class HandBackend:
    """Provisions when the test says so (`gate`), or fails with `fail`; counts calls."""

    name = "ext4"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = ""
        self.provisions: list[str] = []
        self.deleted: list[str] = []
        self.held: list[ProvisionedVolume] = []

    def unavailable(self) -> str | None:
        return None

    async def provision(self, name: str, size_bytes: int) -> ProvisionedVolume:
        self.provisions.append(name)
        await self.gate.wait()
        if self.fail:
            raise RuntimeFailure(self.fail)
        return ProvisionedVolume(
            name=name, backend=self.name, size_bytes=size_bytes, host_path=self.root / name
        )

    async def adopt(self) -> list[ProvisionedVolume]:
        return self.held

    async def delete(self, name: str) -> None:
        self.deleted.append(name)

    def capacity_bytes(self) -> int:
        return 0


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.backend = HandBackend(tmp_path)
        self.sent: list[apb.AgentMessage] = []
        self.acks: dict[str, status_pb2.Status] = {}
        self.manager = VolumeManager(
            tmp_path / "volumes",
            send=self.sent.append,
            ack=self.acks.__setitem__,
            backends={"ext4": self.backend},
        )

    def states(self, name: str) -> list[tuple[str, list[str], str]]:
        return [
            (
                pb.Volume.State.Name(m.volume_status.state),
                list(m.volume_status.attached_to),
                m.volume_status.message,
            )
            for m in self.sent
            if m.volume_status.name == name
        ]

    async def ack(self, command_id: str) -> status_pb2.Status:
        for _ in range(100):
            if command_id in self.acks:
                return self.acks[command_id]
            await asyncio.sleep(0)
        raise AssertionError(f"no ack for {command_id}")


def vol(name: str = "data-1", backend: str = "ext4") -> VolumeAttachment:
    return VolumeAttachment(name=name, size_bytes=8 * MIB, backend=backend, mount_path="/d")


@pytest.fixture
async def h(tmp_path: Path) -> Harness:
    harness = Harness(tmp_path)
    await harness.manager.adopt()
    return harness


async def test_two_instances_share_one_provisioning_then_release(h: Harness) -> None:
    h.backend.gate.clear()
    a = asyncio.create_task(h.manager.acquire("web-0", WorkloadKind.PROCESS, [vol()]))
    b = asyncio.create_task(h.manager.acquire("web-1", WorkloadKind.PROCESS, [vol()]))
    await asyncio.sleep(0.01)
    assert not h.manager.ready([vol()])
    h.backend.gate.set()
    (ma,), (mb,) = await a, await b
    assert h.backend.provisions == ["data-1"]
    assert ma.host_path == mb.host_path == h.backend.root / "data-1"
    assert (ma.mount_path, ma.env_key) == ("/d", "ORKA_VOLUME_DATA_1")
    assert h.manager.ready([vol()])
    h.manager.release("web-0")
    h.manager.release("web-1")
    assert h.states("data-1") == [
        ("PENDING", [], ""),
        ("AVAILABLE", [], ""),
        ("ATTACHED", ["web-0"], ""),
        ("ATTACHED", ["web-0", "web-1"], ""),
        ("ATTACHED", ["web-1"], ""),
        ("AVAILABLE", [], ""),
    ]


async def test_a_failed_provisioning_fails_the_volume_and_is_tried_again(h: Harness) -> None:
    h.backend.fail = "volume data-1: mkfs.ext4 failed: no space"
    with pytest.raises(RuntimeFailure, match=r"mkfs\.ext4 failed: no space"):
        await h.manager.acquire("web-0", WorkloadKind.PROCESS, [vol()])
    assert h.states("data-1")[-1] == ("FAILED", [], "volume data-1: mkfs.ext4 failed: no space")
    assert h.manager.volumes["data-1"].holders == {}
    # The next start tries again (the cause may be gone).
    h.backend.fail = ""
    await h.manager.acquire("web-0", WorkloadKind.PROCESS, [vol()])
    assert h.backend.provisions == ["data-1", "data-1"]
    assert h.manager.volumes["data-1"].state is VolumeState.ATTACHED


async def test_unknown_backend_and_qcow2_taken_by_another_vm(h: Harness) -> None:
    with pytest.raises(RuntimeFailure, match=r"no qcow2 backend on this node \(offered: ext4\)"):
        await h.manager.acquire("vm-0", WorkloadKind.VM, [vol("disk-1", "qcow2")])
    h.manager.backends["qcow2"] = h.backend  # the hand backend stands in for qcow2 too
    h.manager.volumes.clear()
    await h.manager.acquire("vm-0", WorkloadKind.VM, [vol("disk-1", "qcow2")])
    with pytest.raises(RuntimeFailure, match="volume disk-1: in use by VM vm-0"):
        await h.manager.acquire("vm-1", WorkloadKind.VM, [vol("disk-1", "qcow2")])
    h.manager.release("vm-0")
    await h.manager.acquire("vm-1", WorkloadKind.VM, [vol("disk-1", "qcow2")])


async def test_delete_refused_while_held_then_done(h: Harness) -> None:
    await h.manager.acquire("web-0", WorkloadKind.PROCESS, [vol()])
    h.manager.on_delete(apb.DeleteVolume(command_id="d1", volume="data-1"))
    refused = await h.ack("d1")
    assert (refused.code, refused.message) == (
        code_pb2.FAILED_PRECONDITION,
        "volume data-1 is in use by web-0",
    )
    assert h.backend.deleted == []
    h.manager.release("web-0")
    h.manager.on_delete(apb.DeleteVolume(command_id="d2", volume="data-1"))
    assert (await h.ack("d2")).code == code_pb2.OK
    assert h.backend.deleted == ["data-1"]
    assert "data-1" not in h.manager.volumes
    assert h.states("data-1")[-1][0] == "DELETING"
    # A volume the node does not know: every backend makes sure it is gone; OK.
    h.manager.on_delete(apb.DeleteVolume(command_id="d3", volume="gone-1"))
    assert (await h.ack("d3")).code == code_pb2.OK
    assert h.backend.deleted == ["data-1", "gone-1"]


async def test_provision_command_acks_and_adopted_volumes_are_reported(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.backend.held = [
        ProvisionedVolume(name="old-1", backend="ext4", size_bytes=MIB, host_path=tmp_path)
    ]
    await h.manager.adopt()
    (old,) = h.manager.statuses()
    assert (old.name, old.state, old.size_bytes) == ("old-1", pb.Volume.AVAILABLE, MIB)
    msg = apb.ProvisionVolume(
        command_id="p1", volume=apb.VolumeAttachment(name="new-1", size_bytes=MIB, backend="ext4")
    )
    h.manager.on_provision(msg)
    assert (await h.ack("p1")).code == code_pb2.OK
    h.backend.fail = "broken"
    bad = apb.ProvisionVolume(
        command_id="p2", volume=apb.VolumeAttachment(name="bad-1", size_bytes=MIB, backend="ext4")
    )
    h.manager.on_provision(bad)
    failed = await h.ack("p2")
    assert (failed.code, failed.message) == (code_pb2.FAILED_PRECONDITION, "broken")
    assert {s.name: s.state for s in h.manager.statuses()} == {
        "old-1": pb.Volume.AVAILABLE,
        "new-1": pb.Volume.AVAILABLE,
        "bad-1": pb.Volume.FAILED,
    }


@pytest.mark.parametrize(
    ("name", "size", "message"),
    [
        ("../etc", 8 * MIB, "volume '../etc' must be"),
        ("data-1", 0, "volume data-1: size 0 is outside 1048576..1125899906842624 bytes"),
    ],
)
async def test_bad_attachments_are_refused_before_any_backend_call(
    h: Harness, name: str, size: int, message: str
) -> None:
    bad = VolumeAttachment(name=name, size_bytes=size, backend="ext4")
    with pytest.raises(RuntimeFailure, match=re.escape(message)):
        await h.manager.acquire("web-0", WorkloadKind.PROCESS, [bad])
    assert h.backend.provisions == [] and h.manager.volumes == {}
