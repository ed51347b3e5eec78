"""The libvirt driver's pure parts: sizing, domain XML, metadata and disk format detection.

The driver against a real libvirtd is in tests/integration/test_libvirt.py.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from orka.errors import RuntimeFailure
from orka.models import PortBinding, PortSpec, Resources, VmSpec, WorkloadKind, WorkloadSpec
from orka.runtime.base import Attachment, RunSpec
from orka.runtime.libvirt import (
    DEFAULT_MEMORY,
    MIB,
    MIN_MEMORY,
    DomainConfig,
    LibvirtDriver,
    build_domain_xml,
    disk_format,
    guest_network_args,
    mac_for,
    memory_for,
    parse_task_metadata,
    tap_for,
    vcpus_for,
    with_network,
)


@pytest.mark.parametrize(
    ("millis", "vcpus"), [(0, 1), (1, 1), (500, 1), (1000, 1), (1001, 2), (2500, 3), (4000, 4)]
)
def test_vcpus_round_up_to_whole_cpus(millis: int, vcpus: int) -> None:
    assert vcpus_for(millis) == vcpus


@pytest.mark.parametrize(
    ("requested", "given"),
    [(0, DEFAULT_MEMORY), (1, MIN_MEMORY), (MIN_MEMORY, MIN_MEMORY), (512 * MIB, 512 * MIB)],
)
def test_memory_has_a_default_and_a_floor(requested: int, given: int) -> None:
    assert memory_for(requested) == given


def config(**overrides: object) -> DomainConfig:
    base: dict[str, object] = {
        "name": "orka-web-1",
        "instance": "web-1",
        "workload": "web",
        "owner": "/var/lib/orka/agent/runtime/libvirt",
        "started_at": 1700000000.25,
        "domain_type": "qemu",
        "vcpus": 2,
        "memory_bytes": 128 * MIB,
        "console_log": Path("/data/instances/web-1/console.log"),
    }
    base.update(overrides)
    return DomainConfig(**base)  # type: ignore[arg-type]


def test_direct_kernel_boot_xml() -> None:
    xml = build_domain_xml(
        config(kernel=Path("/k/vmlinuz"), initrd=Path("/k/initrd"), cmdline="console=ttyS0")
    )
    root = ET.fromstring(xml)
    assert root.get("type") == "qemu"
    assert root.findtext("name") == "orka-web-1"
    assert root.findtext("vcpu") == "2"
    assert root.find("memory").get("unit") == "KiB"  # type: ignore[union-attr]
    assert root.findtext("memory") == str(128 * 1024)
    os_type = root.find("os/type")
    assert os_type is not None and os_type.text == "hvm"
    assert (os_type.get("arch"), os_type.get("machine")) == ("x86_64", "pc")
    assert root.findtext("os/kernel") == "/k/vmlinuz"
    assert root.findtext("os/initrd") == "/k/initrd"
    assert root.findtext("os/cmdline") == "console=ttyS0"
    assert root.find("os/boot") is None
    assert root.find("devices/disk") is None
    assert root.find("features/acpi") is not None
    # A pty (for `orka console`) logged to the console log (`orka logs`).
    assert root.find("devices/serial").get("type") == "pty"  # type: ignore[union-attr]
    assert root.find("devices/serial/log").get("file") == (  # type: ignore[union-attr]
        "/data/instances/web-1/console.log"
    )
    assert root.findtext("on_reboot") == "destroy"


def test_disk_boot_xml() -> None:
    root = ET.fromstring(build_domain_xml(config(disk=Path("/img/a.qcow2"), disk_format="qcow2")))
    assert root.find("os/kernel") is None
    assert root.find("os/boot").get("dev") == "hd"  # type: ignore[union-attr]
    disk = root.find("devices/disk")
    assert disk is not None
    assert disk.find("driver").get("type") == "qcow2"  # type: ignore[union-attr]
    assert disk.find("source").get("file") == "/img/a.qcow2"  # type: ignore[union-attr]
    assert disk.find("target").get("bus") == "virtio"  # type: ignore[union-attr]


def test_metadata_round_trips_and_foreign_domains_are_ignored() -> None:
    meta = parse_task_metadata(build_domain_xml(config(kernel=Path("/k"))))
    assert meta == {
        "instance": "web-1",
        "workload": "web",
        "owner": "/var/lib/orka/agent/runtime/libvirt",
        "started_at": "1700000000.25",
    }
    assert parse_task_metadata("<domain type='kvm'><name>someone-else</name></domain>") is None
    assert parse_task_metadata("not xml") is None


def test_disk_format_by_magic(tmp_path: Path) -> None:
    qcow = tmp_path / "disk.img"
    qcow.write_bytes(b"QFI\xfb" + b"\0" * 60)
    raw = tmp_path / "disk.qcow2"  # the extension does not fool it
    raw.write_bytes(b"\0" * 64)
    assert disk_format(qcow) == "qcow2"
    assert disk_format(raw) == "raw"


def spec(**overrides: object) -> WorkloadSpec:
    base: dict[str, object] = {
        "name": "vm",
        "kind": WorkloadKind.VM,
        "resources": Resources(cpu_millis=1500, memory_bytes=256 * MIB),
    }
    base.update(overrides)
    if base.get("image") == "relative.img":
        # The model refuses a relative path since the paths rule; the driver's own check
        # (for specs from an older controller) is what this case tests.
        return WorkloadSpec(**{**base, "image": "/x"}).model_copy(update={"image": "relative.img"})  # type: ignore[arg-type]
    return WorkloadSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"image": "/nope/disk.qcow2"}, "image /nope/disk.qcow2 not found"),
        ({"vm": VmSpec(kernel="/nope/vmlinuz")}, "vm.kernel /nope/vmlinuz not found"),
        ({"image": "relative.img"}, "must be an absolute path"),
    ],
)
async def test_missing_files_fail_before_libvirt_is_asked(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    # No libvirtd behind this URI: the start must fail on the file check, not on connecting.
    driver = LibvirtDriver(tmp_path, uri=f"qemu+unix:///system?socket={tmp_path}/none")
    try:
        with pytest.raises(RuntimeFailure, match=message):
            await driver.start(RunSpec(instance="vm-1", workload="vm", spec=spec(**overrides)))
    finally:
        await driver.close()


async def test_missing_initrd_is_named(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"k")
    vm = VmSpec(kernel=str(kernel), initrd=str(tmp_path / "initrd"))
    driver = LibvirtDriver(tmp_path, uri=f"qemu+unix:///system?socket={tmp_path}/none")
    try:
        with pytest.raises(RuntimeFailure, match=f"vm.initrd {tmp_path}/initrd not found"):
            await driver.start(RunSpec(instance="vm-1", workload="vm", spec=spec(vm=vm)))
    finally:
        await driver.close()


def attachment(instance: str = "web-1") -> Attachment:
    return Attachment(
        instance=instance,
        address="10.88.0.7",
        prefix_len=24,
        gateway="10.88.0.1",
        bridge="orka0",
        ports=[PortBinding(name="http", port=8080, host_port=30080)],
    )


def test_a_network_gives_the_domain_one_virtio_nic_on_the_bridge() -> None:
    cfg = with_network(
        config(kernel=Path("/k/vmlinuz"), cmdline="console=ttyS0 quiet"), attachment()
    )
    root = ET.fromstring(build_domain_xml(cfg))
    (iface,) = root.findall("devices/interface")
    assert iface.get("type") == "bridge"
    assert iface.find("source").get("bridge") == "orka0"  # type: ignore[union-attr]
    assert iface.find("model").get("type") == "virtio"  # type: ignore[union-attr]
    assert iface.find("mac").get("address") == mac_for("web-1")  # type: ignore[union-attr]
    assert iface.find("target").get("dev") == tap_for("web-1")  # type: ignore[union-attr]
    # The guest learns its address from its command line, after what the spec asked for.
    assert root.findtext("os/cmdline") == (
        "console=ttyS0 quiet orka.ip=10.88.0.7/24 orka.gw=10.88.0.1"
    )


def test_without_a_network_there_is_no_nic_and_the_cmdline_is_the_specs() -> None:
    root = ET.fromstring(build_domain_xml(config(kernel=Path("/k"), cmdline="console=ttyS0")))
    assert root.find("devices/interface") is None
    assert root.findtext("os/cmdline") == "console=ttyS0"


def test_guest_args_alone_when_the_spec_has_no_cmdline() -> None:
    cfg = with_network(config(kernel=Path("/k")), attachment())
    assert cfg.cmdline == "orka.ip=10.88.0.7/24 orka.gw=10.88.0.1"
    assert guest_network_args(attachment()) == cfg.cmdline


def test_a_disk_booted_guest_gets_the_nic_but_no_cmdline() -> None:
    # No kernel to hand words to: such a guest configures itself (DHCP is not served).
    cfg = with_network(config(disk=Path("/img/a.qcow2")), attachment())
    root = ET.fromstring(build_domain_xml(cfg))
    assert root.find("os/cmdline") is None
    assert root.find("devices/interface/source").get("bridge") == "orka0"  # type: ignore[union-attr]


def test_mac_and_tap_name_are_stable_per_instance_and_valid() -> None:
    names = ["web-1", "web-2", "a" * 253, "db-0"]
    macs = [mac_for(n) for n in names]
    taps = [tap_for(n) for n in names]
    assert macs == [mac_for(n) for n in names]  # deterministic: a restart keeps them
    assert len(set(macs)) == len(set(taps)) == len(names)
    for mac, tap in zip(macs, taps, strict=True):
        octets = [int(o, 16) for o in mac.split(":")]
        assert len(octets) == 6 and octets[:3] == [0x52, 0x54, 0x00]
        assert octets[0] & 0x02 and not octets[0] & 0x01  # locally administered, unicast
        assert tap.startswith("orka") and len(tap) == 15  # IFNAMSIZ - 1
        # Names libvirt treats as its own would be replaced by a generated one.
        assert not tap.startswith(("vnet", "vif"))


class _Network:
    """Just enough of an InstanceNetwork for admission: whether the host can have one."""

    def __init__(self, problem: str | None) -> None:
        self.problem = problem

    def unavailable(self) -> str | None:
        return self.problem


@pytest.mark.parametrize(
    ("network", "ports", "reason"),
    [
        (None, [], None),
        (None, [PortSpec(name="http", port=80)], "this node has none"),
        (_Network("not root"), [PortSpec(name="http", port=80)], "network: not root"),
        (_Network("not root"), [], None),  # no ports: the VM runs, without a NIC
        (_Network(None), [PortSpec(name="http", port=80)], None),
    ],
)
async def test_ports_need_a_usable_network_at_admission(
    tmp_path: Path, network: _Network | None, ports: list[PortSpec], reason: str | None
) -> None:
    driver = LibvirtDriver(tmp_path, network=network)  # type: ignore[arg-type]
    try:
        got = driver.admit(spec(vm=VmSpec(kernel="/k"), ports=ports))
    finally:
        await driver.close()
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith("ports: needs the node's instance network")
        assert got.endswith(reason)
