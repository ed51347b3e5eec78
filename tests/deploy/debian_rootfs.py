"""A Debian 12 root file system made with debootstrap, for the deployment tests: the stand-in
for the Dockerfile's base image (no registry is reachable) and the machine systemd boots in.

Built once per package list and kept under ORKA_TEST_CACHE (default /var/cache/orka-tests), so
a second run, or the second test that asks for the same list, costs nothing. The build happens
in a temporary folder renamed into place, under a file lock: a run killed half-way leaves no
half-built root behind, and two tests asking at once build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# What the host's pip needs to reach the package index from inside (a proxy's CA, an index URL).
HOST_PIP_FILES = ("/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt")


def cache_dir() -> Path:
    return Path(os.environ.get("ORKA_TEST_CACHE", "/var/cache/orka-tests"))


def host_mirror() -> str:
    """The Debian mirror this machine's apt uses (the one registry the tests may reach)."""
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        try:
            text = path.read_text()
        except OSError:
            continue
        match = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.MULTILINE) or re.search(
            r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s+\S+", text, re.MULTILINE
        )
        if match:
            return match.group(1)
    return DEFAULT_MIRROR


def missing_tools() -> list[str]:
    return [tool for tool in ("debootstrap",) if shutil.which(tool) is None]


def debian_rootfs(name: str, include: Sequence[str], variant: str = "minbase") -> Path:
    """The root file system `name` with `include` installed (debootstrap `variant`), built on
    first use. Treat it as read-only: copy it (`copy_rootfs`) before booting or changing it."""
    key = hashlib.sha256(f"{SUITE} {variant} {' '.join(sorted(include))}".encode()).hexdigest()
    root = cache_dir() / f"{name}-{key[:12]}"
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").exists():
            return root
        building = root.with_name(root.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(
            [
                "debootstrap",
                f"--variant={variant}",
                f"--include={','.join(include)}",
                SUITE,
                str(building),
                host_mirror(),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=900,
        )
        _prepare_pip(building)
        (building / ".complete").write_text(key + "\n")
        building.rename(root)
    return root


def _prepare_pip(root: Path) -> None:
    """Let pip install into the system Python (as a base image allows) through the host's pip
    configuration; apt's lists are dropped as an image build would."""
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    for name in HOST_PIP_FILES:
        src = Path(name)
        if src.is_file():
            dest = root / name.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)


def copy_rootfs(src: Path, dest: Path) -> Path:
    """A private, writable copy of a cached root (hard links would share inodes with the
    cache: a booted system writing in place would change it for the next test)."""
    subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], check=True)
    return dest
