"""Fixtures shared by every test layer."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orka.security.issue import init_certs
from orka.taskdump import dump_tasks
from tests.containerd_env import Containerd, ContainerdDaemon
from tests.etcd import ETCD, EtcdCluster
from tests.libvirt_env import MISSING as LIBVIRT_MISSING
from tests.libvirt_env import RUN, Guest, LibvirtDaemons, make_guest

NODES = [f"node-{i}" for i in range(1, 7)]


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cluster CA with service, admin and agent certs, shared by the whole run."""
    path = tmp_path_factory.mktemp("certs")
    init_certs(path, nodes=NODES)
    return path


# SIGUSR1 prints every asyncio task's stack: how a hung async test is diagnosed.
signal.signal(signal.SIGUSR1, lambda signum, frame: dump_tasks())


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One real etcd member for the whole run; tests keep apart by key prefix (`etcd_prefix`)."""
    if not ETCD.exists():
        pytest.skip(f"{ETCD} missing (install Debian's etcd-server)")
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix of its own for each test on the shared etcd."""
    return f"/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    """One real containerd of our own for the whole run (tests/containerd_env.py); each test
    leaves its namespace empty (`Containerd.clean_namespace`)."""
    if shutil.which("containerd") is None or shutil.which("runc") is None:
        pytest.skip("containerd and runc are not installed (apt-get install containerd runc)")
    daemon = ContainerdDaemon(tmp_path_factory.mktemp("containerd"))
    try:
        yield daemon.start()
    finally:
        daemon.stop()


@pytest.fixture(scope="session")
def libvirt_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtDaemons]:
    """libvirtd + virtlogd (reused when one answers already; tests/libvirt_env.py)."""
    if LIBVIRT_MISSING:
        pytest.skip(f"missing {', '.join(LIBVIRT_MISSING)}")
    daemons = LibvirtDaemons(log_dir=tmp_path_factory.mktemp("libvirt-logs"), token=RUN)
    try:
        daemons.start()
        yield daemons
    finally:
        daemons.stop()


@pytest.fixture(scope="session")
def guest() -> Iterator[Guest]:
    """A Debian cloud kernel and a busybox initramfs where QEMU's own user can read them."""
    if LIBVIRT_MISSING:
        pytest.skip(f"missing {', '.join(LIBVIRT_MISSING)}")
    directory = Path(tempfile.mkdtemp(prefix=f"orka-vm-{RUN}-"))
    try:
        yield make_guest(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    with open("/proc/mounts", encoding="utf-8") as f:
        # /proc/mounts escapes a space in a path as \040: paths under a tmp_path have none.
        return [p for _, p, *_ in (line.split() for line in f) if p.startswith(prefix)]


@pytest.fixture(params=["Etc/GMT-12", "Etc/GMT+12"])
def off_utc(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The process in a time zone twelve hours either side of UTC, for what dates itself."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(autouse=True)
def _unmount_what_the_test_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Volumes outlive their agents by design (a restarted agent adopts them), so a test whose
    agents made ext4 volumes leaves them mounted under its tmp_path: unmount them (which also
    frees their loop devices) before the next test, deepest first."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if not isinstance(tmp, Path):
        return
    for path in sorted(_mounts_under(tmp), key=len, reverse=True):
        subprocess.run(["umount", "-l", path], check=False, capture_output=True)
