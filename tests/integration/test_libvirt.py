"""The libvirt driver against a real libvirtd + virtlogd and QEMU (TCG here: no usable KVM).

See tests/libvirt_env.py for how the daemons, the kernel and the initramfs are set up (the
session fixtures `libvirt_daemons` and `guest` are in tests/conftest.py). Boots
under TCG take seconds, so waits are generous and nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from orka.errors import RuntimeFailure
from orka.models import InstancePhase, Resources, RestartPolicy, VmSpec, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec, TaskState, Usage
from orka.runtime.libvirt import EXIT_DESTROYED, LibvirtDriver, domain_name
from tests.integration.cluster import Cluster, eventually
from tests.integration.console_check import check_console
from tests.libvirt_env import DOMAIN_TYPE, MARKER, RUN, Guest, LibvirtDaemons, needs_libvirt

pytestmark = [needs_libvirt, pytest.mark.timeout(600)]

BOOT_TIMEOUT = 180.0


@pytest.fixture
async def driver(tmp_path: Path, libvirt_daemons: LibvirtDaemons) -> AsyncIterator[LibvirtDriver]:
    d = LibvirtDriver(
        tmp_path / "libvirt", uri=libvirt_daemons.uri, poll_interval=0.2, domain_type=DOMAIN_TYPE
    )
    try:
        yield d
    finally:
        for info in await d.list():
            await d.remove(info.instance)
        await d.close()


def vm_spec(name: str, guest: Guest, *, poweroff: bool = False, kernel: str = "") -> WorkloadSpec:
    return WorkloadSpec(
        name=name,
        kind=WorkloadKind.VM,
        vm=VmSpec(
            kernel=kernel or str(guest.kernel),
            initrd=str(guest.initrd),
            cmdline=guest.cmdline(poweroff=poweroff),
        ),
        resources=Resources(cpu_millis=500, memory_bytes=128 << 20),
        restart_policy=RestartPolicy.NEVER,
        stop_grace_seconds=1.0,
    )


def run_spec(instance: str, spec: WorkloadSpec) -> RunSpec:
    return RunSpec(instance=instance, workload=spec.name, spec=spec)


async def console_shows(path: Path, text: str, timeout: float = BOOT_TIMEOUT) -> str:
    async def check() -> str | None:
        try:
            content = await asyncio.to_thread(path.read_text, errors="replace")
        except FileNotFoundError:
            return None
        return content if text in content else None

    return await eventually(check, timeout=timeout, interval=0.1)


def domain_exists(uri: str, name: str) -> bool:
    import libvirt

    conn = libvirt.open(uri)
    try:
        conn.lookupByName(name)
    except libvirt.libvirtError:
        return False
    finally:
        conn.close()
    return True


def domain_limits(uri: str, name: str) -> tuple[int, int]:
    """(maximum memory in KiB, vCPU count) of a running domain, as libvirt enforces them."""
    import libvirt

    conn = libvirt.open(uri)
    try:
        _state, max_kib, _kib, vcpus, _cpu_time = conn.lookupByName(name).info()
    finally:
        conn.close()
    return max_kib, vcpus


async def test_vm_runs_through_scheduler_and_agent(
    certs_dir: Path, tmp_path: Path, libvirt_daemons: LibvirtDaemons, guest: Guest
) -> None:
    """apply → RUNNING with the guest's own console output → delete → STOPPED, domain gone."""
    cluster = Cluster(certs_dir, tmp_path)
    try:
        await cluster.start(
            agents=1,
            runtimes=["libvirt"],
            driver_options={
                "libvirt": {
                    "uri": libvirt_daemons.uri,
                    "poll_interval": 0.2,
                    "domain_type": DOMAIN_TYPE,
                }
            },
            allowed_paths=[guest.kernel.parent, guest.initrd.parent],
        )
        assert cluster.api is not None
        agent = cluster.agents["node-1"]
        name = f"vm-{RUN}"
        spec = pb.WorkloadSpec(
            name=name,
            kind=pb.WorkloadSpec.VM,
            vm=pb.VmSpec(
                kernel=str(guest.kernel), initrd=str(guest.initrd), cmdline=guest.cmdline()
            ),
            replicas=1,
            resources=pb.Resources(cpu_millis=500, memory_bytes=128 << 20),
            stop_grace_period=Duration(seconds=1),
        )
        applied = time.monotonic()
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))

        async def one_running() -> list[pb.Instance] | None:
            r = await cluster.running(name)
            return r if len(r) == 1 else None

        (inst,) = await eventually(one_running, timeout=BOOT_TIMEOUT)
        running_after = time.monotonic() - applied
        driver = agent.drivers["libvirt"]
        console, stderr = driver.log_paths(inst.name)
        assert console == stderr
        text = await console_shows(console, MARKER)
        marker_after = time.monotonic() - applied
        print(f"\nVM apply→RUNNING {running_after:.2f}s, apply→guest marker {marker_after:.2f}s")
        assert f"{MARKER} kernel=6." in text
        assert domain_exists(libvirt_daemons.uri, domain_name(inst.name))
        # The agent's instance network gave it an address, which the controller reports.
        assert agent.network is not None
        attachment = agent.network.attachment(inst.name)
        if agent.network.unavailable() is None:
            assert attachment is not None
            assert inst.address == attachment.address
            assert ipaddress.ip_address(inst.address) in agent.network.subnet
        # The spec's resources are the VM's limits: 128 MiB of memory, 500 m -> one vCPU.
        assert domain_limits(libvirt_daemons.uri, domain_name(inst.name)) == (128 << 10, 1)
        usage = await driver.usage(inst.name)
        assert usage.memory_bytes > 0

        # `orka console`: boot output, typed input answered, the log still written.
        await check_console(cluster, inst.name, BOOT_TIMEOUT)

        supervised = agent.instances[inst.name]
        await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name=name))

        async def stopped() -> bool:
            return supervised.phase is InstancePhase.STOPPED

        await eventually(stopped, timeout=60)
        # Destroyed after the 1 s grace: the busybox guest has no ACPI handler.
        assert supervised.exit_code == EXIT_DESTROYED

        async def all_gone() -> bool:
            return not await cluster.instances(name)

        await eventually(all_gone, timeout=30)
        assert not domain_exists(libvirt_daemons.uri, domain_name(inst.name))
        assert not console.parent.exists()
        assert agent.network.attachment(inst.name) is None
    finally:
        await cluster.stop()


async def test_restarted_driver_readopts_running_vm(
    tmp_path: Path, libvirt_daemons: LibvirtDaemons, guest: Guest
) -> None:
    data = tmp_path / "libvirt"
    instance = f"adopt-{RUN}"
    spec = vm_spec("adopt", guest)
    first = LibvirtDriver(data, uri=libvirt_daemons.uri, poll_interval=0.2, domain_type=DOMAIN_TYPE)
    info = await first.start(run_spec(instance, spec))
    assert info.state is TaskState.RUNNING
    console, _ = first.log_paths(instance)
    await console_shows(console, MARKER)
    await first.close()  # the agent goes away; the VM keeps running

    # Another driver on another data dir must not claim it (two agents sharing one libvirtd).
    stranger = LibvirtDriver(tmp_path / "other", uri=libvirt_daemons.uri)
    try:
        assert instance not in {t.instance for t in await stranger.list()}
    finally:
        await stranger.close()

    second = LibvirtDriver(data, uri=libvirt_daemons.uri, poll_interval=0.2)
    try:
        (adopted,) = [t for t in await second.list() if t.instance == instance]
        assert adopted.state is TaskState.RUNNING
        assert adopted.workload == "adopt"
        assert adopted.started_at == pytest.approx(info.started_at)
        stopped = await second.stop(instance, grace=0.5)
        assert stopped.state is TaskState.EXITED
        assert stopped.exit_code == EXIT_DESTROYED
        await second.remove(instance)
        assert not domain_exists(libvirt_daemons.uri, domain_name(instance))
        assert await second.list() == []
    finally:
        await second.close()


async def test_guest_that_powers_off_exits_with_code_0(
    driver: LibvirtDriver, libvirt_daemons: LibvirtDaemons, guest: Guest
) -> None:
    instance = f"poweroff-{RUN}"
    await driver.start(run_spec(instance, vm_spec("poweroff", guest, poweroff=True)))
    done = await driver.wait(instance)
    assert done.state is TaskState.EXITED
    assert done.exit_code == 0, done.message
    console, _ = driver.log_paths(instance)
    assert MARKER in console.read_text(errors="replace")
    assert await driver.usage(instance) == Usage()
    # Exited but still defined until removed, so its exit stays visible to a restarted agent.
    assert domain_exists(libvirt_daemons.uri, domain_name(instance))
    await driver.remove(instance)
    assert not domain_exists(libvirt_daemons.uri, domain_name(instance))


async def test_missing_kernel_fails_at_once_naming_the_path(
    driver: LibvirtDriver, libvirt_daemons: LibvirtDaemons, guest: Guest, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-vmlinuz"
    instance = f"nokernel-{RUN}"
    with pytest.raises(RuntimeFailure, match=str(missing)):
        await driver.start(run_spec(instance, vm_spec("nokernel", guest, kernel=str(missing))))
    assert not domain_exists(libvirt_daemons.uri, domain_name(instance))


async def test_unreachable_libvirt_is_reported_unhealthy(tmp_path: Path) -> None:
    uri = f"qemu+unix:///system?socket={tmp_path}/no-such-sock"
    d = LibvirtDriver(tmp_path, uri=uri)
    try:
        health = await d.health()
    finally:
        await d.close()
    assert not health.healthy
    assert health.message.startswith(f"cannot connect to {uri}")
    assert health.kinds == [WorkloadKind.VM]
