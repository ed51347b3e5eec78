"""Real libvirt for tests: the daemons, a Debian cloud kernel and a busybox initramfs.

Daemons. A privileged libvirtd (what `qemu:///system` means) keeps its sockets and state in fixed
places (/run/libvirt, /var/lib/libvirt), so there is exactly one per host and it cannot be moved
to a temp dir; `qemu:///session` as root is that same system daemon. So `LibvirtDaemons` reuses
a libvirtd that already answers (a developer's systemd-managed one, a CI service) and otherwise
starts `virtlogd` and `libvirtd` itself, in the foreground as its own children, and stops them at
the end. Isolation between runs and from anything else on the host comes from naming: every
domain a test creates carries the run's token, and the driver only adopts domains whose metadata
names its own data dir. Leftovers with the token are destroyed and undefined at teardown.

Files QEMU opens. Under qemu:///system QEMU runs as Debian's `libvirt-qemu` user, which must
reach the kernel and initramfs: pytest's temp dirs (0700) and ~/.cache under /root (0700) are out
of its reach, so the guest's files are copied into a world-readable directory of their own. The
console log is opened by libvirtd (root), so the agents' data dirs stay private.

/dev/kvm. libvirtd (root) probes QEMU with KVM when /dev/kvm exists, then finds that its qemu
user cannot open it and throws the capabilities cache away, on every lookup: defining one domain
took ~47 s where /dev/kvm is root-only (0600, as in this sandbox, which has no udev). The fixture
applies what Debian's udev rule would (group `kvm`, 0660) and restores the old mode afterwards.
The tests still boot under TCG (`ORKA_TEST_LIBVIRT_DOMAIN_TYPE`, default `qemu`): the nested KVM
here accepts guests but runs them silently, and the driver cannot tell that from the outside.

Kernel. Debian's `linux-image-cloud-amd64` names the current cloud kernel package; it is fetched
with `apt-get download` once, unpacked with `dpkg -x`, and only `vmlinuz` is kept under
`$ORKA_TEST_CACHE` (default `~/.cache/orka-test`) so reruns need neither apt nor the network.
`ORKA_TEST_KERNEL` points at a kernel to use instead.

Guest network. The cloud kernel has virtio_net and what it needs as modules (checked in its
config: VIRTIO, VIRTIO_PCI, VIRTIO_NET, FAILOVER, NET_FAILOVER all `=m`) and no CONFIG_IP_PNP, so
the kernel cannot configure an address itself. The same package's modules are therefore
unpacked next to `vmlinuz` (`NIC_MODULES`, in load order) and put in the initramfs, whose init
loads them and configures eth0 from `orka.ip=ADDR/PREFIX orka.gw=GATEWAY` on the command line
(what the driver appends for a VM on the instance network), then starts `busybox httpd` on the
port `orka.httpd=PORT` names, serving a page that says who it is. With `ORKA_TEST_KERNEL`, the
modules are looked up under `ORKA_TEST_KERNEL_MODULES` (a directory searched for the `.ko`
files), and a guest without them has no network (`Guest.networking`).
"""

from __future__ import annotations

import contextlib
import grp
import gzip
import io
import lzma
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.subprocs import reap

LIBVIRTD = shutil.which("libvirtd") or "/usr/sbin/libvirtd"
VIRTLOGD = shutil.which("virtlogd") or "/usr/sbin/virtlogd"
QEMU = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
BUSYBOX = "/bin/busybox"
SYSTEM_URI = "qemu:///system"
VIRTLOGD_SOCKET = Path("/run/libvirt/virtlogd-sock")
KVM_DEVICE = Path("/dev/kvm")
DOMAIN_TYPE = os.environ.get("ORKA_TEST_LIBVIRT_DOMAIN_TYPE", "qemu")
KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
MARKER = "orka-guest-hello"
# The guest powers itself off when its kernel command line holds this word.
POWEROFF_FLAG = "orka.poweroff"
# The guest prints this with its address once eth0 is configured.
NET_MARKER = "orka-guest-net"
# What the guest prints for each virtio disk it sees, given `orka.disks`: name and size in bytes.
DISK_MARKER = "orka-guest-disk"
# virtio_net and its dependencies, each after the modules it depends on (their `depends=`
# modinfo fields in the 6.1 cloud kernel); busybox insmod does not resolve dependencies.
NIC_MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_blk",
)
# Every domain of this test run carries this token in its name (tests put it in workload and
# instance names), so teardown finds this run's leftovers and nothing else.
RUN = uuid.uuid4().hex[:6]

MISSING = [p for p in (LIBVIRTD, VIRTLOGD, QEMU, BUSYBOX) if not Path(p).exists()]
needs_libvirt = pytest.mark.skipif(
    bool(MISSING),
    reason=f"missing {', '.join(MISSING)} (install libvirt-daemon-system, qemu-system-x86,"
    " busybox-static)",
)


def cache_dir() -> Path:
    path = Path(os.environ.get("ORKA_TEST_CACHE", Path.home() / ".cache" / "orka-test"))
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- daemons ---------------------------------------------------------------------------------


def _answers(uri: str) -> bool:
    import libvirt

    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    try:
        libvirt.open(uri).close()
    except libvirt.libvirtError:
        return False
    return True


@dataclass
class LibvirtDaemons:
    log_dir: Path
    uri: str = SYSTEM_URI
    token: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    reused: bool = False
    kvm_mode: tuple[int, int, int] | None = None  # (mode, uid, gid) to restore

    def start(self) -> None:
        self._kvm_like_udev()
        if _answers(self.uri):
            self.reused = True
            return
        if os.geteuid() != 0:
            pytest.skip(f"no libvirtd answers at {self.uri}, and only root can start one")
        if not _socket_answers(VIRTLOGD_SOCKET):
            self._spawn("virtlogd", [VIRTLOGD])
            _wait_for(lambda: _socket_answers(VIRTLOGD_SOCKET), 20, "virtlogd", self.log_dir)
        self._spawn("libvirtd", [LIBVIRTD])
        _wait_for(lambda: _answers(self.uri), 60, "libvirtd", self.log_dir)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        self.procs.append(proc)

    def cleanup_domains(self) -> None:
        """Destroy and undefine whatever this run left behind (by its token)."""
        import libvirt

        with contextlib.suppress(libvirt.libvirtError):
            conn = libvirt.open(self.uri)
            try:
                for dom in conn.listAllDomains(0):
                    if self.token and self.token in dom.name():
                        with contextlib.suppress(libvirt.libvirtError):
                            if dom.isActive():
                                dom.destroy()
                            dom.undefine()
            finally:
                conn.close()

    def _kvm_like_udev(self) -> None:
        try:
            st = KVM_DEVICE.stat()
            kvm_gid = grp.getgrnam("kvm").gr_gid
        except (OSError, KeyError):
            return
        if st.st_gid == kvm_gid and st.st_mode & 0o060 == 0o060:
            return
        if os.geteuid() != 0:
            return
        self.kvm_mode = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        os.chown(KVM_DEVICE, st.st_uid, kvm_gid)
        os.chmod(KVM_DEVICE, 0o660)

    def stop(self) -> None:
        self.cleanup_domains()
        # libvirtd first: it holds connections to virtlogd.
        for proc in reversed(self.procs):
            proc.terminate()
            reap(proc, 15, 5)
        self.procs.clear()
        if self.kvm_mode is not None:
            mode, uid, gid = self.kvm_mode
            with contextlib.suppress(OSError):
                os.chown(KVM_DEVICE, uid, gid)
                os.chmod(KVM_DEVICE, mode)


def _socket_answers(path: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _wait_for(check: object, timeout: float, what: str, log_dir: Path) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in log_dir.glob("*.log"))
    raise AssertionError(f"{what} did not come up within {timeout}s:\n{logs}")


# -- guest files -----------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelFiles:
    vmlinuz: Path
    # The NIC modules in load order; empty when unknown (the guest then has no network).
    modules: list[Path]


def cloud_kernel() -> KernelFiles:
    """A Debian cloud kernel's vmlinuz and its NIC modules, fetched once and cached."""
    override = os.environ.get("ORKA_TEST_KERNEL")
    if override:
        return KernelFiles(Path(override), _override_modules())
    cache = cache_dir()
    package = _current_kernel_package()
    if package is None:
        cached = sorted(cache.glob("linux-image-*/vmlinuz"))
        if cached:
            return KernelFiles(cached[-1], _cached_modules(cached[-1].parent))
        raise AssertionError(f"cannot resolve {KERNEL_META_PACKAGE} with apt-cache")
    target = cache / package / "vmlinuz"
    modules = _cached_modules(target.parent)
    if target.exists() and modules:
        return KernelFiles(target, modules)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # A cache from before the guest had a network holds the .deb: no apt needed then.
        debs = sorted((cache / package).glob("*.deb"))
        if debs:
            deb = debs[-1]
        else:
            subprocess.run(
                ["apt-get", "download", package],
                cwd=tmp,
                check=True,
                capture_output=True,
            )
            (deb,) = Path(tmp).glob("*.deb")
        subprocess.run(["dpkg", "-x", str(deb), f"{tmp}/x"], check=True, capture_output=True)
        (vmlinuz,) = Path(tmp, "x", "boot").glob("vmlinuz-*")
        target.parent.mkdir(parents=True, exist_ok=True)
        _unpack_modules(Path(tmp, "x", "lib", "modules"), target.parent / "modules")
        shutil.copyfile(vmlinuz, f"{target}.tmp")
        os.replace(f"{target}.tmp", target)
        if not debs:
            shutil.copyfile(deb, cache / package / deb.name)
    return KernelFiles(target, _cached_modules(target.parent))


def _find_module(tree: Path, name: str) -> Path | None:
    found = sorted(tree.rglob(f"{name}.ko")) + sorted(tree.rglob(f"{name}.ko.xz"))
    return found[0] if found else None


def _unpack_modules(tree: Path, into: Path) -> None:
    """Copy the NIC modules out of a kernel's module tree, uncompressed (busybox insmod reads
    plain .ko files; Debian 6.1 ships them plain, later kernels xz-compressed)."""
    tmp = into.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in NIC_MODULES:
        module = _find_module(tree, name)
        if module is None:
            raise AssertionError(f"kernel module {name} not found under {tree}")
        data = module.read_bytes()
        if module.name.endswith(".xz"):
            data = lzma.decompress(data)
        (tmp / f"{name}.ko").write_bytes(data)
    shutil.rmtree(into, ignore_errors=True)
    os.replace(tmp, into)


def _cached_modules(package_dir: Path) -> list[Path]:
    modules = [package_dir / "modules" / f"{name}.ko" for name in NIC_MODULES]
    return modules if all(m.exists() for m in modules) else []


def _override_modules() -> list[Path]:
    tree = os.environ.get("ORKA_TEST_KERNEL_MODULES")
    if not tree:
        return []
    into = cache_dir() / "override"
    _unpack_modules(Path(tree), into / "modules")
    return _cached_modules(into)


def _current_kernel_package() -> str | None:
    try:
        out = subprocess.run(
            ["apt-cache", "depends", KERNEL_META_PACKAGE],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        kind, _, name = line.strip().partition(": ")
        if kind == "Depends" and name.startswith("linux-image-"):
            return name
    return None


# Runs as PID 1: proves it is the guest talking (the kernel release is only known inside),
# then reads commands from the console (a shell), or powers off when asked on the kernel
# command line. Given `orka.ip=` it loads the virtio modules and configures eth0; given `orka.disks`
# it loads them and prints each virtio disk with its size (DISK_MARKER); given
# `orka.httpd=PORT` it serves a page on that port.
INIT = f"""#!/bin/busybox sh
bb=/bin/busybox
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
echo "{MARKER} kernel=$($bb uname -r)"
if $bb grep -q {POWEROFF_FLAG} /proc/cmdline; then
  $bb poweroff -f
fi
for word in $($bb cat /proc/cmdline); do
  case "$word" in
    orka.disks) disks=1 ;;
    orka.ip=*) ip="${{word#orka.ip=}}" ;;
    orka.gw=*) gw="${{word#orka.gw=}}" ;;
    orka.httpd=*) httpd="${{word#orka.httpd=}}" ;;
  esac
done
if [ -n "$ip" ] || [ -n "$disks" ]; then
  for module in $($bb cat /lib/modules/order); do
    $bb insmod /lib/modules/$module.ko || echo "orka-guest: insmod $module failed"
  done
fi
if [ -n "$disks" ]; then
  # Each virtio disk with its size in bytes, once the PCI probe has named them (5 s at most).
  tries=50
  while [ ! -e /sys/block/vdb ] && [ $tries -gt 0 ]; do
    $bb sleep 0.1
    tries=$((tries - 1))
  done
  for dev in /sys/block/vd*; do
    echo "{DISK_MARKER} ${{dev##*/}} $(( $($bb cat $dev/size) * 512 ))"
  done
fi
if [ -n "$ip" ]; then
  # The PCI probe that names eth0 may finish after insmod returns: wait for it (5 s at most).
  tries=50
  while [ ! -e /sys/class/net/eth0 ] && [ $tries -gt 0 ]; do
    $bb sleep 0.1
    tries=$((tries - 1))
  done
  $bb ip link set lo up
  $bb ip link set eth0 up
  $bb ip addr add "$ip" dev eth0
  if [ -n "$gw" ]; then $bb ip route add default via "$gw"; fi
  echo "{NET_MARKER} $($bb ip -4 -o addr show dev eth0)"
fi
if [ -n "$httpd" ]; then
  $bb mkdir -p /www
  echo "{MARKER} kernel=$($bb uname -r) ip=$ip" > /www/index.html
  $bb httpd -p "$httpd" -h /www
fi
# The console's input is a shell's (orka console types into it); idle otherwise.
while :; do $bb sh; $bb sleep 1; done
"""


def build_initramfs(path: Path, modules: list[Path] | None = None) -> None:
    """A gzipped newc cpio with a static busybox, `/init` and the NIC modules (no cpio tool
    needed)."""
    archive = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules"):
        archive.add(d, stat.S_IFDIR | 0o755)
    archive.add("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    archive.add("bin/busybox", stat.S_IFREG | 0o755, Path(BUSYBOX).read_bytes())
    archive.add("init", stat.S_IFREG | 0o755, INIT.encode())
    modules = modules or []
    for module in modules:
        archive.add(f"lib/modules/{module.name}", stat.S_IFREG | 0o644, module.read_bytes())
    order = "".join(f"{m.name.removesuffix('.ko')}\n" for m in modules)
    archive.add("lib/modules/order", stat.S_IFREG | 0o644, order.encode())
    path.write_bytes(gzip.compress(archive.finish(), compresslevel=1))


class _Cpio:
    """The SVR4 "newc" format the kernel unpacks: a 110-byte hex header per entry."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def add(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        encoded = name.encode() + b"\0"
        fields = [
            self.ino,
            mode,
            0,  # uid
            0,  # gid
            2 if stat.S_ISDIR(mode) else 1,
            int(time.time()),
            len(data),
            0,
            0,
            rdev[0],
            rdev[1],
            len(encoded),
            0,  # checksum, unused by newc
        ]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08x" % f for f in fields))
        self.buf.write(encoded)
        self._pad()
        self.buf.write(data)
        self._pad()

    def _pad(self) -> None:
        self.buf.write(b"\0" * (-self.buf.tell() % 4))

    def finish(self) -> bytes:
        self.add("TRAILER!!!", 0)
        return self.buf.getvalue()


@dataclass
class Guest:
    kernel: Path
    initrd: Path
    # Whether the initramfs holds the NIC modules (see the module docstring).
    networking: bool = False

    def cmdline(self, poweroff: bool = False, httpd_port: int | None = None) -> str:
        # panic=-1: a panicking guest reboots at once, which ends the domain (on_reboot=destroy).
        words = ["console=ttyS0", "panic=-1", "quiet"]
        if poweroff:
            words.append(POWEROFF_FLAG)
        if httpd_port is not None:
            words.append(f"orka.httpd={httpd_port}")
        return " ".join(words)


def make_guest(directory: Path) -> Guest:
    """Kernel and initramfs in `directory`, which QEMU's unprivileged user must be able to read."""
    directory.chmod(0o755)
    files = cloud_kernel()
    kernel = directory / "vmlinuz"
    shutil.copyfile(files.vmlinuz, kernel)
    initrd = directory / "initrd.gz"
    build_initramfs(initrd, files.modules)
    for f in (kernel, initrd):
        f.chmod(0o644)
    return Guest(kernel=kernel, initrd=initrd, networking=bool(files.modules))
