"""Controller, scheduler and agents as separate OS processes on loopback, for end-to-end tests."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.rpc.client import secure_channel
from orka.rpc.pages import list_all
from orka.security.tls import TlsFiles
from tests.cgroups import remove_cgroup_parent, unique_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start an orka service (or a wrapper that execs one) in a session of its own, its output
    appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ORKA_LOG_LEVEL": "info"},
            start_new_session=True,
        )


class Service:
    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name = name
        self.args = args
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = spawn([sys.executable, "-m", "orka.cli.main", *self.args], self.log)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class ProcessCluster:
    """`store_url` (etcd://...) lets several controllers share one store; `runtime` is the
    agents' driver (`fake` for scale tests: it runs every kind instantly)."""

    def __init__(
        self, certs: Path, data: Path, store_url: str = "", runtime: str = "process"
    ) -> None:
        self.certs = certs
        self.data = data
        self.store_url = store_url
        self.runtime = runtime
        self.scheduler_port = free_port()
        # Every scheduler agents and controllers are given (several: standby schedulers).
        self.scheduler_addrs: list[str] = []
        self.controller_port = free_port()
        self.services: dict[str, Service] = {}
        self.cgroup_parent = unique_parent()
        self.agent_names: set[str] = set()
        self.channel = None
        self.api: pb_grpc.ControllerStub | None = None

    @property
    def scheduler_addr(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    @property
    def scheduler_flag(self) -> str:
        return ",".join(self.scheduler_addrs) or self.scheduler_addr

    def _service(self, name: str, args: list[str]) -> Service:
        svc = Service(name, args, self.data / f"{name}.log")
        self.services[name] = svc
        svc.start()
        return svc

    def start_scheduler(
        self, *extra: str, name: str = "scheduler", address: str | None = None
    ) -> Service:
        return self._service(
            name,
            [
                "scheduler",
                "--listen",
                address or self.scheduler_addr,
                "--certs",
                str(self.certs),
                "--data-dir",
                str(self.data / name),
                *extra,
            ],
        )

    def start_controller(
        self, name: str = "controller", port: int | None = None, *extra: str
    ) -> Service:
        port = port or self.controller_port
        store = ["--store", self.store_url] if self.store_url else []
        return self._service(
            name,
            [
                "controller",
                "--listen",
                f"127.0.0.1:{port}",
                "--scheduler",
                self.scheduler_flag,
                "--certs",
                str(self.certs),
                "--data-dir",
                str(self.data / name),
                *store,
                *extra,
            ],
        )

    def start_agent(self, name: str, *extra: str) -> Service:
        self.agent_names.add(name)
        return self._service(
            name,
            [
                "agent",
                "--name",
                name,
                "--scheduler",
                self.scheduler_flag,
                "--certs",
                str(self.certs),
                "--data-dir",
                str(self.data / "agents" / name),
                "--runtime",
                self.runtime,
                # Instance cgroups of this cluster's own, removed by close().
                "--cgroup-parent",
                f"{self.cgroup_parent}/{name}",
                *extra,
            ],
        )

    async def connect(self, port: int | None = None) -> pb_grpc.ControllerStub:
        if self.channel is not None:
            await self.channel.close()
        self.channel = secure_channel(
            f"127.0.0.1:{port or self.controller_port}",
            TlsFiles.for_service(self.certs, "admin", "admin"),
            "controller",
        )
        self.api = pb_grpc.ControllerStub(self.channel)
        return self.api

    async def nodes(self) -> dict[str, int]:
        assert self.api is not None
        nodes, _ = await list_all(
            functools.partial(self.api.ListNodes, timeout=5), pb.ListNodesRequest(), "nodes"
        )
        return {n.name: n.state for n in nodes}

    async def instances(self, workload: str) -> list[pb.Instance]:
        assert self.api is not None
        items, _ = await list_all(
            functools.partial(self.api.ListInstances, timeout=5),
            pb.ListInstancesRequest(workload=workload),
            "instances",
        )
        return items

    async def running(self, workload: str) -> list[pb.Instance]:
        return [i for i in await self.instances(workload) if i.phase == pb.Instance.RUNNING]

    def logs(self) -> str:
        parts = []
        for svc in self.services.values():
            with open(svc.log, errors="replace") as f:
                parts.append(f"==== {svc.name}\n" + "".join(f.readlines()[-40:]))
        return "\n".join(parts)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        for svc in self.services.values():
            svc.kill()
        for name in self.agent_names:
            remove_cgroup_parent(f"{self.cgroup_parent}/{name}")


async def nodes_ready(c: ProcessCluster, names: list[str]) -> bool:
    """Whether the controller reports every one of `names` READY; False while it cannot answer."""
    try:
        nodes = await c.nodes()
    except Exception:
        return False
    return all(nodes.get(n) == pb.Node.READY for n in names)


def host_copies(workload: str) -> dict[str, int]:
    """Instance name -> pid of every live workload process on this host (not the wrappers)."""
    found: dict[str, int] = {}
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["name"] != "sleep":
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get("ORKA_WORKLOAD") == workload:
            found[env.get("ORKA_INSTANCE", "?")] = proc.info["pid"]
    return found


def kill_host_copies(workload: str) -> None:
    for pid in host_copies(workload).values():
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def sleep_spec(name: str, replicas: int) -> pb.WorkloadSpec:
    """A process workload that runs until stopped."""
    return pb.WorkloadSpec(
        name=name, kind=pb.WorkloadSpec.PROCESS, command=["sleep", "1000"], replicas=replicas
    )


def monotonic() -> float:
    return time.monotonic()


async def run_orka(
    c: ProcessCluster, *args: str, timeout: float = 60.0, controller: str | None = None
) -> str:
    """One `orka` command against the cluster (its controller, or `controller`), exactly as a
    user runs it; must exit 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        *args,
        "--controller",
        controller or f"127.0.0.1:{c.controller_port}",
        "--certs",
        str(c.certs),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("ORKA_")},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"orka {' '.join(args)}: still running after {timeout:g}s") from None
    assert proc.returncode == 0, (
        f"orka {' '.join(args)} exited {proc.returncode}\n{out.decode()}\n{err.decode()}"
    )
    return out.decode()
