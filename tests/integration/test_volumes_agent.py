"""Volumes on a real agent: the scheduler's StartInstance carries Assignment.volumes, the agent
provisions them on real ext4 loop mounts before the instance starts, and reports each change.
(The controller's side comes with the placement slice: here the test sends the commands as the
controller would, through the scheduler's Command RPC, and reads the agent's messages.)"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2

from orka.agent.service import Agent
from orka.agent.supervisor import VOLUME_FAILED, VOLUME_PENDING
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.models import InstancePhase, VolumeState
from orka.rpc.client import secure_channel
from orka.runtime.volume_ext4 import Ext4Backend
from orka.security.tls import TlsFiles
from tests.containerd_env import Containerd, needs_containerd
from tests.integration.cluster import Cluster, crash, eventually
from tests.libvirt_env import DISK_MARKER, DOMAIN_TYPE, RUN, Guest, LibvirtDaemons, needs_libvirt

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    bool(Ext4Backend(Path("/")).unavailable()), reason="ext4 volumes need root and loop devices"
)


@pytest.fixture
def volume_dir() -> Iterator[Path]:
    # Not under /tmp: a process instance's private /tmp hides the host's.
    path = Path(tempfile.mkdtemp(prefix="orka-volumes-", dir="/var/tmp"))
    yield path
    asyncio.run(Ext4Backend(path / "ext4").unmount_all())
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, heartbeat_interval=0.5, node_lost_after=30.0)
    await c.scheduler.start()  # no controller: the test sends its commands
    try:
        yield c
    finally:
        await c.stop()


class Sent:
    """What an agent sends, kept (the stream still sends it)."""

    def __init__(self, agent: Agent) -> None:
        self.messages: list[apb.AgentMessage] = []
        send = agent.stream.send

        def keep(msg: apb.AgentMessage) -> None:
            self.messages.append(msg)
            send(msg)

        agent.stream.send = keep  # type: ignore[method-assign]

    def volume_states(self, name: str) -> list[str]:
        return [
            pb.Volume.State.Name(m.volume_status.state)
            for m in self.messages
            if m.HasField("volume_status") and m.volume_status.name == name
        ]

    def phases(self, instance: str) -> list[tuple[str, str]]:
        return [
            (pb.Instance.Phase.Name(m.instance_status.phase), m.instance_status.reason)
            for m in self.messages
            if m.HasField("instance_status") and m.instance_status.name == instance
        ]

    def ack(self, command_id: str) -> apb.CommandAck | None:
        acks = [m.ack for m in self.messages if m.HasField("ack")]
        return next((a for a in acks if a.command_id == command_id), None)


def attachment(
    name: str, size: int = 16 * MIB, backend: str = "ext4", mount_path: str = "", ro: bool = False
) -> apb.VolumeAttachment:
    return apb.VolumeAttachment(
        name=name,
        size_bytes=size,
        backend=backend,
        node="node-1",
        env_name=name,
        mount_path=mount_path,
        read_only=ro,
    )


def start(
    instance: str, script: str, *volumes: apb.VolumeAttachment, image: str = ""
) -> apb.NodeCommand:
    spec = pb.WorkloadSpec(
        name=instance.rsplit("-", 1)[0],
        kind=pb.WorkloadSpec.CONTAINER if image else pb.WorkloadSpec.PROCESS,
        image=image,
        command=["sh", "-c", script],
        restart_policy=pb.WorkloadSpec.NEVER,
        stop_grace_period=Duration(seconds=1),
        volumes=[
            pb.VolumeMount(volume=v.name, mount_path=v.mount_path, read_only=v.read_only)
            for v in volumes
            if v.mount_path
        ],
    )
    a = apb.Assignment(instance=instance, generation=1, spec=spec, volumes=volumes)
    return apb.NodeCommand(node="node-1", start=apb.StartInstance(assignment=a))


async def command(c: Cluster, *commands: apb.NodeCommand) -> list[apb.CommandResult]:
    tls = TlsFiles.for_service(c.certs, "controller", "controller")
    async with secure_channel(f"127.0.0.1:{c.scheduler.port}", tls, "scheduler") as channel:
        req = apb.CommandRequest(commands=commands)
        return list((await apb_grpc.SchedulerStub(channel).Command(req)).results)


async def phase_of(agent: Agent, instance: str, phase: InstancePhase) -> bool:
    inst = agent.instances.get(instance)
    return inst is not None and inst.phase is phase


async def test_process_writes_into_its_volume_through_the_agent(
    cluster: Cluster, volume_dir: Path
) -> None:
    agent = await cluster.add_agent(
        "node-1", runtimes=["process"], pool="blue", volume_dir=volume_dir
    )
    sent = Sent(agent)
    node = agent.stream.register_message().register.node
    assert (node.pool, list(node.volume_backends)) == ("blue", ["ext4", "qcow2"])
    assert node.volume_capacity_bytes > 16 * MIB

    # The instance finds its volume in ORKA_VOLUME_DATA_1 and writes there as its own user.
    # A read-only one beside it: its writes are refused (EROFS), its data readable.
    agent.volumes.on_provision(apb.ProvisionVolume(command_id="p-ro", volume=attachment("ref-1")))
    ack = await eventually(lambda: _async(sent.ack("p-ro")))
    assert ack.status.code == code_pb2.OK, ack.status.message
    (volume_dir / "ext4" / "ref-1" / "mnt" / "seed").write_text("seeded")
    script = (
        'echo hello > "$ORKA_VOLUME_DATA_1/note" && id -u > "$ORKA_VOLUME_DATA_1/uid"'
        ' && cat "$ORKA_VOLUME_REF_1/seed" > "$ORKA_VOLUME_DATA_1/seen"'
        ' && if touch "$ORKA_VOLUME_REF_1/nope" 2>"$ORKA_VOLUME_DATA_1/ro"; then :; fi; sleep 60'
    )
    ro = attachment("ref-1", ro=True)
    (done,) = await command(cluster, start("writer-0", script, attachment("data-1"), ro))
    assert done.status.code == code_pb2.OK, done.status.message
    await eventually(lambda: phase_of(agent, "writer-0", InstancePhase.RUNNING))
    mnt = volume_dir / "ext4" / "data-1" / "mnt"

    async def note() -> str:
        return (mnt / "note").read_text() if (mnt / "note").exists() else ""

    assert await eventually(note) == "hello\n"
    # The script's last step done (it refused or not):
    await eventually(lambda: _async((mnt / "ro").exists() and (mnt / "ro").stat().st_size))
    assert (mnt / "uid").read_text().strip() != "0"  # not root: the volume was given to it
    assert (mnt / "seen").read_text() == "seeded"
    assert "Read-only file system" in (mnt / "ro").read_text()
    assert not (volume_dir / "ext4" / "ref-1" / "mnt" / "nope").exists()
    # Its execs (orka exec, health checks) find the volume too.
    writer = agent.instances["writer-0"]
    cat = ["sh", "-c", 'cat "$ORKA_VOLUME_DATA_1/note"']
    assert await writer.driver.check_exec("writer-0", writer.spec, cat) == (0, "hello\n")
    # Provisioned before the start: the instance waited (VolumePending), then ran.
    assert sent.phases("writer-0")[0] == ("STARTING", VOLUME_PENDING)
    assert ("RUNNING", "") in sent.phases("writer-0")
    assert sent.volume_states("data-1") == ["PENDING", "AVAILABLE", "ATTACHED"]
    registered = agent.stream.register_message().register.volumes
    assert sorted((r.name, r.state, tuple(r.attached_to)) for r in registered) == [
        ("data-1", pb.Volume.ATTACHED, ("writer-0",)),
        ("ref-1", pb.Volume.ATTACHED, ("writer-0",)),
    ]

    # Deleting a volume in use is refused, nothing touched.
    agent.volumes.on_delete(apb.DeleteVolume(command_id="del-1", volume="data-1"))
    ack = await eventually(lambda: _async(sent.ack("del-1")))
    assert (ack.status.code, ack.status.message) == (
        code_pb2.FAILED_PRECONDITION,
        "volume data-1 is in use by writer-0",
    )
    assert (mnt / "note").exists()

    # Writing past its size fails inside the instance; the agent stays healthy.
    fill = 'dd if=/dev/zero of="$ORKA_VOLUME_DATA_1/big" bs=1M count=32 2>&1; exit $?'
    (done,) = await command(cluster, start("filler-0", fill, attachment("data-1")))
    assert done.status.code == code_pb2.OK
    await eventually(lambda: phase_of(agent, "filler-0", InstancePhase.FAILED))
    filler = agent.instances["filler-0"]
    assert filler.exit_code == 1 and filler.reason == "Error"
    log = filler.driver.log_paths("filler-0")[0].read_text()
    assert "No space left on device" in log
    assert agent.connected.is_set() and agent._failed is None
    (mnt / "big").unlink()

    # A volume the node cannot make: the instance FAILED with the reason, never started.
    (done,) = await command(
        cluster, start("odd-0", "touch /tmp/ran", attachment("odd-1", backend="zfs"))
    )
    await eventually(lambda: phase_of(agent, "odd-0", InstancePhase.FAILED))
    odd = agent.instances["odd-0"]
    assert (odd.reason, odd.message) == (
        VOLUME_FAILED,
        "volume odd-1: no zfs backend on this node (offered: ext4, qcow2)",
    )
    assert odd.started_at is None and "odd-0" not in {t.instance for t in await odd.driver.list()}
    assert sent.volume_states("odd-1") == ["PENDING", "FAILED"]

    # Stopped and removed: AVAILABLE again, then deleted with its data.
    stop = apb.NodeCommand(
        node="node-1", stop=apb.StopInstance(instance="writer-0", remove=True, reason="test")
    )
    await command(cluster, stop)
    await eventually(lambda: _async("writer-0" not in agent.instances))
    assert agent.volumes.volumes["data-1"].state is VolumeState.AVAILABLE
    agent.volumes.on_delete(apb.DeleteVolume(command_id="del-2", volume="data-1"))
    ack = await eventually(lambda: _async(sent.ack("del-2")))
    assert ack.status.code == code_pb2.OK, ack.status.message
    assert not (volume_dir / "ext4" / "data-1").exists()
    assert sent.volume_states("data-1")[-2:] == ["AVAILABLE", "DELETING"]
    # Long after: the instance whose volume failed was never started.
    assert (odd.phase, odd.reason, odd.started_at) == (InstancePhase.FAILED, VOLUME_FAILED, None)
    assert not odd.driver.log_paths("odd-0")[0].exists()


async def test_agent_restart_re_adopts_and_remounts_its_volumes(
    cluster: Cluster, volume_dir: Path
) -> None:
    agent = await cluster.add_agent("node-1", runtimes=["process"], volume_dir=volume_dir)
    sent = Sent(agent)
    agent.volumes.on_provision(apb.ProvisionVolume(command_id="p-1", volume=attachment("keep-1")))
    ack = await eventually(lambda: _async(sent.ack("p-1")))
    assert ack.status.code == code_pb2.OK, ack.status.message
    mnt = volume_dir / "ext4" / "keep-1" / "mnt"
    (mnt / "kept").write_text("still here")
    await agent.stop()
    del cluster.agents["node-1"]
    # As after a reboot: nothing mounted any more.
    await Ext4Backend(volume_dir / "ext4").unmount_all()
    assert not mnt.is_mount()

    again = await cluster.add_agent("node-1", runtimes=["process"], volume_dir=volume_dir)
    (reg,) = again.stream.register_message().register.volumes
    assert (reg.name, reg.state, reg.size_bytes, reg.backend) == (
        "keep-1",
        pb.Volume.AVAILABLE,
        16 * MIB,
        "ext4",
    )
    assert (mnt / "kept").read_text() == "still here"

    # An instance on it survives an agent crash: the next agent re-adopts both, and knows
    # from its state file that the instance holds the volume.
    (done,) = await command(cluster, start("holder-0", "exec sleep 60", attachment("keep-1")))
    assert done.status.code == code_pb2.OK, done.status.message
    await eventually(lambda: phase_of(again, "holder-0", InstancePhase.RUNNING))
    await crash(again)
    del cluster.agents["node-1"]
    third = await cluster.add_agent("node-1", runtimes=["process"], volume_dir=volume_dir)
    assert third.instances["holder-0"].phase is InstancePhase.RUNNING
    (reg,) = third.stream.register_message().register.volumes
    assert (reg.name, reg.state, list(reg.attached_to)) == (
        "keep-1",
        pb.Volume.ATTACHED,
        ["holder-0"],
    )
    stop = apb.NodeCommand(
        node="node-1", stop=apb.StopInstance(instance="holder-0", remove=True, reason="test")
    )
    await command(cluster, stop)
    await eventually(lambda: _async("holder-0" not in third.instances))
    assert third.volumes.volumes["keep-1"].state is VolumeState.AVAILABLE


@needs_containerd
async def test_container_volumes_rw_ro_and_size_limit(
    cluster: Cluster, volume_dir: Path, containerd: Containerd
) -> None:
    agent = await cluster.add_agent(
        "node-1",
        runtimes=["containerd"],
        driver_options={"containerd": containerd.options()},
        allowed_paths=containerd.allowed_paths(),
        volume_dir=volume_dir,
    )
    sent = Sent(agent)
    # The read-only one holds data already (made and filled before).
    agent.volumes.on_provision(apb.ProvisionVolume(command_id="p-1", volume=attachment("ref-1")))
    ack = await eventually(lambda: _async(sent.ack("p-1")))
    assert ack.status.code == code_pb2.OK, ack.status.message
    (volume_dir / "ext4" / "ref-1" / "mnt" / "seed").write_text("seeded\n")

    script = (
        "echo written > /data/out && cat /ref/seed"
        " && if touch /ref/nope 2>/dev/null; then echo ro-WRITABLE; else echo ro-refused; fi"
        " && dd if=/dev/zero of=/data/big bs=1M count=32 2>&1; echo dd-exit=$?; sleep 60"
    )
    rw, ro = (
        attachment("data-1", mount_path="/data"),
        attachment("ref-1", mount_path="/ref", ro=True),
    )
    (done,) = await command(cluster, start("box-0", script, rw, ro, image=containerd.image))
    assert done.status.code == code_pb2.OK, done.status.message
    try:
        inst = await eventually(lambda: _async(agent.instances.get("box-0")))
        out = inst.driver.log_paths("box-0")[0]

        async def finished() -> str:
            text = out.read_text() if out.exists() else ""
            return text if "dd-exit=" in text else ""

        text = await eventually(finished, timeout=30)
        assert "seeded\nro-refused\n" in text
        assert "No space left on device" in text and "dd-exit=1" in text
        data = volume_dir / "ext4" / "data-1" / "mnt"
        assert (data / "out").read_text() == "written\n"
        assert not (volume_dir / "ext4" / "ref-1" / "mnt" / "nope").exists()
        assert inst.phase is InstancePhase.RUNNING  # the full volume is the instance's error
        assert agent.connected.is_set() and agent._failed is None
        assert agent.volumes.volumes["data-1"].state is VolumeState.ATTACHED
    finally:
        await agent.stop()
        del cluster.agents["node-1"]
        containerd.clean_namespace()


@needs_libvirt
@pytest.mark.timeout(600)
async def test_vm_sees_its_qcow2_volume_as_a_second_disk(
    cluster: Cluster, volume_dir: Path, libvirt_daemons: LibvirtDaemons, guest: Guest
) -> None:
    if not guest.networking:
        pytest.skip("the guest has no virtio modules (ORKA_TEST_KERNEL without modules)")
    agent = await cluster.add_agent(
        "node-1",
        runtimes=["libvirt"],
        driver_options={
            "libvirt": {
                "uri": libvirt_daemons.uri,
                "poll_interval": 0.2,
                "domain_type": DOMAIN_TYPE,
            }
        },
        allowed_paths=[guest.kernel.parent, guest.initrd.parent, volume_dir / "image"],
        volume_dir=volume_dir,
    )
    # An image disk first (vda), as a VM booting from one has: its volume is the second disk.
    image = volume_dir / "image" / "root.qcow2"
    image.parent.mkdir(mode=0o755)
    await asyncio.to_thread(
        subprocess.run, ["qemu-img", "create", "-q", "-f", "qcow2", str(image), "1M"], check=True
    )
    instance = f"vm-{RUN}-0"
    spec = pb.WorkloadSpec(
        name=f"vm-{RUN}",
        kind=pb.WorkloadSpec.VM,
        image=str(image),
        vm=pb.VmSpec(
            kernel=str(guest.kernel),
            initrd=str(guest.initrd),
            cmdline=guest.cmdline() + " orka.disks",
        ),
        resources=pb.Resources(cpu_millis=500, memory_bytes=128 << 20),
        restart_policy=pb.WorkloadSpec.NEVER,
        stop_grace_period=Duration(seconds=1),
    )
    disk = attachment(f"disk-{RUN}", size=48 * MIB, backend="qcow2")
    a = apb.Assignment(instance=instance, generation=1, spec=spec, volumes=[disk])
    start_vm = apb.NodeCommand(node="node-1", start=apb.StartInstance(assignment=a))
    try:
        (done,) = await command(cluster, start_vm)
        assert done.status.code == code_pb2.OK, done.status.message
        await eventually(lambda: phase_of(agent, instance, InstancePhase.RUNNING), timeout=60)
        console = agent.instances[instance].driver.log_paths(instance)[0]

        async def disks() -> str:
            text = console.read_text(errors="replace") if console.exists() else ""
            return text if f"{DISK_MARKER} vdb" in text else ""  # vda is printed first

        try:
            text = await eventually(disks, timeout=180, interval=0.2)
        except AssertionError:
            seen = console.read_text(errors="replace") if console.exists() else "(no console)"
            raise AssertionError(f"the guest printed no disks; console:\n{seen[-3000:]}") from None
        assert f"{DISK_MARKER} vda {1 * MIB}\n{DISK_MARKER} vdb {48 * MIB}\n" in text
        assert agent.volumes.volumes[disk.name].state is VolumeState.ATTACHED
        # One running VM at a time on a qcow2 disk: a second is refused, never started.
        a2 = apb.Assignment(instance=f"vm-{RUN}-1", generation=1, spec=spec, volumes=[disk])
        await command(
            cluster, apb.NodeCommand(node="node-1", start=apb.StartInstance(assignment=a2))
        )
        await eventually(lambda: phase_of(agent, f"vm-{RUN}-1", InstancePhase.FAILED))
        second = agent.instances[f"vm-{RUN}-1"]
        assert (second.reason, second.message) == (
            VOLUME_FAILED,
            f"volume {disk.name}: in use by VM {instance}",
        )
    finally:
        await agent.stop()
        del cluster.agents["node-1"]


async def _async(value: object) -> object:
    return value
