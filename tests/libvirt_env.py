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
"""

from __future__ import annotations

import contextlib
import grp
import gzip
import io
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


def cloud_kernel() -> Path:
    """A Debian cloud kernel's vmlinuz, fetched once and cached."""
    override = os.environ.get("ORKA_TEST_KERNEL")
    if override:
        return Path(override)
    cache = cache_dir()
    package = _current_kernel_package()
    if package is None:
        cached = sorted(cache.glob("linux-image-*/vmlinuz"))
        if cached:
            return cached[-1]
        raise AssertionError(f"cannot resolve {KERNEL_META_PACKAGE} with apt-cache")
    target = cache / package / "vmlinuz"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
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
        shutil.copyfile(vmlinuz, f"{target}.tmp")
        os.replace(f"{target}.tmp", target)
        shutil.copyfile(deb, cache / package / deb.name)
    return target


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
# then idles, or powers off when asked on the kernel command line.
INIT = f"""#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
echo "{MARKER} kernel=$(/bin/busybox uname -r)"
if /bin/busybox grep -q {POWEROFF_FLAG} /proc/cmdline; then
  /bin/busybox poweroff -f
fi
while :; do /bin/busybox sleep 3600; done
"""


def build_initramfs(path: Path) -> None:
    """A gzipped newc cpio with a static busybox and `/init` (no cpio tool needed)."""
    archive = _Cpio()
    for d in ("bin", "dev", "proc", "sys"):
        archive.add(d, stat.S_IFDIR | 0o755)
    archive.add("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    archive.add("bin/busybox", stat.S_IFREG | 0o755, Path(BUSYBOX).read_bytes())
    archive.add("init", stat.S_IFREG | 0o755, INIT.encode())
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

    def cmdline(self, poweroff: bool = False) -> str:
        # panic=-1: a panicking guest reboots at once, which ends the domain (on_reboot=destroy).
        words = ["console=ttyS0", "panic=-1", "quiet"]
        if poweroff:
            words.append(POWEROFF_FLAG)
        return " ".join(words)


def make_guest(directory: Path) -> Guest:
    """Kernel and initramfs in `directory`, which QEMU's unprivileged user must be able to read."""
    directory.chmod(0o755)
    kernel = directory / "vmlinuz"
    shutil.copyfile(cloud_kernel(), kernel)
    initrd = directory / "initrd.gz"
    build_initramfs(initrd)
    for f in (kernel, initrd):
        f.chmod(0o644)
    return Guest(kernel=kernel, initrd=initrd)
