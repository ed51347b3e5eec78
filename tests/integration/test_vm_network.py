"""A VM on the node's instance network, against real libvirtd + virtlogd, QEMU (TCG) and the
real CNI plugins (orka/runtime/network.py's `CniNetwork`: host-local for the address, portmap for
the host port, the bridge made for libvirt's TAP).

The guest is the Debian cloud kernel + busybox initramfs of tests/libvirt_env.py: its init loads
virtio_net, configures eth0 from the `orka.ip=`/`orka.gw=` words the driver appends to the
command line, and serves a page with `busybox httpd` on the port `orka.httpd=` names.

Each test gets a bridge and a /24 of its own and a host port range of its own; traffic goes only
to that subnet and to loopback. Skipped where the network cannot be had (not root, the plugins,
iproute2 or iptables missing).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orka.errors import RuntimeFailure
from orka.models import (
    PortSpec,
    Resources,
    RestartPolicy,
    VmSpec,
    WorkloadKind,
    WorkloadSpec,
)
from orka.runtime.base import Attachment, RunSpec, TaskState
from orka.runtime.host_ports import HostPorts
from orka.runtime.libvirt import LibvirtDriver, domain_name, mac_for, tap_for
from orka.runtime.network import CniNetwork, default_subnet, host_routes
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
from tests.netenv import needs_network, scrub

pytestmark = [
    needs_libvirt,
    needs_network,
    pytest.mark.timeout(600),
]

BOOT_TIMEOUT = 180.0
# From eth0 configured to httpd answering: the guest is up, so this fails fast when it never does.
ANSWER_TIMEOUT = 30.0
GUEST_PORT = 8080
# The tests' host ports: a slice of their own, apart from the agents' and the container tests'.
PORT_RANGE = (47000, 47099)


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def nat_rules() -> str:
    return subprocess.run(
        ["iptables-save", "-t", "nat"], capture_output=True, text=True, check=True
    ).stdout


class RecordingNetwork(CniNetwork):
    """The real network, recording what the driver asked of it; `bridge_for_vm` hands libvirt
    another bridge than the one attached to (to make a start fail after its attach)."""

    def __init__(self, *args: object, bridge_for_vm: str = "", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.bridge_for_vm = bridge_for_vm
        self.attached: list[str] = []
        self.detached: list[str] = []

    async def attach_vm(self, instance: str, ports: list[PortSpec]) -> Attachment:
        self.attached.append(instance)
        got = await super().attach_vm(instance, ports)
        if self.bridge_for_vm:
            return got.model_copy(update={"bridge": self.bridge_for_vm})
        return got

    async def detach(self, instance: str) -> None:
        self.detached.append(instance)
        await super().detach(instance)


@dataclass
class Net:
    bridge: str
    subnet: str
    dir: Path

    def network(self, host_ports: HostPorts, bridge_for_vm: str = "") -> RecordingNetwork:
        return RecordingNetwork(
            self.dir,
            node="test",
            host_ports=host_ports,
            bridge=self.bridge,
            subnet=self.subnet,
            bridge_for_vm=bridge_for_vm,
        )


@dataclass
class Stack:
    net: Net
    ports: HostPorts
    data: Path
    uri: str

    def driver(self, bridge_for_vm: str = "") -> tuple[LibvirtDriver, RecordingNetwork]:
        """A driver and its network, as one agent process has them (a fresh pair re-adopts)."""
        network = self.net.network(self.ports, bridge_for_vm)
        d = LibvirtDriver(
            self.data, uri=self.uri, poll_interval=0.2, domain_type=DOMAIN_TYPE, network=network
        )
        return d, network


@pytest.fixture
async def stack(tmp_path: Path, libvirt_daemons: LibvirtDaemons) -> AsyncIterator[Stack]:
    bridge = f"ov{uuid.uuid4().hex[:10]}"
    net = Net(bridge, str(default_subnet(bridge, host_routes(), bridge)), tmp_path / "network")
    it = Stack(net, HostPorts(*PORT_RANGE), tmp_path / "libvirt", libvirt_daemons.uri)
    try:
        yield it
    finally:
        # Whatever a failed test left running goes before its bridge does.
        d, _ = it.driver()
        try:
            for info in await d.list():
                await d.remove(info.instance)
        finally:
            await d.close()
            it.ports.close()
            scrub(net.bridge)


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


async def test_vm_answers_at_its_address_and_host_port(stack: Stack, guest: Guest) -> None:
    """start → NIC on the bridge → HTTP answer from the guest at its address and through its
    host port → a fresh driver re-adopts it unchanged → remove: TAP, address and rules gone."""
    if not guest.networking:
        pytest.skip("the guest kernel's NIC modules are unknown (ORKA_TEST_KERNEL_MODULES)")
    instance = f"web-{RUN}"
    tap = tap_for(instance)
    first, network = stack.driver()
    began = time.monotonic()
    info = await first.start(RunSpec(instance=instance, workload="web", spec=web_vm(guest)))
    attachment = network.attachment(instance)
    assert attachment is not None
    address = attachment.address
    subnet = ipaddress.ip_network(stack.net.subnet)
    assert ipaddress.ip_address(address) in subnet
    assert info.address == address
    (http,) = info.ports
    assert (http.name, http.port) == ("http", GUEST_PORT)
    assert PORT_RANGE[0] <= http.host_port <= PORT_RANGE[1]
    assert info.ports == attachment.ports

    iface = domain_interface(stack.uri, domain_name(instance))
    assert iface == {
        "type": "bridge",
        "bridge": stack.net.bridge,
        "mac": mac_for(instance),
        "tap": tap,
        "model": "virtio",
    }
    assert tap_master(tap) == stack.net.bridge

    # Booted and eth0 configured (what the guest's `ip addr` says) before any traffic is sent.
    console, _ = first.log_paths(instance)
    text = await console_shows(console, NET_MARKER)
    assert f"inet {address}/{subnet.prefixlen}" in text

    async def answers() -> str | None:
        return await http_get(address, GUEST_PORT)

    body = await eventually(answers, timeout=ANSWER_TIMEOUT, interval=0.1)
    answered_after = time.monotonic() - began
    print(f"\nVM start→first HTTP answer at {address}:{GUEST_PORT} {answered_after:.2f}s")
    # The page is the guest's own: its kernel release and the address its init configured.
    assert f"{MARKER} kernel=6." in body
    assert f"ip={address}/{subnet.prefixlen}" in body
    # The host port reaches the same guest (portmap: DNAT for the node's addresses, loopback too).
    assert await http_get(str(subnet[1]), http.host_port) == body
    assert await http_get("127.0.0.1", http.host_port) == body
    await first.close()  # the agent goes away; the VM keeps running

    second, network = stack.driver()
    try:
        (adopted,) = [t for t in await second.list() if t.instance == instance]
        assert adopted.state is TaskState.RUNNING
        assert adopted.address == address
        assert adopted.ports == info.ports
        assert await http_get(address, GUEST_PORT) == body
        await second.remove(instance)
    finally:
        await second.close()
    assert network.detached == [instance]
    assert network.attachment(instance) is None
    assert not link_exists(tap)
    rules = nat_rules()
    assert address not in rules and f":{http.host_port}" not in rules


async def test_a_start_that_fails_after_attach_gives_the_address_back(
    stack: Stack, guest: Guest
) -> None:
    """libvirt refuses a NIC on a bridge that is not there: the address and host port the
    network gave are given back at once, and nothing stays defined."""
    instance = f"nobridge-{RUN}"
    d, network = stack.driver(bridge_for_vm=f"okno{RUN}")
    try:
        with pytest.raises(RuntimeFailure, match="cannot start"):
            await d.start(RunSpec(instance=instance, workload="web", spec=web_vm(guest)))
        assert network.attached == [instance]
        assert network.detached == [instance]
        assert network.attachment(instance) is None
        assert network.instances() == []
        assert await d.list() == []
    finally:
        await d.close()
