"""A VM on the node's instance network, against real libvirtd + virtlogd and QEMU (TCG).

The guest is the Debian cloud kernel + busybox initramfs of tests/libvirt_env.py: its init loads
virtio_net, configures eth0 from the `orka.ip=`/`orka.gw=` words the driver appends to the
command line, and serves a page with `busybox httpd` on the port `orka.httpd=` names.

`BridgeNetwork` stands in for orka/runtime/network.py's `CniNetwork` (written at the same time):
one Linux bridge per test in a /24 of its own, with the gateway address on the bridge, and a
fixed address (.2) for the first VM. It forwards no host ports. Traffic goes only to that
subnet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from orka.errors import RuntimeFailure
from orka.models import (
    PortBinding,
    PortSpec,
    Resources,
    RestartPolicy,
    VmSpec,
    WorkloadKind,
    WorkloadSpec,
)
from orka.runtime.base import Attachment, RunSpec, TaskState
from orka.runtime.libvirt import LibvirtDriver, domain_name, mac_for, tap_for
from tests.integration.cluster import eventually
from tests.libvirt_env import (
    DOMAIN_TYPE,
    MARKER,
    NET_MARKER,
    RUN,
    Guest,
    LibvirtDaemons,
    needs_libvirt,
)

pytestmark = [needs_libvirt, pytest.mark.timeout(600)]

BOOT_TIMEOUT = 180.0
# From eth0 configured to httpd answering: the guest is up, so this fails fast when it never does.
ANSWER_TIMEOUT = 30.0
GUEST_PORT = 8080


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no route of this host overlaps."""
    taken = [
        ipaddress.ip_network(r["dst"], strict=False)
        for r in json.loads(ip("-j", "-4", "route", "show", "table", "all"))
        if r.get("dst", "default") not in ("default",) and "/" in r["dst"]
    ]
    rng = random.Random()
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{rng.randrange(200, 208)}.{rng.randrange(256)}.0/24")
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise AssertionError("no free /24 in 10.200.0.0/13")


class BridgeNetwork:
    """An `InstanceNetwork` for VMs only: a bridge of its own and fixed addresses, no ports."""

    def __init__(self, bridge: str, subnet: ipaddress.IPv4Network) -> None:
        self.bridge = bridge
        self.subnet = subnet
        hosts = list(subnet.hosts())
        self.gateway = str(hosts[0])
        self._free = [str(h) for h in hosts[1:]]
        self._held: dict[str, Attachment] = {}
        self.attached: list[str] = []
        self.detached: list[str] = []

    def create(self) -> None:
        ip("link", "add", "name", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def destroy(self) -> None:
        if link_exists(self.bridge):
            ip("link", "del", self.bridge)

    async def attach_netns(self, instance: str, ports: list[PortSpec]) -> Attachment:
        raise NotImplementedError("VMs only")

    async def attach_vm(self, instance: str, ports: list[PortSpec]) -> Attachment:
        self.attached.append(instance)
        if instance not in self._held:
            self._held[instance] = Attachment(
                instance=instance,
                address=self._free.pop(0),
                prefix_len=self.subnet.prefixlen,
                gateway=self.gateway,
                bridge=self.bridge,
                # Not forwarded: this double has no portmap; the driver only passes them on.
                ports=[PortBinding(name=p.name, port=p.port or 0) for p in ports],
            )
        return self._held[instance]

    async def detach(self, instance: str) -> None:
        self.detached.append(instance)
        held = self._held.pop(instance, None)
        if held is not None:
            self._free.insert(0, held.address)

    def attachment(self, instance: str) -> Attachment | None:
        return self._held.get(instance)


@pytest.fixture
def network() -> Iterator[BridgeNetwork]:
    net = BridgeNetwork(f"okvm{RUN}", free_subnet())
    net.create()
    try:
        yield net
    finally:
        net.destroy()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "libvirt"


def make_driver(data: Path, uri: str, network: BridgeNetwork) -> LibvirtDriver:
    return LibvirtDriver(data, uri=uri, poll_interval=0.2, domain_type=DOMAIN_TYPE, network=network)


@pytest.fixture
async def cleanup(
    data_dir: Path, libvirt_daemons: LibvirtDaemons, network: BridgeNetwork
) -> AsyncIterator[None]:
    """Whatever a failing test left running goes before the bridge does."""
    yield
    d = make_driver(data_dir, libvirt_daemons.uri, network)
    try:
        for info in await d.list():
            await d.remove(info.instance)
    finally:
        await d.close()


def web_vm(guest: Guest) -> WorkloadSpec:
    return WorkloadSpec(
        name="web",
        kind=WorkloadKind.VM,
        vm=VmSpec(
            kernel=str(guest.kernel),
            initrd=str(guest.initrd),
            cmdline=guest.cmdline(httpd_port=GUEST_PORT),
        ),
        ports=[PortSpec(name="http", port=GUEST_PORT)],
        resources=Resources(cpu_millis=500, memory_bytes=128 << 20),
        restart_policy=RestartPolicy.NEVER,
        stop_grace_seconds=1.0,
    )


async def http_get(address: str, port: int) -> str | None:
    """The body of GET / at address:port, or None while nothing answers there."""
    try:
        async with asyncio.timeout(2.0):
            reader, writer = await asyncio.open_connection(address, port)
            try:
                writer.write(b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n")
                await writer.drain()
                response = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    head, _, body = response.decode(errors="replace").partition("\r\n\r\n")
    return body if head.startswith("HTTP/1.") and " 200 " in head.split("\r\n")[0] else None


async def console_shows(path: Path, text: str) -> str:
    """The console log's content once the line holding `text` is complete."""

    async def check() -> str | None:
        try:
            content = await asyncio.to_thread(path.read_text, errors="replace")
        except FileNotFoundError:
            return None
        at = content.find(text)
        return content if at >= 0 and "\n" in content[at:] else None

    return await eventually(check, timeout=BOOT_TIMEOUT, interval=0.1)


def tap_master(tap: str) -> str | None:
    (link,) = json.loads(ip("-j", "link", "show", "dev", tap))
    return link.get("master")


def domain_interface(uri: str, name: str) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    import libvirt

    conn = libvirt.open(uri)
    try:
        root = ET.fromstring(conn.lookupByName(name).XMLDesc(0))
    finally:
        conn.close()
    (iface,) = root.findall("devices/interface")
    return {
        "type": iface.get("type", ""),
        "bridge": iface.find("source").get("bridge", ""),  # type: ignore[union-attr]
        "mac": iface.find("mac").get("address", ""),  # type: ignore[union-attr]
        "tap": iface.find("target").get("dev", ""),  # type: ignore[union-attr]
        "model": iface.find("model").get("type", ""),  # type: ignore[union-attr]
    }


@pytest.mark.usefixtures("cleanup")
async def test_vm_answers_at_its_address_on_the_bridge(
    data_dir: Path, libvirt_daemons: LibvirtDaemons, guest: Guest, network: BridgeNetwork
) -> None:
    """start → NIC on the bridge → HTTP answer from the guest at its address → a fresh driver
    re-adopts it with the same address → remove: TAP gone, address given back."""
    if not guest.networking:
        pytest.skip("the guest kernel's NIC modules are unknown (ORKA_TEST_KERNEL_MODULES)")
    instance = f"web-{RUN}"
    tap = tap_for(instance)
    first = make_driver(data_dir, libvirt_daemons.uri, network)
    began = time.monotonic()
    info = await first.start(RunSpec(instance=instance, workload="web", spec=web_vm(guest)))
    attachment = network.attachment(instance)
    assert attachment is not None
    address = attachment.address
    assert ipaddress.ip_address(address) in network.subnet
    assert info.address == address
    assert info.ports == [PortBinding(name="http", port=GUEST_PORT)]

    iface = domain_interface(libvirt_daemons.uri, domain_name(instance))
    assert iface == {
        "type": "bridge",
        "bridge": network.bridge,
        "mac": mac_for(instance),
        "tap": tap,
        "model": "virtio",
    }
    assert tap_master(tap) == network.bridge

    # Booted and eth0 configured (what the guest's `ip addr` says) before any traffic is sent.
    console, _ = first.log_paths(instance)
    text = await console_shows(console, NET_MARKER)
    assert f"inet {address}/{network.subnet.prefixlen}" in text

    async def answers() -> str | None:
        return await http_get(address, GUEST_PORT)

    body = await eventually(answers, timeout=ANSWER_TIMEOUT, interval=0.1)
    answered_after = time.monotonic() - began
    print(f"\nVM start→first HTTP answer at {address}:{GUEST_PORT} {answered_after:.2f}s")
    # The page is the guest's own: its kernel release and the address its init configured.
    assert f"{MARKER} kernel=6." in body
    assert f"ip={address}/{network.subnet.prefixlen}" in body
    await first.close()  # the agent goes away; the VM keeps running

    second = make_driver(data_dir, libvirt_daemons.uri, network)
    try:
        (adopted,) = [t for t in await second.list() if t.instance == instance]
        assert adopted.state is TaskState.RUNNING
        assert adopted.address == address
        assert adopted.ports == attachment.ports
        assert await http_get(address, GUEST_PORT) == body
        assert network.detached == []
        await second.remove(instance)
    finally:
        await second.close()
    assert not link_exists(tap)
    assert network.detached == [instance]
    assert network.attachment(instance) is None


async def test_a_start_that_fails_after_attach_gives_the_address_back(
    tmp_path: Path, libvirt_daemons: LibvirtDaemons, guest: Guest
) -> None:
    """libvirt refuses to start a NIC on a bridge that is not there: nothing is left behind."""
    network = BridgeNetwork(f"okno{RUN}", free_subnet())  # never created
    instance = f"nobridge-{RUN}"
    d = make_driver(tmp_path / "libvirt", libvirt_daemons.uri, network)
    try:
        with pytest.raises(RuntimeFailure, match="cannot start"):
            await d.start(RunSpec(instance=instance, workload="web", spec=web_vm(guest)))
        assert network.attached == [instance]
        assert network.detached == [instance]
        assert network.attachment(instance) is None
        assert await d.list() == []
    finally:
        await d.close()
