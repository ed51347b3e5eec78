"""The `libvirt` driver: `kind: VM` workloads as libvirt domains (QEMU), over `libvirt-python`.

Domains. Instance `web-3` becomes the persistent domain `orka-web-3`, defined from the spec and
then started (define + create, so a VM that stops stays visible with its shutoff reason until
`remove()` undefines it). Its `<metadata>` holds an `<orka:task>` element with the instance,
the workload, the start time and the owner (this driver's data dir): a restarted agent lists
the domains, reads that element and re-adopts what it owns. Owning by data dir keeps two agents
that share one host's libvirt (`orka up` runs two) from adopting, or removing as orphans, each
other's VMs.

Sizing. vCPUs are `ceil(cpu_millis / 1000)`, at least 1. Memory is `memory_bytes`, at least
`MIN_MEMORY` (64 MiB: a Linux guest cannot boot in less); a spec that declares no memory (0)
gets `DEFAULT_MEMORY` (256 MiB), with a warning, rather than failing after it was placed.
Neither is throttled further (no cputune quota): a VM gets whole vCPUs.

Boot. Either `spec.image`, a disk image attached as a virtio disk (qcow2 when it starts with the
qcow2 magic, raw otherwise) and booted from, or `spec.vm.kernel` (+ `initrd`, `cmdline`) booted
directly. The image is used in place: give each replica its own image, or use read-only guests.
Every file is checked before anything is defined, so a missing one fails the start at once with
its path. The machine is `pc` with ACPI; the domain type is `kvm` when QEMU can use /dev/kvm
(see `_kvm_usable`) and `qemu` (TCG, plain emulation) otherwise; `domain_type=` overrides.

Network. Given an `InstanceNetwork` (orka/runtime/network.py), a VM gets one virtio NIC: a TAP
that libvirt creates and joins to the node's bridge (`<interface type='bridge'>`), named
`orka` + 11 hex digits of a hash of the instance (an interface name has at most 15 characters)
and with a MAC from the same hash under QEMU's locally administered prefix 52:54:00, so a
restarted VM keeps both. The address comes from the network's IPAM (`attach_vm`, which also
forwards the host ports) and reaches a direct-boot guest on its kernel command line as
`orka.ip=ADDR/PREFIX orka.gw=GATEWAY`, for the guest's init to apply (see
`guest_network_args`). A guest booted from a disk image would have to ask DHCP, which the
node's bridge does not serve (it is not libvirt's own network with its dnsmasq): such a VM gets
its NIC and its address in the instance status, but configuring the address is left to the
image. `remove()` gives the address back (`detach`), as does a start that fails after it was
attached. Without a network (or where the host cannot have one: `unavailable()`), a VM has no
NIC at all, and one with ports is refused at admission.

Console. The first serial port is a pty (`console()` attaches to it, for `orka console`) logged
to `<data_dir>/instances/<instance>/console.log`, which `log_paths()` returns as both stdout
and stderr. libvirt writes that file itself (through virtlogd, as root for qemu:///system), so
the qemu user does not need access to the agent's data dir; virtlogd also bounds it (it
renames a full file to console.log.0: `log_backup`), so the agent does not rotate it. Disk images
and kernels, however, are opened by QEMU, which runs as the user in libvirt's qemu.conf
(`libvirt-qemu` on Debian): they must be readable by it, parent directories included.

Exit codes. libvirt reports why a domain is shut off, not an exit code, so one is derived: the
guest powered itself off (or rebooted: `on_reboot` is `destroy`, so that a panicking guest is
seen instead of looping) → 0; destroyed (by `stop()` after the grace period, or by anyone with
virsh) → 137, like a SIGKILLed process; crashed or failed → 1. `stop()` asks the guest first
(ACPI power button); a guest without an ACPI handler is destroyed after the grace period.

Blocking calls. libvirt-python blocks, so every call runs on a small dedicated thread pool (the
connection is thread-safe): the event loop never waits on libvirtd, and a slow libvirtd cannot
starve the default executor other code uses. State is polled (`poll_interval`, one cheap RPC per
VM) rather than taken from libvirt's domain events, which need a libvirt event loop thread of
their own; polling also survives libvirtd restarts without re-registering callbacks.

`libvirt-python` is an optional dependency (`pip install orka[libvirt]`, it needs libvirt's
headers to build): it is imported on first use, and without it the driver reports itself
unhealthy instead of breaking the agent's import.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import stat
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Literal, TypeVar

import structlog

from orka.errors import AlreadyExists, Conflict, NotFound, RuntimeFailure
from orka.models import WorkloadKind, WorkloadSpec
from orka.runtime.base import (
    Attachment,
    DriverHealth,
    InstanceNetwork,
    RunSpec,
    TaskInfo,
    TrackedTask,
    TrackingDriver,
    Usage,
    cancel_watchers,
    check_instance,
    network_refusal,
    terminate,
    usable_network,
    write_json,
)
from orka.runtime.execs import ExecHandle
from orka.runtime.libvirt_console import LibvirtConsole

log = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_URI = "qemu:///system"
DOMAIN_PREFIX = "orka-"
METADATA_NS = "https://orka.dev/xmlns/libvirt/task/1"
METADATA_PREFIX = "orka"
MIB = 1 << 20
MIN_MEMORY = 64 * MIB
DEFAULT_MEMORY = 256 * MIB
CONSOLE_LOG = "console.log"
EXIT_FILE = "exit.json"
QCOW2_MAGIC = b"QFI\xfb"
KVM_DEVICE = Path("/dev/kvm")
EXIT_DESTROYED = 137  # 128 + SIGKILL, as the process driver reports a killed task
# How long libvirt may take to tear a domain down after destroy() before we call it stuck.
_DESTROY_TIMEOUT = 10.0
# How long usage() waits for fresh domain stats. Stats need the domain's job lock, which a slow
# start or a busy libvirtd holds for long; heartbeats await usage() and must not stall on it.
_USAGE_WAIT = 1.0

# libvirt's virDomainState and virDomainShutoffReason values, so that this module needs the
# bindings only where it calls them.
_STATE_SHUTOFF = 5
_STATE_CRASHED = 6
_SHUTOFF_REASONS = {
    0: "unknown",
    1: "shutdown",
    2: "destroyed",
    3: "crashed",
    4: "migrated",
    5: "saved",
    6: "failed",
    7: "from-snapshot",
    8: "daemon",
}
_ERR_NO_DOMAIN = 42
_ERR_OPERATION_INVALID = 55  # e.g. destroy() of a domain that is not running

DomainType = Literal["auto", "kvm", "qemu"]


def _load() -> ModuleType:
    """Import the bindings on first use (they are an optional extra)."""
    import libvirt

    # By default libvirt also prints every error to stderr; we report them ourselves.
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt


def domain_name(instance: str) -> str:
    return DOMAIN_PREFIX + instance


@dataclass(frozen=True)
class Nic:
    """The VM's one NIC: a TAP named `dev` that libvirt creates and joins to `bridge`."""

    bridge: str
    mac: str
    dev: str


# libvirt ignores (and overwrites) target names it reserves for its own, "vnet" and "vif".
TAP_PREFIX = "orka"
IFNAMSIZ = 15  # the longest interface name Linux accepts


def _instance_hash(instance: str) -> bytes:
    return hashlib.sha256(instance.encode()).digest()


def mac_for(instance: str) -> str:
    """A MAC that stays the instance's across restarts and agents: QEMU's prefix 52:54:00
    (locally administered, unicast) and three bytes of a hash of the instance name."""
    return "52:54:00:" + ":".join(f"{b:02x}" for b in _instance_hash(instance)[:3])


def tap_for(instance: str) -> str:
    """The TAP's name: instance names are far longer than an interface name may be, so a hash;
    11 hex digits keep a clash between two instances of one node out of reach."""
    width = IFNAMSIZ - len(TAP_PREFIX)
    return TAP_PREFIX + _instance_hash(instance).hex()[:width]


def nic_for(attachment: Attachment) -> Nic:
    return Nic(
        bridge=attachment.bridge,
        mac=mac_for(attachment.instance),
        dev=tap_for(attachment.instance),
    )


def guest_network_args(attachment: Attachment) -> str:
    """Kernel command-line words that tell a direct-boot guest its address.

    Not the kernel's own `ip=ADDR::GW:MASK::eth0:off`: that needs CONFIG_IP_PNP, which Debian's
    kernels (the cloud kernel the tests boot included) leave out, and a NIC driver built in,
    where Debian builds virtio_net as a module. So the guest's init applies them (the test
    initramfs in tests/libvirt_env.py does, with busybox `ip`); the kernel passes words it
    does not know on to init untouched.
    """
    return f"orka.ip={attachment.address}/{attachment.prefix_len} orka.gw={attachment.gateway}"


def with_cmdline(cmdline: str, extra: str) -> str:
    return f"{cmdline} {extra}" if cmdline else extra


@dataclass(frozen=True)
class DomainConfig:
    """Everything the domain XML is built from; see `build_domain_xml`."""

    name: str
    instance: str
    workload: str
    owner: str
    started_at: float
    domain_type: Literal["kvm", "qemu"]
    vcpus: int
    memory_bytes: int
    console_log: Path
    disk: Path | None = None
    disk_format: str = "raw"
    kernel: Path | None = None
    initrd: Path | None = None
    cmdline: str = ""
    nic: Nic | None = None
    # Volumes as virtio disks after the image's vda (vdb, vdc, ...): (qcow2 file, read only).
    volumes: tuple[tuple[Path, bool], ...] = ()


def vcpus_for(cpu_millis: int) -> int:
    return max(1, math.ceil(cpu_millis / 1000))


def memory_for(memory_bytes: int) -> int:
    if memory_bytes == 0:
        return DEFAULT_MEMORY
    return max(MIN_MEMORY, memory_bytes)


def build_domain_xml(cfg: DomainConfig) -> str:
    dom = ET.Element("domain", type=cfg.domain_type)
    ET.SubElement(dom, "name").text = cfg.name
    metadata = ET.SubElement(dom, "metadata")
    ET.SubElement(
        metadata,
        f"{{{METADATA_NS}}}task",
        instance=cfg.instance,
        workload=cfg.workload,
        owner=cfg.owner,
        started_at=repr(cfg.started_at),
    )
    # libvirt rounds to KiB anyway; giving KiB keeps what we asked for and what it reports equal.
    ET.SubElement(dom, "memory", unit="KiB").text = str(cfg.memory_bytes // 1024)
    ET.SubElement(dom, "vcpu").text = str(cfg.vcpus)
    os_el = ET.SubElement(dom, "os")
    ET.SubElement(os_el, "type", arch="x86_64", machine="pc").text = "hvm"
    if cfg.kernel is not None:
        ET.SubElement(os_el, "kernel").text = str(cfg.kernel)
        if cfg.initrd is not None:
            ET.SubElement(os_el, "initrd").text = str(cfg.initrd)
        if cfg.cmdline:
            ET.SubElement(os_el, "cmdline").text = cfg.cmdline
    else:
        ET.SubElement(os_el, "boot", dev="hd")
    features = ET.SubElement(dom, "features")
    # ACPI is how shutdown() asks the guest to power off, and how a guest powers itself off.
    ET.SubElement(features, "acpi")
    ET.SubElement(features, "apic")
    ET.SubElement(dom, "on_poweroff").text = "destroy"
    # A reboot ends the instance (see the module docstring): the supervisor's restart policy
    # decides what happens next, and a panic loop shows up as restarts.
    ET.SubElement(dom, "on_reboot").text = "destroy"
    ET.SubElement(dom, "on_crash").text = "destroy"
    devices = ET.SubElement(dom, "devices")
    if cfg.disk is not None:
        disk = ET.SubElement(devices, "disk", type="file", device="disk")
        ET.SubElement(disk, "driver", name="qemu", type=cfg.disk_format)
        ET.SubElement(disk, "source", file=str(cfg.disk))
        ET.SubElement(disk, "target", dev="vda", bus="virtio")
    for i, (path, read_only) in enumerate(cfg.volumes):
        disk = ET.SubElement(devices, "disk", type="file", device="disk")
        ET.SubElement(disk, "driver", name="qemu", type="qcow2")
        ET.SubElement(disk, "source", file=str(path))
        ET.SubElement(disk, "target", dev=volume_target(i), bus="virtio")
        if read_only:
            ET.SubElement(disk, "readonly")
    if cfg.nic is not None:
        iface = ET.SubElement(devices, "interface", type="bridge")
        ET.SubElement(iface, "mac", address=cfg.nic.mac)
        ET.SubElement(iface, "source", bridge=cfg.nic.bridge)
        ET.SubElement(iface, "target", dev=cfg.nic.dev)
        ET.SubElement(iface, "model", type="virtio")
    # A pty, so that `orka console` can attach (virDomainOpenConsole), logged to the file
    # `orka logs` reads.
    serial = ET.SubElement(devices, "serial", type="pty")
    ET.SubElement(serial, "log", file=str(cfg.console_log), append="on")
    ET.SubElement(serial, "target", port="0")
    ET.SubElement(devices, "memballoon", model="virtio")
    ET.register_namespace(METADATA_PREFIX, METADATA_NS)
    return ET.tostring(dom, encoding="unicode")


def volume_target(index: int) -> str:
    """The guest's device of the index-th volume: vdb, vdc, ... (vda is the image's, even when
    the VM boots a kernel without one, so a volume's name does not depend on how it boots)."""
    if index >= 24:
        raise RuntimeFailure("libvirt: a VM takes at most 24 volumes")
    return "vd" + chr(ord("b") + index)


def parse_task_metadata(xml: str) -> dict[str, str] | None:
    """The `<orka:task>` attributes of a domain's XML, or None for a domain that is not ours."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return None
    el = root.find(f"metadata/{{{METADATA_NS}}}task")
    if el is None or not el.get("instance"):
        return None
    return dict(el.attrib)


def disk_format(path: Path) -> str:
    """qcow2 by its magic, raw otherwise: reading 4 bytes needs neither qemu-img nor trust in
    a file's extension."""
    with path.open("rb") as f:
        return "qcow2" if f.read(4) == QCOW2_MAGIC else "raw"


def _kvm_usable() -> bool:
    """Whether QEMU, running as libvirt's unprivileged qemu user, may open /dev/kvm.

    libvirtd itself runs as root, so its capabilities advertise kvm whenever the device exists,
    even where the qemu user would be refused (a 0600 root-only node, as in some sandboxes).
    The Debian qemu user is in group `kvm`, so a device readable by others or by that group is
    taken as usable.
    """
    try:
        st = KVM_DEVICE.stat()
    except OSError:
        return False
    if st.st_mode & stat.S_IROTH and st.st_mode & stat.S_IWOTH:
        return True
    if st.st_mode & stat.S_IRGRP and st.st_mode & stat.S_IWGRP:
        try:
            import grp

            return grp.getgrgid(st.st_gid).gr_name == "kvm"
        except KeyError:
            return False
    return False


@dataclass(eq=False, kw_only=True)
class _Vm(TrackedTask):
    driver: ClassVar[str] = "libvirt"

    dir: Path
    # Set before the first await of _finish, so the watcher and stop() record the exit once.
    finishing: bool = False
    # (guest cpu time in ns, monotonic ns) of the previous usage() call, for a rate.
    cpu_sample: tuple[int, int] | None = None
    # The stats call in flight (at most one per VM, however slow libvirtd is) and the last result.
    stats: asyncio.Future[tuple[int, int]] | None = None
    last_usage: Usage = field(default_factory=Usage)


class LibvirtDriver(TrackingDriver[_Vm]):
    name: ClassVar[str] = "libvirt"
    # virtlogd writes the console log and rotates it (2 MiB, 3 old files, by default).
    log_backup: ClassVar[str | None] = ".0"

    def __init__(
        self,
        data_dir: Path,
        uri: str = DEFAULT_URI,
        poll_interval: float = 0.5,
        domain_type: DomainType = "auto",
        owner: str = "",
        threads: int = 4,
        network: InstanceNetwork | None = None,
    ) -> None:
        self._root = Path(data_dir) / "instances"
        self.uri = uri
        self._poll = poll_interval
        self._domain_type = domain_type
        self._owner = owner or str(Path(data_dir).resolve())
        # None: VMs get no NIC (an agent without an instance network).
        self._network = network
        self._warned_no_nic = False
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="orka-libvirt")
        self._lib: ModuleType | None = None
        self._conn: Any = None
        self._vms: dict[str, _Vm] = {}
        # define+create calls in flight. A cancelled start() leaves its thread running, so stop
        # and remove wait for it (and then adopt what it made) instead of missing the domain;
        # usage() does not wait, and nothing adopts a domain that start() is still making.
        self._starting: dict[str, asyncio.Future[None]] = {}
        # Start, stop and remove of one instance must not interleave.
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False

    # -- interface ---------------------------------------------------------------------------

    def admit(self, spec: WorkloadSpec) -> str | None:
        """Ports are forwarded by the node's instance network: refused at the offer without
        one, rather than failing at the start."""
        return network_refusal(self._network) if spec.ports else None

    async def health(self) -> DriverHealth:
        kinds = [WorkloadKind.VM]
        try:
            await self._call(self._connection)
        except RuntimeFailure as err:
            return DriverHealth(healthy=False, message=err.message, kinds=kinds)
        try:
            await asyncio.to_thread(self._root.mkdir, parents=True, exist_ok=True)
        except OSError as exc:
            return DriverHealth(healthy=False, message=f"data dir: {exc}", kinds=kinds)
        return DriverHealth(healthy=True, kinds=kinds)

    async def start(self, run: RunSpec) -> TaskInfo:
        instance = check_instance(run.instance)
        async with self._locks[instance]:
            # Files first: a missing kernel or image is the user's to fix, and says so at once,
            # whatever state libvirtd is in.
            cfg = await asyncio.to_thread(self._prepare, run)
            existing = await self._lookup(instance)
            if existing is not None:
                if not existing.done.is_set():
                    raise AlreadyExists(f"libvirt: instance {instance!r} is already running")
                # A restart of an exited VM: a fresh definition, since the spec may differ.
                await self._forget(existing, keep_files=True)
            began = time.monotonic()
            attachment = None
            try:
                attachment = await self._connect(run)
                if attachment is not None:
                    cfg = with_network(cfg, attachment)
                xml = build_domain_xml(cfg)
                pending = asyncio.ensure_future(self._call(self._define_and_start, cfg.name, xml))
                self._starting[instance] = pending
                pending.add_done_callback(functools.partial(self._started, instance))
                await asyncio.shield(pending)
            except Exception:
                # Not on cancellation: the define may still finish in its thread, and remove()
                # detaches once it has found that domain. A failing detach is logged and left
                # for remove(); the start's own error is the one to report.
                with contextlib.suppress(Exception):
                    await self._detach(instance)
                raise
            vm = self._vms.get(instance)
            if vm is None:
                vm = _Vm(
                    instance=instance,
                    workload=run.workload,
                    dir=self._root / instance,
                    started_at=cfg.started_at,
                )
                self._vms[instance] = vm
                vm.watcher = asyncio.create_task(self._watch(vm), name=f"watch-{instance}")
            if attachment is not None:
                vm.address, vm.ports = attachment.address, list(attachment.ports)
            log.info(
                "libvirt.started",
                instance=instance,
                domain=cfg.name,
                address=vm.address,
                type=cfg.domain_type,
                vcpus=cfg.vcpus,
                memory=cfg.memory_bytes,
                took=round(time.monotonic() - began, 2),
            )
            return vm.info()

    async def list(self) -> list[TaskInfo]:
        found = await self._call(self._scan)
        for meta in found:
            if meta["instance"] not in self._vms and meta["instance"] not in self._starting:
                await self._adopt(meta)
        return [vm.info() for vm in self._vms.values()]

    async def usage(self, instance: str) -> Usage:
        vm = await self._require(instance, wait_start=False)
        if vm.done.is_set():
            return Usage()
        if vm.stats is None or vm.stats.done():
            vm.stats = asyncio.ensure_future(self._call(self._stats, domain_name(instance)))
            # Retrieved here so that a result nobody waited for logs no asyncio warning.
            vm.stats.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            cpu_ns, memory = await asyncio.wait_for(asyncio.shield(vm.stats), _USAGE_WAIT)
        except TimeoutError:
            return vm.last_usage
        except RuntimeFailure:
            # Gone between the check and the call: it exited, and the watcher will say so.
            return Usage()
        now = time.monotonic_ns()
        previous = vm.cpu_sample
        vm.cpu_sample = (cpu_ns, now)
        if previous is None:
            # No rate yet: the average since boot is the best first figure.
            elapsed = max(time.time() - vm.started_at, 1e-3) * 1e9
            millis = cpu_ns / elapsed * 1000
        else:
            millis = (cpu_ns - previous[0]) / max(now - previous[1], 1) * 1000
        vm.last_usage = Usage(cpu_millis=max(0, int(millis)), memory_bytes=memory)
        return vm.last_usage

    def log_paths(self, instance: str) -> tuple[Path, Path]:
        console = self._root / check_instance(instance) / CONSOLE_LOG
        return console, console

    async def console(self, instance: str) -> ExecHandle:
        """The VM's serial console, both ways (orka/runtime/libvirt_console.py)."""
        vm = await self._require(instance)
        if vm.done.is_set():
            raise Conflict(f"libvirt: instance {instance!r} is not running")

        def find() -> tuple[Any, Any]:
            dom = self._domain(domain_name(instance))
            if dom is None:
                raise Conflict(f"libvirt: instance {instance!r} has no domain")
            return self._connection(), dom

        conn, dom = await self._call(find)
        try:
            return await LibvirtConsole.open(conn, dom, self._call)
        except Exception as exc:
            if self._lib is not None and isinstance(exc, self._lib.libvirtError):
                raise RuntimeFailure(f"libvirt: console of {instance!r}: {_text(exc)}") from None
            raise

    async def close(self) -> None:
        """Stop watching; the VMs keep running so that the next agent re-adopts them."""
        if self._closed:
            return
        self._closed = True
        await cancel_watchers(self._vms.values())
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._call(conn.close)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- tracking (the `TrackingDriver` hooks first) -------------------------------------------

    async def _stop_running(self, vm: _Vm, grace: float) -> None:
        name = domain_name(vm.instance)
        await terminate(
            lambda: self._until_shutoff(vm),
            lambda: self._call(self._shutdown, name),
            lambda: self._call(self._destroy, name),
            grace,
            _DESTROY_TIMEOUT,
            f"libvirt: domain {name!r}",
        )
        log.info("libvirt.stopped", instance=vm.instance, exit_code=vm.exit_code)

    async def _discard(self, instance: str, vm: _Vm | None, keep_network: bool) -> None:
        if vm is not None:
            await self._forget(vm, keep_files=False)
        else:
            # Nothing we own under that name; still clear a leftover directory.
            await asyncio.to_thread(shutil.rmtree, self._root / instance, True)
        # After the domain is gone (its TAP with it), and also for an unknown instance: an
        # agent that crashed between attach and define left an address behind.
        if not keep_network:
            await self._detach(instance)

    async def _connect(self, run: RunSpec) -> Attachment | None:
        """An address on the node's bridge (idempotent: a restarted VM gets back the one it
        had); no NIC at all without a network, or where the host cannot have one."""
        network, why = usable_network(self._network, run.spec, "libvirt")
        if network is None:
            if why and not self._warned_no_nic:
                self._warned_no_nic = True
                log.warning("libvirt.no_nic", reason=why)
            return None
        return await network.attach_vm(run.instance, list(run.spec.ports))

    async def _detach(self, instance: str) -> None:
        if self._network is None:
            return
        try:
            await self._network.detach(instance)
        except Exception as exc:
            # Detach is idempotent: the next remove() tries again.
            log.warning("libvirt.detach_failed", instance=instance, error=str(exc))
            raise

    def _started(self, instance: str, pending: asyncio.Future[None]) -> None:
        if self._starting.get(instance) is pending:
            del self._starting[instance]
        # Retrieved here: when start() was cancelled nobody else awaits a failure.
        if not pending.cancelled():
            pending.exception()

    async def _require(self, instance: str, wait_start: bool = True) -> _Vm:
        vm = await self._lookup(check_instance(instance), wait_start)
        if vm is None:
            raise NotFound(f"libvirt: no VM {instance!r}")
        return vm

    async def _lookup(self, instance: str, wait_start: bool = True) -> _Vm | None:
        pending = self._starting.get(instance)
        if pending is not None:
            if not wait_start:
                return self._vms.get(instance)
            await asyncio.wait([pending])
        vm = self._vms.get(instance)
        if vm is not None:
            return vm
        meta = await self._call(self._metadata_of, domain_name(instance))
        if meta is None or meta["instance"] != instance:
            return None
        return await self._adopt(meta)

    async def _adopt(self, meta: dict[str, str]) -> _Vm:
        instance = meta["instance"]
        # Another caller may have adopted it while we were asking libvirt.
        if instance in self._vms:
            return self._vms[instance]
        vm = _Vm(
            instance=instance,
            workload=meta.get("workload", ""),
            dir=self._root / instance,
            started_at=float(meta.get("started_at", "0") or 0),
        )
        if self._network is not None:
            # What an earlier agent attached, read back so the status keeps the address.
            attachment = self._network.attachment(instance)
            if attachment is not None:
                vm.address, vm.ports = attachment.address, list(attachment.ports)
        self._vms[instance] = vm
        log.info("libvirt.adopted", instance=instance)
        vm.watcher = asyncio.create_task(self._watch(vm), name=f"watch-{instance}")
        return vm

    async def _watch(self, vm: _Vm) -> None:
        name = domain_name(vm.instance)
        while True:
            try:
                state, reason = await self._call(self._state, name)
            except RuntimeFailure as err:
                # libvirtd restarting, or a transient error: keep watching, the VM may be fine.
                log.warning("libvirt.poll_failed", instance=vm.instance, error=err.message)
                await asyncio.sleep(self._poll * 4)
                continue
            if state is None or state in (_STATE_SHUTOFF, _STATE_CRASHED):
                await self._finish(vm, state, reason)
                return
            await asyncio.sleep(self._poll)

    async def _until_shutoff(self, vm: _Vm) -> None:
        """Wait for the watcher to see the domain off, checking at once rather than a poll late."""
        name = domain_name(vm.instance)
        while not vm.done.is_set():
            state, reason = await self._call(self._state, name)
            if state is None or state in (_STATE_SHUTOFF, _STATE_CRASHED):
                await self._finish(vm, state, reason)
                return
            await asyncio.sleep(min(self._poll, 0.2))

    async def _finish(self, vm: _Vm, state: int | None, reason: int) -> None:
        """Record the exit once: exit.json first, so a restarted agent keeps the time."""
        if vm.finishing:
            # The watcher and a stop() may both see the shutoff; the first one records it.
            await vm.done.wait()
            return
        vm.finishing = True
        recorded = await asyncio.to_thread(_read_exit, vm.dir)
        if state is None:
            code, message = None, "domain disappeared (undefined outside orka)"
        elif state == _STATE_CRASHED:
            code, message = 1, "guest crashed"
        else:
            why = _SHUTOFF_REASONS.get(reason, str(reason))
            if why == "shutdown":
                code, message = 0, "guest powered off"
            elif why == "destroyed":
                code, message = EXIT_DESTROYED, "destroyed (powered off forcibly)"
            else:
                code, message = 1, f"domain shut off: {why}"
        vm.exit_code = code
        vm.message = message
        vm.finished_at = recorded if recorded is not None else time.time()
        if recorded is None:
            try:
                await asyncio.to_thread(
                    write_json, vm.dir / EXIT_FILE, {"finished_at": vm.finished_at}
                )
            except OSError as exc:
                log.warning("libvirt.exit_record_failed", instance=vm.instance, error=str(exc))
        vm.done.set()
        log.info("libvirt.exited", instance=vm.instance, exit_code=code, message=message)

    async def _forget(self, vm: _Vm, keep_files: bool) -> None:
        if vm.watcher is not None:
            vm.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await vm.watcher
        await self._call(self._undefine, domain_name(vm.instance))
        self._vms.pop(vm.instance, None)
        if not keep_files:
            await asyncio.to_thread(shutil.rmtree, vm.dir, True)

    # -- preparing a start (in a thread: it touches the filesystem) ---------------------------

    def _prepare(self, run: RunSpec) -> DomainConfig:
        spec = run.spec
        if spec.kind is not WorkloadKind.VM:
            raise RuntimeFailure(f"libvirt: runs VM workloads, not {spec.kind.value}")
        vm = spec.vm
        disk = _existing(spec.image, "image") if spec.image else None
        kernel = _existing(vm.kernel, "vm.kernel") if vm and vm.kernel else None
        initrd = _existing(vm.initrd, "vm.initrd") if vm and vm.initrd else None
        if disk is None and kernel is None:
            raise RuntimeFailure("libvirt: a VM needs an image or vm.kernel")
        volumes = []
        for v in run.volumes:
            if v.backend != "qcow2" or not v.host_path.is_file():
                raise RuntimeFailure(
                    f"libvirt: volume {v.name} is a {v.backend} volume; a VM needs a qcow2 one"
                )
            volume_target(len(volumes))
            volumes.append((v.host_path, v.read_only))
        if spec.resources.memory_bytes == 0:
            log.warning(
                "libvirt.default_memory", instance=run.instance, memory=DEFAULT_MEMORY // MIB
            )
        task_dir = self._root / run.instance
        task_dir.mkdir(parents=True, exist_ok=True)
        # A stale exit record would date this run's exit.
        (task_dir / EXIT_FILE).unlink(missing_ok=True)
        domain_type: Literal["kvm", "qemu"]
        if self._domain_type == "auto":
            domain_type = "kvm" if _kvm_usable() else "qemu"
        else:
            domain_type = self._domain_type
        return DomainConfig(
            name=domain_name(run.instance),
            instance=run.instance,
            workload=run.workload,
            owner=self._owner,
            started_at=time.time(),
            domain_type=domain_type,
            vcpus=vcpus_for(spec.resources.cpu_millis),
            memory_bytes=memory_for(spec.resources.memory_bytes),
            console_log=task_dir / CONSOLE_LOG,
            disk=disk,
            disk_format=disk_format(disk) if disk is not None else "raw",
            kernel=kernel,
            initrd=initrd,
            cmdline=vm.cmdline if vm else "",
            volumes=tuple(volumes),
        )

    # -- libvirt calls (each runs on the driver's thread pool through `_call`) ----------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _connection(self) -> Any:
        if self._lib is None:
            try:
                self._lib = _load()
            except ImportError:
                raise RuntimeFailure(
                    "libvirt-python is not installed (pip install 'orka[libvirt]')"
                ) from None
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(self._lib.libvirtError):
                if conn.isAlive():
                    return conn
            # libvirtd went away (restart): drop the dead connection and dial again.
            with contextlib.suppress(self._lib.libvirtError):
                conn.close()
            self._conn = None
        try:
            self._conn = self._lib.open(self.uri)
        except self._lib.libvirtError as exc:
            raise RuntimeFailure(f"cannot connect to {self.uri}: {_text(exc)}") from None
        return self._conn

    def _domain(self, name: str) -> Any:
        """The domain, or None when it does not exist."""
        conn = self._connection()
        assert self._lib is not None
        try:
            return conn.lookupByName(name)
        except self._lib.libvirtError as exc:
            if exc.get_error_code() == _ERR_NO_DOMAIN:
                return None
            raise RuntimeFailure(f"libvirt: looking up {name!r}: {_text(exc)}") from None

    def _define_and_start(self, name: str, xml: str) -> None:
        conn = self._connection()
        assert self._lib is not None
        try:
            dom = conn.defineXML(xml)
        except self._lib.libvirtError as exc:
            raise RuntimeFailure(f"libvirt: cannot define {name!r}: {_text(exc)}") from None
        try:
            dom.create()
        except self._lib.libvirtError as exc:
            # A definition that never ran must not linger and be adopted as an exited VM.
            with contextlib.suppress(self._lib.libvirtError):
                dom.undefine()
            raise RuntimeFailure(f"libvirt: cannot start {name!r}: {_text(exc)}") from None

    def _state(self, name: str) -> tuple[int | None, int]:
        dom = self._domain(name)
        if dom is None:
            return None, 0
        assert self._lib is not None
        try:
            state, reason = dom.state()
        except self._lib.libvirtError as exc:
            if exc.get_error_code() == _ERR_NO_DOMAIN:
                return None, 0
            raise RuntimeFailure(f"libvirt: state of {name!r}: {_text(exc)}") from None
        return int(state), int(reason)

    def _shutdown(self, name: str) -> None:
        dom = self._domain(name)
        if dom is None:
            return
        assert self._lib is not None
        try:
            dom.shutdown()
        except self._lib.libvirtError as exc:
            # Not running any more is what we wanted; anything else: destroy after the grace.
            log.info("libvirt.shutdown_refused", domain=name, error=_text(exc))

    def _destroy(self, name: str) -> None:
        dom = self._domain(name)
        if dom is None:
            return
        assert self._lib is not None
        try:
            dom.destroy()
        except self._lib.libvirtError as exc:
            if exc.get_error_code() in (_ERR_NO_DOMAIN, _ERR_OPERATION_INVALID):
                return
            raise RuntimeFailure(f"libvirt: cannot destroy {name!r}: {_text(exc)}") from None

    def _undefine(self, name: str) -> None:
        dom = self._domain(name)
        if dom is None:
            return
        assert self._lib is not None
        lib = self._lib
        try:
            if dom.isActive():
                dom.destroy()
            dom.undefineFlags(
                lib.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                | lib.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                | lib.VIR_DOMAIN_UNDEFINE_NVRAM
            )
        except lib.libvirtError as exc:
            if exc.get_error_code() == _ERR_NO_DOMAIN:
                return
            raise RuntimeFailure(f"libvirt: cannot undefine {name!r}: {_text(exc)}") from None

    def _metadata_of(self, name: str) -> dict[str, str] | None:
        dom = self._domain(name)
        if dom is None:
            return None
        return self._owned(dom)

    def _owned(self, dom: Any) -> dict[str, str] | None:
        assert self._lib is not None
        try:
            xml = dom.XMLDesc(0)
        except self._lib.libvirtError:
            return None  # undefined while we looked
        meta = parse_task_metadata(xml)
        if meta is None or meta.get("owner") != self._owner:
            return None
        return meta

    def _scan(self) -> list[dict[str, str]]:
        conn = self._connection()
        found = []
        for dom in conn.listAllDomains(0):
            if not dom.name().startswith(DOMAIN_PREFIX):
                continue
            meta = self._owned(dom)
            if meta is not None:
                found.append(meta)
        return found

    def _stats(self, name: str) -> tuple[int, int]:
        """(guest cpu time in ns, resident memory in bytes)."""
        dom = self._domain(name)
        if dom is None:
            raise RuntimeFailure(f"libvirt: no domain {name!r}")
        assert self._lib is not None
        try:
            cpu = dom.getCPUStats(True)[0].get("cpu_time", 0)
            mem = dom.memoryStats()
        except self._lib.libvirtError as exc:
            raise RuntimeFailure(f"libvirt: stats of {name!r}: {_text(exc)}") from None
        # rss is what QEMU holds on the host; `actual` (the balloon size) when rss is missing.
        kib = mem.get("rss") or mem.get("actual") or 0
        return int(cpu), int(kib) * 1024


def with_network(cfg: DomainConfig, attachment: Attachment) -> DomainConfig:
    """`cfg` with the NIC, and for a direct-boot guest its address on the command line."""
    cmdline = cfg.cmdline
    if cfg.kernel is not None:
        cmdline = with_cmdline(cmdline, guest_network_args(attachment))
    return dataclasses.replace(cfg, nic=nic_for(attachment), cmdline=cmdline)


def _text(exc: Exception) -> str:
    get = getattr(exc, "get_error_message", None)
    message = get() if get is not None else None
    return str(message or exc)


def _existing(path: str, field_name: str) -> Path:
    p = Path(path)
    if not p.is_absolute():
        raise RuntimeFailure(f"libvirt: {field_name} {path!r} must be an absolute path")
    if not p.is_file():
        raise RuntimeFailure(f"libvirt: {field_name} {path} not found")
    if not os.access(p, os.R_OK):
        raise RuntimeFailure(f"libvirt: {field_name} {path} is not readable")
    return p


def _read_exit(task_dir: Path) -> float | None:
    try:
        data = json.loads((task_dir / EXIT_FILE).read_text())
        return float(data["finished_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
