"""The node's instance network over the standard CNI plugins (Debian's containernetworking-plugins).

One Linux bridge per agent (`--network-bridge`, default "orka-" + a hash of the node name and
data dir) with one IPv4 subnet (`--network-subnet`, default a /24 chosen by that hash from
10.64.0.0/10, skipping any that overlaps a route the host already has, then kept in the data
dir). Several agents on one host (tests,
`orka up`) therefore get bridges and subnets of their own.

- A container (or a process with a network of its own) gets a fresh network namespace
  (`ip netns add`), then the conflist `bridge` (isGateway, host-local IPAM with its data dir
  under the agent's, ipMasq when `masquerade`) + `portmap` (snat, the host ports as
  runtimeConfig.portMappings), and the `loopback` plugin for `lo` inside the namespace.
- A VM gets an address from host-local alone, plus portmap to that address; the bridge is made
  (with its gateway address) if no container made it yet, so libvirt can put the VM's TAP on it.
- Host ports come from the agent's `HostPorts` (held open by a socket while the instance has
  them, so nothing else on the host takes them while DNAT sends their traffic to the instance).

Every attachment is recorded on disk (`<data dir>/attachments/<instance>.json`, written
atomically) with what CNI DEL needs (the configuration with its port mappings, the namespace,
the result), so a restarted agent re-adopts addresses and ports unchanged and can still tear
them down; `sweep` removes the records of instances that no longer exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import shutil
import socket
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from orka.errors import Invalid, RuntimeFailure
from orka.models import PortBinding, PortSpec
from orka.runtime import cni
from orka.runtime.base import Attachment, check_instance, write_json
from orka.runtime.host_ports import HostPorts

log = structlog.get_logger(__name__)

DEFAULT_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
PLUGINS = ("bridge", "host-local", "portmap", "loopback")
# Default subnets are /24s of this range: private, and clear of Docker's 172.17/16 and of
# libvirt's 192.168.122/24.
DEFAULT_POOL = ipaddress.IPv4Network("10.64.0.0/10")
IFNAME = "eth0"
NETNS_DIR = Path("/run/netns")
_IFNAMSIZ = 15
_ROUTES = Path("/proc/net/route")


def default_bridge(key: str) -> str:
    """ "orka-" + 10 hex digits of the agent's key (node name and data dir): 15 characters, the
    kernel's limit for an interface name."""
    return "orka-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def check_bridge(name: str) -> str:
    if (
        not name
        or len(name) > _IFNAMSIZ
        or any(c in name for c in "/ \t\n:%")
        or name in (".", "..")
    ):
        raise Invalid(
            f"--network-bridge: {name!r} is not an interface name (1-{_IFNAMSIZ} characters,"
            " no '/', ':', '%' or spaces)"
        )
    return name


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise Invalid(f"--network-subnet: {text!r} is not a subnet: {exc}") from None
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 28:
        raise Invalid(f"--network-subnet: {text!r} must be an IPv4 subnet of /28 or larger")
    return net


def host_routes(routes: Path = _ROUTES) -> list[tuple[str, ipaddress.IPv4Network]]:
    """(device, destination) of each IPv4 route the host has (from the kernel's table)."""
    try:
        lines = routes.read_text().splitlines()[1:]
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            dest = socket.inet_ntoa(struct.pack("<I", int(fields[1], 16)))
            mask = socket.inet_ntoa(struct.pack("<I", int(fields[7], 16)))
            net = ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)
        except (ValueError, struct.error):
            continue
        if net.prefixlen > 0:  # the default route overlaps everything and says nothing
            found.append((fields[0], net))
    return found


def default_subnet(
    key: str,
    routes: list[tuple[str, ipaddress.IPv4Network]],
    bridge: str,
    pool: ipaddress.IPv4Network = DEFAULT_POOL,
) -> ipaddress.IPv4Network:
    """A /24 of `pool` picked by the agent key's hash, stepping past any that overlaps a route
    of another device (our own bridge's route is ours: a restart keeps the same subnet)."""
    count = 1 << (24 - pool.prefixlen)
    start = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % count
    taken = [net for dev, net in routes if dev != bridge]
    base = int(pool.network_address)
    for i in range(count):
        candidate = ipaddress.IPv4Network(((base + ((start + i) % count) * 256), 24))
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise RuntimeFailure(f"network: every /24 of {pool} overlaps a route of this host")


def netns_name(bridge: str, instance: str) -> str:
    """A namespace name unique per agent (bridge) and instance, short whatever the instance."""
    return "orka-" + hashlib.sha256(f"{bridge}/{instance}".encode()).hexdigest()[:20]


def port_mappings(bindings: list[PortBinding]) -> list[dict[str, Any]]:
    return [
        {"hostPort": b.host_port, "containerPort": b.port, "protocol": b.protocol.value}
        for b in bindings
    ]


def conflist(
    *,
    name: str,
    bridge: str,
    subnet: ipaddress.IPv4Network,
    ipam_dir: Path,
    masquerade: bool,
    bindings: list[PortBinding],
) -> dict[str, Any]:
    """The network configuration list of a container: bridge + host-local, then portmap."""
    plugins: list[dict[str, Any]] = [
        {
            "type": "bridge",
            "bridge": bridge,
            "isGateway": True,
            "ipMasq": masquerade,
            # A container reaching its own host port goes out and back in on its veth.
            "hairpinMode": True,
            "ipam": ipam(subnet, ipam_dir),
        }
    ]
    if bindings:
        plugins.append(portmap(bindings))
    return {"cniVersion": cni.CNI_VERSION, "name": name, "plugins": plugins}


def portmap(bindings: list[PortBinding]) -> dict[str, Any]:
    """The portmap plugin's entry: the host ports DNAT'd to the instance, with SNAT so that
    127.0.0.1:<host port> works too."""
    return {
        "type": "portmap",
        "snat": True,
        "capabilities": {"portMappings": True},
        "runtimeConfig": {"portMappings": port_mappings(bindings)},
    }


def ipam(subnet: ipaddress.IPv4Network, ipam_dir: Path) -> dict[str, Any]:
    return {
        "type": "host-local",
        "ranges": [[{"subnet": str(subnet), "gateway": str(gateway(subnet))}]],
        "dataDir": str(ipam_dir),
    }


def gateway(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    return subnet.network_address + 1


def result_address(result: dict[str, Any]) -> tuple[str, int]:
    """The first IPv4 address (and prefix length) of a CNI result."""
    for ip in result.get("ips") or []:
        try:
            iface = ipaddress.ip_interface(str(ip.get("address", "")))
        except ValueError:
            continue
        if iface.version == 4:
            return str(iface.ip), iface.network.prefixlen
    raise RuntimeFailure(f"network: the CNI result has no IPv4 address: {json.dumps(result)[:300]}")


@dataclass
class _Record:
    """What one attachment left on the host, and what undoing it needs."""

    attachment: Attachment
    kind: str  # "netns" or "vm"
    netns_name: str
    config: dict[str, Any]
    result: dict[str, Any]

    def dump(self) -> dict[str, Any]:
        return {
            "attachment": self.attachment.model_dump(mode="json"),
            "kind": self.kind,
            "netns_name": self.netns_name,
            "config": self.config,
            "result": self.result,
        }

    @classmethod
    def parse(cls, data: dict[str, Any]) -> _Record:
        return cls(
            attachment=Attachment.model_validate(data["attachment"]),
            kind=str(data["kind"]),
            netns_name=str(data.get("netns_name") or ""),
            config=dict(data["config"]),
            result=dict(data.get("result") or {}),
        )


def host_unavailable(bin_dirs: list[Path] | None = None) -> str | None:
    """Why this host cannot give instances a network of their own, or None when it can."""
    dirs = list(bin_dirs) if bin_dirs else list(DEFAULT_BIN_DIRS)
    if os.geteuid() != 0:
        return "the instance network needs root (network namespaces, bridges, iptables)"
    missing = [p for p in PLUGINS if cni.find_plugin(p, dirs) is None]
    if missing:
        where = ", ".join(str(d) for d in dirs)
        return (
            f"CNI plugins {', '.join(missing)} not found in {where}"
            " (apt-get install containernetworking-plugins, or --cni-bin-dir)"
        )
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install {package})"
    return None


class CniNetwork:
    """`orka.runtime.base.InstanceNetwork` over the CNI plugins; one per agent."""

    def __init__(
        self,
        data_dir: Path,
        *,
        node: str,
        host_ports: HostPorts | None = None,
        bridge: str = "",
        subnet: str = "",
        masquerade: bool = False,
        bin_dirs: list[Path] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self._dir = Path(data_dir).resolve()
        self._records_dir = self._dir / "attachments"
        self._ipam_dir = self._dir / "ipam"
        # The node name and the data dir: two agents on one host differ in one of them (even
        # two test runs' "node-1"s), and a restarted agent has both unchanged.
        key = f"{node}@{self._dir}"
        self.bridge = check_bridge(bridge or default_bridge(key))
        self.subnet = self._choose_subnet(key, subnet)
        self.gateway = gateway(self.subnet)
        self.masquerade = masquerade
        self.bin_dirs = list(bin_dirs) if bin_dirs else list(DEFAULT_BIN_DIRS)
        self.name = f"orka-{self.bridge}"
        self._timeout = timeout
        self._ports = host_ports if host_ports is not None else HostPorts()
        self._records: dict[str, _Record] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._guarded = False
        self._guard_lock = asyncio.Lock()
        self._unavailable = self._check()
        self._load()

    # -- what the host allows ------------------------------------------------------------

    def unavailable(self) -> str | None:
        """Why instances cannot get a network on this host, or None when they can."""
        return self._unavailable

    def _check(self) -> str | None:
        return host_unavailable(self.bin_dirs)

    def _choose_subnet(self, node: str, subnet: str) -> ipaddress.IPv4Network:
        """The flag's; else the one this data dir used before (a restart keeps it); else the
        node name's default."""
        if subnet:
            return parse_subnet(subnet)
        kept = self._dir / "subnet"
        with contextlib.suppress(OSError, Invalid):
            return parse_subnet(kept.read_text().strip())
        chosen = default_subnet(node, host_routes(), self.bridge)
        with contextlib.suppress(OSError):
            self._dir.mkdir(parents=True, exist_ok=True)
            kept.write_text(f"{chosen}\n")
        return chosen

    # -- records ---------------------------------------------------------------------------

    def _load(self) -> None:
        """Re-adopt what an earlier agent process attached: its addresses and host ports."""
        try:
            paths = sorted(self._records_dir.glob("*.json"))
        except OSError:
            return
        for path in paths:
            try:
                record = _Record.parse(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("network.bad_record", path=str(path), error=str(exc))
                continue
            instance = record.attachment.instance
            self._records[instance] = record
            self._ports.adopt(instance, list(record.attachment.ports), hold=True)

    def _record_path(self, instance: str) -> Path:
        return self._records_dir / f"{check_instance(instance)}.json"

    async def _save(self, record: _Record) -> None:
        def write() -> None:
            self._records_dir.mkdir(parents=True, exist_ok=True)
            write_json(self._record_path(record.attachment.instance), record.dump())

        await asyncio.to_thread(write)

    # -- InstanceNetwork -----------------------------------------------------------------------

    def attachment(self, instance: str) -> Attachment | None:
        record = self._records.get(instance)
        return record.attachment if record else None

    def instances(self) -> list[str]:
        return sorted(self._records)

    async def attach_netns(self, instance: str, ports: list[PortSpec]) -> Attachment:
        return await self._attach(instance, ports, "netns")

    async def attach_vm(self, instance: str, ports: list[PortSpec]) -> Attachment:
        return await self._attach(instance, ports, "vm")

    async def detach(self, instance: str) -> None:
        check_instance(instance)
        async with self._locks[instance]:
            record = self._records.get(instance)
            if record is not None:
                await self._teardown(record)
                self._records.pop(instance, None)
                await asyncio.to_thread(self._record_path(instance).unlink, True)
            self._ports.release(instance)
        self._locks.pop(instance, None)

    async def sweep(self, existing: set[str]) -> list[str]:
        """Tear down the attachments of instances that no longer exist (after a restart: an
        instance removed while no agent ran). Returns the instances swept."""
        gone = [i for i in self._records if i not in existing]
        for instance in gone:
            try:
                await self.detach(instance)
                log.info("network.swept", instance=instance)
            except RuntimeFailure as exc:
                log.warning("network.sweep_failed", instance=instance, error=exc.message)
        return gone

    # -- attach / detach ---------------------------------------------------------------------

    async def _attach(self, instance: str, ports: list[PortSpec], kind: str) -> Attachment:
        check_instance(instance)
        if self._unavailable:
            raise RuntimeFailure(f"network: {self._unavailable}")
        await self._guard_localhost()
        async with self._locks[instance]:
            existing = self._records.get(instance)
            if existing is not None:
                netns = existing.attachment.netns
                if not netns or await asyncio.to_thread(os.path.exists, netns):
                    return existing.attachment
                # Its namespace is gone (the host rebooted: /run is a tmpfs): start afresh.
                log.info("network.netns_gone", instance=instance, netns=netns)
                await self._teardown(existing)
                self._records.pop(instance, None)
                await asyncio.to_thread(self._record_path(instance).unlink, True)
                self._ports.release(instance)
            bindings = await asyncio.to_thread(self._ports.reserve, instance, ports, True)
            record = _Record(
                attachment=Attachment(
                    instance=instance,
                    address="",
                    prefix_len=self.subnet.prefixlen,
                    gateway=str(self.gateway),
                    bridge=self.bridge,
                    ports=bindings,
                ),
                kind=kind,
                netns_name=netns_name(self.bridge, instance) if kind == "netns" else "",
                config={},
                result={},
            )
            try:
                if kind == "netns":
                    await self._add_netns(record, bindings)
                else:
                    await self._add_vm(record, bindings)
                await self._save(record)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._teardown(record)
                self._ports.release(instance)
                raise
            self._records[instance] = record
            log.info(
                "network.attached",
                instance=instance,
                address=record.attachment.address,
                ports=[f"{b.host_port}->{b.port}" for b in bindings],
            )
            return record.attachment

    async def _add_netns(self, record: _Record, bindings: list[PortBinding]) -> None:
        instance = record.attachment.instance
        await _run("ip", "netns", "add", record.netns_name, timeout=self._timeout)
        path = str(NETNS_DIR / record.netns_name)
        record.attachment = record.attachment.model_copy(update={"netns": path})
        await cni.invoke(
            "loopback",
            "ADD",
            container_id=instance,
            netns=path,
            ifname="lo",
            config={"cniVersion": cni.CNI_VERSION, "name": "lo", "type": "loopback"},
            bin_dirs=self.bin_dirs,
            timeout=self._timeout,
        )
        record.config = conflist(
            name=self.name,
            bridge=self.bridge,
            subnet=self.subnet,
            ipam_dir=self._ipam_dir,
            masquerade=self.masquerade,
            bindings=bindings,
        )
        await self._add_list(record, path, IFNAME)

    async def _add_vm(self, record: _Record, bindings: list[PortBinding]) -> None:
        await self.ensure_bridge()
        plugins: list[dict[str, Any]] = [
            {"type": "host-local", "ipam": ipam(self.subnet, self._ipam_dir)}
        ]
        if bindings:
            plugins.append(portmap(bindings))
        record.config = {"cniVersion": cni.CNI_VERSION, "name": self.name, "plugins": plugins}
        # No namespace of its own: host-local and portmap only need a valid one to be named.
        await self._add_list(record, "/proc/self/ns/net", IFNAME)
        if self.masquerade:
            # What the bridge plugin's ipMasq does for a container, for the VM's address.
            record.config["masquerade"] = True
            await _run(
                "iptables", "-w", "-t", "nat", "-A", *self._masq_rule(record), timeout=self._timeout
            )

    def _masq_rule(self, record: _Record) -> list[str]:
        """POSTROUTING: the VM's traffic leaving its subnet goes out as the node."""
        att = record.attachment
        return [
            "POSTROUTING",
            "-s",
            f"{att.address}/32",
            "!",
            "-d",
            str(self.subnet),
            "-m",
            "comment",
            "--comment",
            f"orka {self.name} {att.instance}"[:250],
            "-j",
            "MASQUERADE",
        ]

    async def _add_list(self, record: _Record, netns: str, ifname: str) -> None:
        """ADD each plugin of the list in order, each given the previous one's result."""
        instance = record.attachment.instance
        prev: dict[str, Any] | None = None
        for plugin in record.config["plugins"]:
            conf = cni.plugin_config(record.config, plugin, prev)
            result = await cni.invoke(
                plugin["type"],
                "ADD",
                container_id=instance,
                netns=netns,
                ifname=ifname,
                config=conf,
                bin_dirs=self.bin_dirs,
                timeout=self._timeout,
            )
            prev = result if result is not None else prev
            # Kept after every step, so a teardown after a failure DELs what was added.
            record.result = prev or {}
        address, prefix_len = result_address(record.result)
        record.attachment = record.attachment.model_copy(
            update={"address": address, "prefix_len": prefix_len}
        )

    async def _teardown(self, record: _Record) -> None:
        """DEL every plugin in reverse order (each DEL is idempotent), then the namespace."""
        instance = record.attachment.instance
        netns = record.attachment.netns
        if netns and not await asyncio.to_thread(os.path.exists, netns):
            netns = ""  # gone already: DEL still frees the address and the rules
        errors = []
        for plugin in reversed(record.config.get("plugins", [])):
            conf = cni.plugin_config(record.config, plugin, record.result or None)
            try:
                await cni.invoke(
                    plugin["type"],
                    "DEL",
                    container_id=instance,
                    netns=netns if record.kind == "netns" else "/proc/self/ns/net",
                    ifname=IFNAME,
                    config=conf,
                    bin_dirs=self.bin_dirs,
                    timeout=self._timeout,
                )
            except RuntimeFailure as exc:
                errors.append(exc.message)
        if record.config.get("masquerade") and record.attachment.address:
            with contextlib.suppress(RuntimeFailure):  # gone already: what DEL wanted
                await _run(
                    "iptables",
                    "-w",
                    "-t",
                    "nat",
                    "-D",
                    *self._masq_rule(record),
                    timeout=self._timeout,
                )
        if record.netns_name and await asyncio.to_thread(
            os.path.exists, NETNS_DIR / record.netns_name
        ):
            try:
                await _run("ip", "netns", "delete", record.netns_name, timeout=self._timeout)
            except RuntimeFailure as exc:
                errors.append(exc.message)
        if errors:
            raise RuntimeFailure("; ".join(errors))

    async def close(self) -> None:
        """The agent stops: with no instance left on it, the bridge goes too (the plugins never
        remove it), and its guard; one with instances stays for the next agent process."""
        if self._records or self._unavailable:
            return
        if await asyncio.to_thread(os.path.exists, f"/sys/class/net/{self.bridge}"):
            try:
                await _run("ip", "link", "delete", self.bridge, timeout=self._timeout)
            except RuntimeFailure as exc:
                log.warning("network.bridge_not_removed", bridge=self.bridge, error=exc.message)
        if self._guarded:
            with contextlib.suppress(RuntimeFailure):  # gone already: nothing to remove
                await _run("iptables", "-w", "-D", *self.localhost_guard(), timeout=self._timeout)
            self._guarded = False

    def localhost_guard(self) -> list[str]:
        """The filter rule that keeps instances off the node's 127.0.0.0/8.

        portmap turns route_localnet on for the bridge (so that 127.0.0.1:<host port> reaches an
        instance), and with it the kernel would also route a packet an instance addresses to
        127.0.0.1 to the node's own loopback services (etcd, the controller, anything bound to
        localhost): CVE-2020-8558. Kubernetes' kubelet drops such packets the same way; replies
        to the node's own connections through a host port (ESTABLISHED, DNAT) still pass."""
        return [
            "INPUT",
            "-i",
            self.bridge,
            "-d",
            "127.0.0.0/8",
            "-m",
            "conntrack",
            "!",
            "--ctstate",
            "RELATED,ESTABLISHED,DNAT",
            "-m",
            "comment",
            "--comment",
            f"{self.name}: instances never reach the node localhost",
            "-j",
            "DROP",
        ]

    async def _guard_localhost(self) -> None:
        """Put the localhost guard in place once per agent process, before any instance is on
        the bridge (idempotent: an earlier agent's rule is found, not added twice)."""
        if self._guarded:
            return
        async with self._guard_lock:
            if self._guarded:
                return
            rule = self.localhost_guard()
            try:
                await _run("iptables", "-w", "-C", *rule, timeout=self._timeout)
            except RuntimeFailure:
                await _run("iptables", "-w", "-I", *rule, timeout=self._timeout)
            self._guarded = True

    async def ensure_bridge(self) -> None:
        """The bridge, up, with its gateway address (what the bridge plugin would make)."""
        if not await asyncio.to_thread(os.path.exists, f"/sys/class/net/{self.bridge}"):
            with contextlib.suppress(RuntimeFailure):  # a concurrent maker won the race
                await _run(
                    "ip", "link", "add", self.bridge, "type", "bridge", timeout=self._timeout
                )
        cidr = f"{self.gateway}/{self.subnet.prefixlen}"
        try:
            await _run("ip", "addr", "add", cidr, "dev", self.bridge, timeout=self._timeout)
        except RuntimeFailure as exc:
            if "exists" not in exc.message and "already assigned" not in exc.message:
                raise
        await _run("ip", "link", "set", self.bridge, "up", timeout=self._timeout)


async def _run(*argv: str, timeout: float) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout):
            _, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeFailure(f"network: {' '.join(argv)} took over {timeout:g}s") from None
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()
        raise RuntimeFailure(f"network: {' '.join(argv)}: {text or proc.returncode}")
