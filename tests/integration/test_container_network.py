"""Containers on the node's instance network: real containerd, the real CNI plugins.

Each test gets a bridge and a /24 of its own (removed afterwards with its IPAM dir), so it
never meets an agent's bridge or another test run's. Traffic goes only to loopback and to
addresses on that bridge. Skipped only when not root or when the plugins, iproute2 or iptables
are missing (`.ci/run` installs them).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from orka.models import NetworkMode, PortSpec, RestartPolicy, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec, TaskInfo, TaskState
from orka.runtime.containerd import ContainerdDriver
from orka.runtime.host_ports import HostPorts
from orka.runtime.network import (
    CniNetwork,
    default_subnet,
    host_routes,
    netns_name,
)
from orka.runtime.process import ProcessDriver
from tests.containerd_env import Containerd, needs_containerd
from tests.integration.cluster import Cluster, crash, eventually
from tests.netenv import needs_network
from tests.netenv import scrub as scrub_bridge

pytestmark = [needs_containerd, needs_network]

HTTP = [PortSpec(name="http", port=8080)]
# The test's host ports: a slice of its own, far from the agents' default range.
PORT_RANGE = (46000, 46999)


@dataclass
class Net:
    bridge: str
    subnet: str
    dir: Path

    def network(self, host_ports: HostPorts) -> CniNetwork:
        return CniNetwork(
            self.dir, node="test", host_ports=host_ports, bridge=self.bridge, subnet=self.subnet
        )


def scrub(net: Net) -> None:
    """What a failed test may have left: its netns, its rules and chains, the bridge."""
    # Records of the test's own network and of any agent the test ran (its data dir).
    scrub_bridge(net.bridge, net.dir.parent)


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    bridge = f"ot{uuid.uuid4().hex[:10]}"
    subnet = str(default_subnet(bridge, host_routes(), bridge))
    it = Net(bridge=bridge, subnet=subnet, dir=tmp_path / "network")
    yield it
    scrub(it)
    shutil.rmtree(tmp_path / "network", ignore_errors=True)


@pytest.fixture
async def stack(
    containerd: Containerd, net: Net, tmp_path: Path
) -> AsyncIterator[tuple[ContainerdDriver, CniNetwork, HostPorts]]:
    ports = HostPorts(*PORT_RANGE)
    network = net.network(ports)
    driver = ContainerdDriver(tmp_path / "containerd", network=network, **containerd.options())
    yield driver, network, ports
    await driver.close()
    ports.close()
    # Whatever a failed test left, through a fresh driver on the same records (a test may have
    # closed the first one already, as an agent restart does).
    ports = HostPorts(*PORT_RANGE)
    cleaner = ContainerdDriver(
        tmp_path / "containerd", network=net.network(ports), **containerd.options()
    )
    for info in await cleaner.list():
        await cleaner.remove(info.instance)
    await cleaner.close()
    ports.close()
    containerd.clean_namespace()


def web_spec(image: str) -> WorkloadSpec:
    return WorkloadSpec(
        name="web",
        kind=WorkloadKind.CONTAINER,
        image=image,
        command=[
            "sh",
            "-c",
            "mkdir -p /www && echo hello from $ORKA_INSTANCE > /www/index.html"
            " && exec httpd -f -p 8080 -h /www",
        ],
        ports=HTTP,
        restart_policy=RestartPolicy.NEVER,
        stop_grace_seconds=1.0,
    )


def get(host: str, port: int) -> str:
    # No proxy: the request goes straight to loopback or the test's bridge.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{host}:{port}/", timeout=2) as resp:
        return resp.read().decode()


async def answers(host: str, port: int, instance: str, timeout: float = 20.0) -> None:
    async def check() -> bool:
        try:
            return f"hello from {instance}" in await asyncio.to_thread(get, host, port)
        except OSError:
            return False

    await eventually(check, timeout=timeout, interval=0.02)


def host_state() -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True)
    return links.stdout, rules.stdout


def bridge_state(net: Net) -> tuple[str, str]:
    """The bridge's link flags (e.g. "BROADCAST,MULTICAST,UP") and its addresses."""
    link = subprocess.run(
        ["ip", "-o", "link", "show", net.bridge], capture_output=True, text=True, check=True
    ).stdout
    addrs = subprocess.run(
        ["ip", "-br", "addr", "show", net.bridge], capture_output=True, text=True, check=True
    ).stdout
    return link.split("<", 1)[1].split(">", 1)[0], addrs


def assert_gone(net: Net, info: TaskInfo) -> None:
    links, rules = host_state()
    ns = netns_name(net.bridge, info.instance)
    veths = [line for line in links.splitlines() if f"link-netns {ns}" in line]
    assert veths == [], veths
    assert info.instance not in rules
    assert not (Path("/run/netns") / netns_name(net.bridge, info.instance)).exists()
    ipam = net.dir / "ipam"
    allocated = [p.name for p in ipam.rglob("*") if p.is_file()] if ipam.exists() else []
    assert info.address not in allocated, allocated
    assert not (net.dir / "attachments" / f"{info.instance}.json").exists()


async def test_containers_answer_at_address_and_host_port_and_survive_a_restart(
    stack: tuple[ContainerdDriver, CniNetwork, HostPorts],
    containerd: Containerd,
    net: Net,
    tmp_path: Path,
) -> None:
    driver, _, ports = stack
    spec = web_spec(containerd.image)
    started = time.monotonic()
    a = await driver.start(RunSpec(instance="web-a", workload="web", spec=spec))
    await answers(a.address, 8080, "web-a")
    first_answer = time.monotonic() - started
    b = await driver.start(RunSpec(instance="web-b", workload="web", spec=spec))
    for info in (a, b):
        assert info.state is TaskState.RUNNING
        assert ipaddress.ip_address(info.address) in ipaddress.ip_network(net.subnet)
        assert [(p.name, p.port) for p in info.ports] == [("http", 8080)]
        assert PORT_RANGE[0] <= info.ports[0].host_port <= PORT_RANGE[1]
    assert a.address != b.address
    assert a.ports[0].host_port != b.ports[0].host_port
    for info in (a, b):
        await answers(info.address, 8080, info.instance)
        await answers("127.0.0.1", info.ports[0].host_port, info.instance)
    print(f"\ndriver start to first HTTP answer at the address: {first_answer:.3f}s")

    # What an agent restart does: the old driver goes, a fresh one on the same data dirs.
    await driver.close()
    ports.close()
    ports2 = HostPorts(*PORT_RANGE)
    driver2 = ContainerdDriver(
        tmp_path / "containerd", network=net.network(ports2), **containerd.options()
    )
    try:
        adopted = {t.instance: t for t in await driver2.list()}
        assert set(adopted) == {"web-a", "web-b"}
        for old in (a, b):
            new = adopted[old.instance]
            assert new.state is TaskState.RUNNING
            assert (new.address, new.ports) == (old.address, old.ports)
            await answers(new.address, 8080, new.instance)
            await answers("127.0.0.1", new.ports[0].host_port, new.instance)
        # The adopted host ports are taken again: a new reservation gets neither of them.
        fresh = ports2.reserve("other", [PortSpec(name="x", port=1)], hold=False)
        assert fresh[0].host_port not in {a.ports[0].host_port, b.ports[0].host_port}
        ports2.release("other")

        await driver2.remove("web-a")
        assert_gone(net, a)
        # The other one is untouched by that.
        await answers(b.address, 8080, "web-b")
        await driver2.remove("web-b")
        assert_gone(net, b)
        links, _ = host_state()
        assert f"master {net.bridge} " not in links
    finally:
        for info in await driver2.list():
            await driver2.remove(info.instance)
        await driver2.close()
        ports2.close()


async def test_a_start_that_fails_gives_back_its_network(
    stack: tuple[ContainerdDriver, CniNetwork, HostPorts], containerd: Containerd, net: Net
) -> None:
    driver, network, _ = stack
    spec = web_spec(containerd.image).model_copy(update={"command": ["/no/such/binary"]})
    with pytest.raises(Exception, match=r"no/such/binary|cannot start"):
        await driver.start(RunSpec(instance="bad-0", workload="web", spec=spec))
    assert network.attachment("bad-0") is None
    links, rules = host_state()
    assert f"master {net.bridge} " not in links
    assert "bad-0" not in rules


async def test_attach_and_detach_cycles_leave_nothing(net: Net) -> None:
    """Ten instances attached and detached in turn (what bench/bench_network.py times): each
    gets an address and a host port, and every one is given back."""
    ports = HostPorts(*PORT_RANGE)
    network = net.network(ports)
    seen = set()
    try:
        for i in range(10):
            got = await network.attach_netns(f"cycle-{i}", HTTP)
            assert got.address and got.ports[0].host_port
            seen.add(got.address)
            await network.detach(f"cycle-{i}")
    finally:
        ports.close()
    assert network.instances() == []
    assert len(seen) >= 1
    ipam = net.dir / "ipam"
    allocated = [p.name for p in ipam.rglob("*") if p.is_file()] if ipam.exists() else []
    assert not set(allocated) & seen, allocated


async def test_vm_attachment_makes_the_bridge_and_forwards_its_host_port(net: Net) -> None:
    """What the libvirt driver asks for: an address, the bridge up with its gateway (no
    container made it), the host port forwarded; detach gives all of it back."""
    ports = HostPorts(*PORT_RANGE)
    network = net.network(ports)
    network.masquerade = True
    try:
        got = await network.attach_vm("vm-0", [PortSpec(name="ssh", port=22)])
        subnet = ipaddress.ip_network(net.subnet)
        assert ipaddress.ip_address(got.address) in subnet and got.netns == ""
        assert (got.bridge, got.gateway, got.prefix_len) == (net.bridge, str(subnet[1]), 24)
        flags, addrs = bridge_state(net)
        assert f"{subnet[1]}/24" in addrs and "UP" in flags.split(",")
        _, rules = host_state()
        assert f"{got.address}:22" in rules and '\\"vm-0\\"' in rules
        masq = f"-A POSTROUTING -s {got.address}/32 ! -d {net.subnet}"
        assert masq in rules and "-j MASQUERADE" in rules
        # Another agent process on the same records sees it unchanged.
        assert net.network(HostPorts(*PORT_RANGE)).attachment("vm-0") == got
        await network.detach("vm-0")
        _, rules = host_state()
        assert "vm-0" not in rules
        assert not (net.dir / "ipam" / network.name / got.address).exists()
        assert network.attachment("vm-0") is None
    finally:
        ports.close()


async def test_agent_restart_keeps_a_containers_address_and_host_port(
    containerd: Containerd, net: Net, certs_dir: Path, tmp_path: Path
) -> None:
    """Through the controller: the instance reports its address and host port, both answer;
    the agent dies (as on SIGKILL) and a new one re-adopts both unchanged; delete cleans up."""
    opts: dict[str, object] = {
        "runtimes": ["containerd"],
        "driver_options": {"containerd": containerd.options()},
        "allowed_paths": containerd.allowed_paths(),
        "network_bridge": net.bridge,
        "network_subnet": net.subnet,
        "host_port_range": PORT_RANGE,
    }
    cluster = Cluster(certs_dir, tmp_path)
    try:
        await cluster.start(agents=1, **opts)
        assert cluster.api is not None
        spec = pb.WorkloadSpec(
            name="web",
            kind=pb.WorkloadSpec.CONTAINER,
            image=containerd.image,
            command=web_spec(containerd.image).command,
            replicas=1,
            ports=[pb.PortSpec(name="http", port=8080)],
            stop_grace_period=Duration(seconds=1),
        )
        t0 = time.monotonic()
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
        (inst,) = await eventually(lambda: cluster.running("web"), interval=0.02)
        assert inst.address and len(inst.ports) == 1
        host_port = inst.ports[0].host_port
        await answers(inst.address, 8080, inst.name)
        print(f"\napply to first HTTP answer (agent, controller): {time.monotonic() - t0:.3f}s")
        await answers("127.0.0.1", host_port, inst.name)

        agent = cluster.agents.pop("node-1")
        await crash(agent)
        for driver in agent.drivers.values():
            await driver.close()
        agent.host_ports.close()  # what the kernel does for a killed process
        # An attachment whose instance went away while no agent ran: the next agent sweeps it.
        ghost_ports = HostPorts(*PORT_RANGE)
        stale = CniNetwork(
            tmp_path / "agents" / "node-1" / "network",
            node="node-1",
            host_ports=ghost_ports,
            bridge=net.bridge,
            subnet=net.subnet,
        )
        ghost = await stale.attach_netns("ghost-0", [])
        ghost_ports.close()
        revived = await cluster.add_agent("node-1", **opts)
        assert revived.network is not None
        assert revived.network.instances() == [inst.name]
        assert not await asyncio.to_thread(os.path.exists, ghost.netns)
        (task,) = await revived.drivers["containerd"].list()
        assert (task.address, [p.host_port for p in task.ports]) == (inst.address, [host_port])
        await answers(inst.address, 8080, inst.name)
        await answers("127.0.0.1", host_port, inst.name)

        async def reported() -> bool:
            (now,) = await cluster.instances("web")
            return (now.name, now.address, now.ports[0].host_port) == (
                inst.name,
                inst.address,
                host_port,
            )

        await eventually(reported)
        await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))

        async def deleted() -> bool:
            return not await cluster.instances("web") and not revived.instances

        await eventually(deleted)
        _, rules = host_state()
        assert inst.name not in rules
        assert not (Path("/run/netns") / netns_name(net.bridge, inst.name)).exists()
    finally:
        await cluster.stop()
        containerd.clean_namespace()


async def test_a_restarted_container_keeps_its_address_and_host_port(
    stack: tuple[ContainerdDriver, CniNetwork, HostPorts], containerd: Containerd, net: Net
) -> None:
    driver, network, _ = stack
    spec = web_spec(containerd.image)
    brief = spec.model_copy(update={"command": ["sh", "-c", "sleep 0.1; exit 1"]})
    first = await driver.start(RunSpec(instance="web-r", workload="web", spec=brief))
    assert (await asyncio.wait_for(driver.wait("web-r"), 30)).exit_code == 1
    # What the supervisor does for a restart: start the exited instance again.
    again = await driver.start(RunSpec(instance="web-r", workload="web", spec=spec))
    assert (again.address, again.ports) == (first.address, first.ports) != ("", [])
    await answers(again.address, 8080, "web-r")
    await answers("127.0.0.1", again.ports[0].host_port, "web-r")
    await driver.remove("web-r")
    assert_gone(net, again)
    assert network.attachment("web-r") is None


async def test_an_attachment_whose_namespace_vanished_is_made_afresh(net: Net) -> None:
    """After a reboot /run/netns is empty while the records remain: the next attach of that
    instance gives back the old address and rules and makes a working namespace."""
    ports = HostPorts(*PORT_RANGE)
    network = net.network(ports)
    try:
        old = await network.attach_netns("web-n", HTTP)
        await asyncio.to_thread(
            subprocess.run, ["ip", "netns", "delete", Path(old.netns).name], check=True
        )
        new = await network.attach_netns("web-n", HTTP)
        assert await asyncio.to_thread(os.path.exists, new.netns)
        assert new.address != old.address  # a fresh lease; the old one is given back
        allocated = {p.name for p in (net.dir / "ipam" / network.name).iterdir()}
        assert new.address in allocated and old.address not in allocated
        _, rules = host_state()
        assert f"{new.address}:8080" in rules and f"{old.address}:8080" not in rules
        await network.detach("web-n")
    finally:
        ports.close()


async def test_a_process_on_the_bridge_answers_at_its_address_and_host_port(
    net: Net, tmp_path: Path
) -> None:
    """`network: bridge`: the process gets a namespace of its own from the same network as
    containers; ORKA_PORT_HTTP is the port inside, ORKA_HOST_PORT_HTTP the one on the node."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox-static is not installed")
    ports = HostPorts(*PORT_RANGE)
    network = net.network(ports)
    driver = ProcessDriver(
        tmp_path / "process", host_ports=ports, host_ip="127.0.0.1", network=network
    )
    spec = WorkloadSpec(
        name="pweb",
        kind=WorkloadKind.PROCESS,
        network=NetworkMode.BRIDGE,
        command=[
            "sh",
            "-c",
            'echo "hello from $ORKA_INSTANCE $ORKA_PORT_HTTP $ORKA_HOST_PORT_HTTP" > index.html'
            f' && exec {busybox} httpd -f -p "$ORKA_PORT_HTTP" -h .',
        ],
        ports=HTTP,
        restart_policy=RestartPolicy.NEVER,
        stop_grace_seconds=1.0,
    )
    assert driver.admit(spec) is None
    info = await driver.start(RunSpec(instance="pweb-1", workload="pweb", spec=spec))
    try:
        assert ipaddress.ip_address(info.address) in ipaddress.ip_network(net.subnet)
        (binding,) = info.ports
        assert (binding.name, binding.port) == ("http", 8080)
        assert PORT_RANGE[0] <= binding.host_port <= PORT_RANGE[1]
        await answers(info.address, 8080, "pweb-1")
        await answers("127.0.0.1", binding.host_port, "pweb-1")
        text = await asyncio.to_thread(get, "127.0.0.1", binding.host_port)
        assert text.strip() == f"hello from pweb-1 8080 {binding.host_port}"
        # Not on the host's network: nothing listens on the host's 8080 for it.
        ss = await asyncio.to_thread(
            subprocess.run,
            ["ss", "-Htlnp", "sport = :8080"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "busybox" not in ss.stdout, ss.stdout
    finally:
        await driver.stop("pweb-1", grace=1.0)
        await driver.remove("pweb-1")
        await driver.close()
        ports.close()
    assert network.attachment("pweb-1") is None
    assert_gone(net, info)


async def test_an_instance_never_reaches_the_nodes_localhost(net: Net) -> None:
    """portmap turns route_localnet on for the bridge; without the agent's guard an instance
    that addresses 127.0.0.1 through its gateway reaches what the node binds to localhost
    (CVE-2020-8558). The instance here is given the route and the sysctl in its own namespace
    (what a workload with CAP_NET_RAW can do by crafting the frames itself)."""
    ports = HostPorts(*PORT_RANGE)
    network = net.network(ports)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        att = await network.attach_netns("probe-1", HTTP)
        ns = att.netns.rsplit("/", 1)[1]
        for cmd in (
            ["sysctl", "-qw", "net.ipv4.conf.eth0.route_localnet=1"],
            ["ip", "rule", "add", "pref", "10", "to", "127.0.0.1", "lookup", "200"],
            ["ip", "rule", "del", "pref", "0", "table", "local"],
            ["ip", "rule", "add", "pref", "100", "table", "local"],
            ["ip", "route", "add", "default", "via", att.gateway, "dev", "eth0", "table", "200"],
        ):
            await asyncio.to_thread(subprocess.run, ["ip", "netns", "exec", ns, *cmd], check=True)
        probe = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('reached')\n"
            "except OSError as e:\n"
            "    print('refused', e)\n"
        )
        out = await asyncio.to_thread(
            subprocess.run,
            ["ip", "netns", "exec", ns, sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.startswith("refused"), out.stdout
        # The node's own way in still works: 127.0.0.1:<host port> to an instance.
        rules = (await asyncio.to_thread(host_state))[1]
        assert f"-A INPUT -d 127.0.0.0/8 -i {net.bridge} " in rules
        await network.detach("probe-1")
    finally:
        server.close()
        ports.close()
    await network.close()
    assert f"-i {net.bridge} " not in (await asyncio.to_thread(host_state))[1]
