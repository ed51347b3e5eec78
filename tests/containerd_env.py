"""Real containerd for tests: a daemon of our own on temp dirs and a busybox OCI archive.

containerd (Debian's 1.6 + runc) runs with its own root, state and socket under a temp dir, the
CRI plugin disabled, so it never meets a containerd the host may already run. The image is a
tiny OCI archive built from busybox-static (`orka.runtime.oci_archive`); no registry is needed.
Containers go under a cgroup parent named for this test process, so concurrent runs on one
machine keep apart; the (empty) parent is removed when the daemon stops.

The pytest fixture (`containerd`, one daemon per test session) lives in tests/conftest.py;
`needs_containerd` skips only when the binaries are missing (`.ci/run` installs them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orka.runtime.oci_archive import build
from tests.subprocs import reap

NAMESPACE = "orka"
CGROUP_ROOT = Path("/sys/fs/cgroup")

needs_containerd = pytest.mark.skipif(
    shutil.which("containerd") is None or shutil.which("runc") is None,
    reason="containerd and runc are not installed (apt-get install containerd runc)",
)


@dataclass
class Containerd:
    socket: str
    image: str  # "oci-archive:/path.tar"
    cgroup_parent: str

    def ctr(self, *args: str) -> str:
        """The stock CLI, as an independent witness of what the driver left in containerd."""
        out = subprocess.run(
            ["ctr", "-a", self.socket, "-n", NAMESPACE, *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout

    def ids(self, *args: str) -> list[str]:
        return self.ctr(*args).split()

    def options(self) -> dict[str, str]:
        """`ContainerdDriver` keyword arguments (the agent's `driver_options["containerd"]`)."""
        return {"socket": self.socket, "cgroup_parent": self.cgroup_parent}

    def allowed_paths(self) -> list[Path]:
        """What the agent must allow (`AgentConfig.allowed_paths`) for the archive image."""
        return [Path(self.image.removeprefix("oci-archive:")).parent]

    def agent_flags(self) -> list[str]:
        """The same, as `orka agent` flags."""
        return [
            "--containerd-socket",
            self.socket,
            "--containerd-cgroup-parent",
            self.cgroup_parent,
        ]

    def clean_namespace(self) -> None:
        """Kill and delete whatever a failed test left, so containerd's shims do not linger."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            for task in self.ids("tasks", "ls", "-q"):
                with contextlib.suppress(subprocess.SubprocessError):
                    self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", task)
                time.sleep(0.2)
                with contextlib.suppress(subprocess.SubprocessError):
                    self.ctr("tasks", "delete", "-f", task)
            for container in self.ids("containers", "ls", "-q"):
                with contextlib.suppress(subprocess.SubprocessError):
                    self.ctr("containers", "delete", container)


def config_toml(base: Path, socket: Path) -> str:
    return f"""version = 2
root = "{base}/root"
state = "{base}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
"""


@dataclass
class ContainerdDaemon:
    """`containerd --config` on `base`, plus the busybox archive; `start()`, then `stop()`."""

    base: Path
    proc: subprocess.Popen[bytes] | None = None
    ctd: Containerd | None = field(default=None)

    @property
    def log_path(self) -> Path:
        return self.base / "containerd.log"

    def start(self, timeout: float = 20.0) -> Containerd:
        socket = self.base / "containerd.sock"
        config = self.base / "config.toml"
        config.write_text(config_toml(self.base, socket))
        archive = self.base / "busybox-oci.tar"
        build(archive)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                ["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        self.ctd = Containerd(
            socket=str(socket),
            image=f"oci-archive:{archive}",
            # Our own cgroup parent: other test runs on this machine use other ones.
            cgroup_parent=f"/orka-test-{os.getpid()}",
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited: {self.log_path.read_text()}")
            if socket.exists():
                try:
                    self.ctd.ctr("version")
                    return self.ctd
                except subprocess.SubprocessError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not come up within {timeout:g}s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.ctd is not None:
            self.ctd.clean_namespace()
        if self.proc is not None:
            self.proc.terminate()
            reap(self.proc, 10)
            self.proc = None
        if self.ctd is not None:
            # runc removes each container's cgroup but not the (now empty) parent we chose.
            parent = self.ctd.cgroup_parent
            for path in CGROUP_ROOT.glob(f"*{parent}"):
                with contextlib.suppress(OSError):
                    path.rmdir()
            with contextlib.suppress(OSError):
                (CGROUP_ROOT / parent.lstrip("/")).rmdir()
