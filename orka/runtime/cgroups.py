"""One cgroup per process instance, with the limits its resources ask for.

Two hierarchies, one interface:

- cgroup v2 (Debian 12 and every current distribution) where the unified hierarchy offers the
  memory and cpu controllers: `<root>/<parent>/<instance>` with `memory.max`,
  `memory.swap.max` 0 (a limit that spills into swap is no limit), `memory.oom.group` 1 (the
  OOM killer takes the whole instance, not one of its processes) and `cpu.max`
  "<quota> <period>". OOM kills are counted in `memory.events` (`oom_kill`).
- cgroup v1 (older hosts, and CI here): the same directory under the memory and the cpu
  hierarchies, with `memory.limit_in_bytes` (+ `memory.memsw.limit_in_bytes` when swap
  accounting is on) and `cpu.cfs_quota_us` / `cpu.cfs_period_us`. OOM kills are counted in
  `memory.oom_control` (`oom_kill`, kernel 4.13+), else inferred from `memory.failcnt`.

A resource of 0 means no limit for it. The directory is named after the instance, so a
restarted agent finds an adopted instance's cgroup again without any record of it.

Processes join by writing their own pid to `cgroup.procs` before they exec the workload (see
`launch.py`), so nothing of the workload ever runs outside. Whatever the agent's own
permissions allow decides which hierarchy is used: where none is writable (an unprivileged
agent) `detect` returns None and limits are not enforced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path

import structlog

from orka.models import Resources

log = structlog.get_logger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# The CFS period: 100 ms, the kernel's default and what container runtimes use.
CPU_PERIOD_US = 100_000
# The kernel refuses quotas under 1 ms.
_MIN_QUOTA_US = 1_000
_PROCS = "cgroup.procs"


def cpu_quota_us(cpu_millis: int) -> int:
    """The quota per period for a share of CPUs in millicores (1000 = one CPU)."""
    return max(_MIN_QUOTA_US, cpu_millis * CPU_PERIOD_US // 1000)


class Cgroups(ABC):
    """Per-instance cgroups under one parent path (e.g. `orka/<node>`)."""

    version: int

    def __init__(self, parent: str) -> None:
        self.parent = parent.strip("/")

    @abstractmethod
    def dirs(self, name: str) -> list[Path]:
        """The instance's directory in each hierarchy used."""

    @abstractmethod
    def create(self, name: str, resources: Resources) -> None:
        """Make the instance's cgroup (again) and write its limits (blocking)."""

    @abstractmethod
    def oom_kills(self, name: str) -> int:
        """How many processes of the instance the OOM killer killed (0 when unknown)."""

    def procs_files(self, name: str) -> list[Path]:
        """The files a process writes its pid to, to join the instance's cgroup."""
        return [d / _PROCS for d in self.dirs(name)]

    def exists(self, name: str) -> bool:
        return any(d.is_dir() for d in self.dirs(name))

    def pids(self, name: str) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files(name):
            with contextlib.suppress(OSError, ValueError):
                found.update(int(line) for line in path.read_text().split())
        return found

    def kill(self, name: str) -> None:
        """SIGKILL every process in the instance's cgroup, including ones that left its group."""
        # Re-read a few times: a process may fork while we kill its siblings.
        for _ in range(10):
            pids = self.pids(name)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove_parent(self) -> None:
        """Remove the parent's levels that are empty (blocking): an agent that stopped its
        instances leaves nothing behind; one whose instances still run keeps it."""
        for d in {d.parent for d in self.dirs("x")}:
            for _ in Path(self.parent).parts:
                try:
                    d.rmdir()
                except OSError:
                    break  # not empty (instances, other nodes) or already gone
                d = d.parent

    def remove(self, name: str, timeout: float = 5.0) -> None:
        """Kill what is left and remove the instance's cgroup (blocking, idempotent)."""
        self.kill(name)
        deadline = time.monotonic() + timeout
        for d in self.dirs(name):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    # EBUSY until the killed processes are reaped by their parent.
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("cgroup.remove_failed", path=str(d), error=str(exc))
                        break
                    self.kill(name)
                    time.sleep(0.02)


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_key(path: Path, key: str) -> int | None:
    """The value of `key` in a flat keyed file such as memory.events, or None."""
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


class CgroupsV2(Cgroups):
    version = 2

    def __init__(self, root: Path, parent: str) -> None:
        super().__init__(parent)
        self.root = root

    def dirs(self, name: str) -> list[Path]:
        return [self.root / self.parent / name]

    def prepare(self) -> None:
        """Make the parent and let its children use memory and cpu (root-to-leaf)."""
        current = self.root
        for part in Path(self.parent).parts:
            _enable_controllers(current)
            current = current / part
            current.mkdir(exist_ok=True)
        _enable_controllers(current)

    def create(self, name: str, resources: Resources) -> None:
        self.prepare()
        d = self.root / self.parent / name
        d.mkdir(exist_ok=True)
        mem = resources.memory_bytes
        _write(d / "memory.max", str(mem) if mem else "max")
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0" if mem else "max")
        _write(d / "memory.oom.group", "1")
        cpu = resources.cpu_millis
        quota = str(cpu_quota_us(cpu)) if cpu else "max"
        _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")

    def oom_kills(self, name: str) -> int:
        return _read_key(self.dirs(name)[0] / "memory.events", "oom_kill") or 0

    def kill(self, name: str) -> None:
        # cgroup.kill (Linux 5.14+) kills the whole subtree atomically, forks included.
        kill_file = self.dirs(name)[0] / "cgroup.kill"
        if kill_file.exists():
            with contextlib.suppress(OSError):
                _write(kill_file, "1")
        super().kill(name)


def _enable_controllers(cgroup: Path) -> None:
    have = set((cgroup / "cgroup.subtree_control").read_text().split())
    missing = [c for c in ("memory", "cpu") if c not in have]
    if missing:
        _write(cgroup / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


class CgroupsV1(Cgroups):
    version = 1

    def __init__(self, memory_root: Path, cpu_root: Path, parent: str) -> None:
        super().__init__(parent)
        self.memory_root = memory_root
        self.cpu_root = cpu_root

    def dirs(self, name: str) -> list[Path]:
        return [self.memory_root / self.parent / name, self.cpu_root / self.parent / name]

    def prepare(self) -> None:
        for root in (self.memory_root, self.cpu_root):
            (root / self.parent).mkdir(parents=True, exist_ok=True)

    def create(self, name: str, resources: Resources) -> None:
        self.prepare()
        mem_dir, cpu_dir = self.dirs(name)
        mem_dir.mkdir(exist_ok=True)
        cpu_dir.mkdir(exist_ok=True)
        mem = resources.memory_bytes
        memsw = mem_dir / "memory.memsw.limit_in_bytes"
        # memsw must stay >= the memory limit at every step: raise it first, lower it last.
        if memsw.exists():
            _write(memsw, "-1")
        _write(mem_dir / "memory.limit_in_bytes", str(mem) if mem else "-1")
        if memsw.exists() and mem:
            _write(memsw, str(mem))
        # oom_control's 0 keeps the OOM killer on (1 would freeze the instance instead).
        _write(mem_dir / "memory.oom_control", "0")
        cpu = resources.cpu_millis
        _write(cpu_dir / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(cpu_dir / "cpu.cfs_quota_us", str(cpu_quota_us(cpu)) if cpu else "-1")

    def oom_kills(self, name: str) -> int:
        mem_dir = self.dirs(name)[0]
        kills = _read_key(mem_dir / "memory.oom_control", "oom_kill")
        if kills is not None:
            return kills
        # Kernels before 4.13 do not count kills; hitting the limit is the closest sign.
        with contextlib.suppress(OSError, ValueError):
            return int((mem_dir / "memory.failcnt").read_text())
        return 0


def _mounts(mountinfo: Path) -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of each mount in a mountinfo file."""
    found = []
    with contextlib.suppress(OSError):
        for line in mountinfo.read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 5 or len(rfields) < 3:
                continue
            found.append((fields[4], rfields[0], set(rfields[2].split(","))))
    return found


def detect(
    parent: str, mountinfo: Path = Path("/proc/self/mountinfo")
) -> tuple[Cgroups | None, str]:
    """The cgroups this agent can manage for its instances, or None with the reason why not.

    v2 wins where the unified hierarchy has both controllers; its parent (and the v1 parent
    dirs) is created here, which is also the test that this process may write there.
    """
    mounts = _mounts(mountinfo)
    reasons = []
    for point, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        root = Path(point)
        try:
            controllers = set((root / "cgroup.controllers").read_text().split())
        except OSError:
            continue
        if not {"memory", "cpu"} <= controllers:
            reasons.append(f"cgroup v2 at {root} lacks the memory or cpu controller")
            continue
        v2 = CgroupsV2(root, parent)
        try:
            v2.prepare()
        except OSError as exc:
            reasons.append(f"cgroup v2 at {root}: {exc.strerror or exc}")
            continue
        return v2, ""
    memory = next((Path(p) for p, t, o in mounts if t == "cgroup" and "memory" in o), None)
    cpu = next((Path(p) for p, t, o in mounts if t == "cgroup" and "cpu" in o), None)
    if memory is not None and cpu is not None:
        v1 = CgroupsV1(memory, cpu, parent)
        try:
            v1.prepare()
            return v1, ""
        except OSError as exc:
            reasons.append(f"cgroup v1 ({memory}, {cpu}): {exc.strerror or exc}")
    elif not reasons:
        reasons.append("no cgroup hierarchy with the memory and cpu controllers is mounted")
    return None, "; ".join(reasons)
