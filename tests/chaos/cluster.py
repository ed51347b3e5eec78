"""The chaos soak's cluster: every part a real OS process that a fault can kill, pause or cut off.

A 3-member etcd, controllers sharing it, schedulers (standbys join the election when there are
several) and agents running real processes. Each orka process starts inside a cgroup v2 directory
of its own, so that one iptables rule (`-m cgroup --path`) drops everything it sends: a
partition of that one process, loopback included, without touching the others.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.cgroups import remove_cgroup_parent, unique_parent
from tests.e2e.procs import free_port, spawn
from tests.etcd import EtcdCluster, EtcdMember
from tests.subprocs import reap


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (a hybrid host's `unified`, or a v2 host's
    root), if anywhere."""
    if Path("/sys/fs/cgroup/unified/cgroup.procs").exists():
        return Path("/sys/fs/cgroup/unified")
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return Path("/sys/fs/cgroup")
    return None


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", *args], check=True, capture_output=True)


@dataclass
class Member:
    """One process of the cluster. `args` are the orka CLI's (empty for etcd members)."""

    name: str
    role: str  # etcd | controller | scheduler | agent
    args: list[str]
    log: Path
    cgroup: Path | None = None
    etcd: EtcdMember | None = None
    initial_cluster: str = ""
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False
    partitioned: bool = False
    starts: int = 0

    @property
    def cgroup_path(self) -> str:
        assert self.cgroup is not None
        root = cgroup2_root()
        assert root is not None
        return str(self.cgroup.relative_to(root))

    def start(self) -> None:
        self.starts += 1
        if self.etcd is not None:
            self.etcd.start(self.initial_cluster, "new" if self.starts == 1 else "existing")
            self.proc = self.etcd.process
            return
        command = [sys.executable, "-m", "orka.cli.main", *self.args]
        if self.cgroup is not None:
            # The shell joins the cgroup before exec, so every socket the service opens is
            # the cgroup's (a socket keeps the cgroup of the task that made it).
            joined = f"echo $$ > {shlex.quote(str(self.cgroup / 'cgroup.procs'))} && exec "
            command = ["sh", "-c", joined + shlex.join(command)]
        self.proc = spawn(command, self.log)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        self.resume()
        self.heal()
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            reap(self.proc, 10)

    def pause(self) -> None:
        if self.alive and not self.paused:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.alive:
                assert self.proc is not None
                self.proc.send_signal(signal.SIGCONT)

    def partition(self) -> None:
        if self.cgroup is not None and not self.partitioned:
            _iptables("-I", "OUTPUT", "-m", "cgroup", "--path", self.cgroup_path, "-j", "DROP")
            self.partitioned = True

    def heal(self) -> None:
        if self.partitioned:
            self.partitioned = False
            with contextlib.suppress(subprocess.CalledProcessError):
                _iptables("-D", "OUTPUT", "-m", "cgroup", "--path", self.cgroup_path, "-j", "DROP")

    def stop(self) -> None:
        self.heal()
        self.resume()
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            reap(self.proc, 5, 5)


@dataclass
class ChaosCluster:
    certs: Path
    data: Path
    controllers: int = 2
    schedulers: int = 2
    agents: int = 5
    etcd_members: int = 3
    members: dict[str, Member] = field(default_factory=dict)
    cgroup_parent: str = field(default_factory=unique_parent)
    controller_ports: list[int] = field(default_factory=list)
    scheduler_ports: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.etcd = EtcdCluster(self.data / "etcd", self.etcd_members)
        root = cgroup2_root()
        self.cgroup_base = root / f"orka-chaos-{uuid.uuid4().hex[:8]}" if root else None
        self.controller_ports = [free_port() for _ in range(self.controllers)]
        self.scheduler_ports = [free_port() for _ in range(self.schedulers)]

    @property
    def can_partition(self) -> bool:
        return self.cgroup_base is not None

    @property
    def store_url(self) -> str:
        return self.etcd.url + "/chaos"

    @property
    def controller_addrs(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.controller_ports]

    @property
    def scheduler_addrs(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.scheduler_ports]

    def by_role(self, role: str) -> list[Member]:
        return [m for m in self.members.values() if m.role == role]

    def _member(self, name: str, role: str, args: list[str]) -> Member:
        cgroup = None
        if self.cgroup_base is not None:
            cgroup = self.cgroup_base / name
            cgroup.mkdir(parents=True, exist_ok=True)
        member = Member(name, role, args, self.data / f"{name}.log", cgroup=cgroup)
        self.members[name] = member
        return member

    def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.etcd.members)
        for em in self.etcd.members:
            member = Member(
                f"etcd-{em.name}", "etcd", [], self.data / "etcd" / f"{em.name}.log", etcd=em
            )
            member.initial_cluster = initial
            self.members[member.name] = member
        self.etcd.start()
        for m in self.by_role("etcd"):
            m.starts, m.proc = 1, m.etcd.process if m.etcd else None
        schedulers = ",".join(self.scheduler_addrs)
        for i, port in enumerate(self.scheduler_ports):
            # Several schedulers elect an active one on the store; a single one runs alone.
            store = ["--store", self.store_url] if self.schedulers > 1 else []
            self._member(
                f"scheduler-{i}",
                "scheduler",
                [
                    "scheduler",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--certs",
                    str(self.certs),
                    "--data-dir",
                    str(self.data / f"scheduler-{i}"),
                    *store,
                ],
            ).start()
        for i, port in enumerate(self.controller_ports):
            self._member(
                f"controller-{i}",
                "controller",
                [
                    "controller",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--scheduler",
                    schedulers,
                    "--certs",
                    str(self.certs),
                    "--data-dir",
                    str(self.data / f"controller-{i}"),
                    "--store",
                    self.store_url,
                ],
            ).start()
        for i in range(1, self.agents + 1):
            name = f"node-{i}"
            self._member(
                name,
                "agent",
                [
                    "agent",
                    "--name",
                    name,
                    "--scheduler",
                    schedulers,
                    "--certs",
                    str(self.certs),
                    "--data-dir",
                    str(self.data / "agents" / name),
                    "--runtime",
                    "process",
                    "--cgroup-parent",
                    f"{self.cgroup_parent}/{name}",
                ],
            ).start()

    def agent_of_cgroup(self, lines: str) -> str | None:
        """The agent whose instance cgroups hold a process, from its /proc/PID/cgroup text."""
        marker = f"/{self.cgroup_parent}/"
        for line in lines.splitlines():
            _, _, path = line.partition(":")[2].partition(":")
            if marker in path:
                rest = path.split(marker, 1)[1]
                return rest.split("/", 1)[0]
        return None

    def logs(self, lines: int = 30) -> str:
        parts = []
        for m in self.members.values():
            if m.log.exists():
                with open(m.log, errors="replace") as f:
                    parts.append(f"==== {m.name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(parts)

    def close(self) -> None:
        for m in self.members.values():
            with contextlib.suppress(Exception):
                if m.role != "etcd":
                    m.kill()
        for m in self.members.values():
            m.heal()
            m.resume()
        with contextlib.suppress(Exception):
            self.etcd.stop()
        for i in range(1, self.agents + 1):
            remove_cgroup_parent(f"{self.cgroup_parent}/node-{i}")
        if self.cgroup_base is not None and self.cgroup_base.exists():
            for child in self.cgroup_base.iterdir():
                if child.is_dir():
                    _drain(child)
            _drain(self.cgroup_base)


def _drain(cgroup: Path) -> None:
    """Kill what is left in a cgroup v2 directory, then remove it."""
    with contextlib.suppress(OSError):
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
