"""The node agent: one supervising object over the parts that each own one job.

- the stream (`stream.py`): the connection to a scheduler, heartbeats and events;
- admission (`admission.py`): the agent's own check of each offer, and reservations;
- the runner (`runner.py`): the instances here, their state file, start and stop commands.

`Agent` builds them, routes what the scheduler sends to the part it is for, and supervises
the loops (the stream, the state file's writer): if one fails, the whole agent stops
(orka.supervision) and `run()` raises why. On stop it leaves first when asked to
(instances move elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import structlog

from orka.agent.admission import Admission
from orka.agent.logs import LogKeeper
from orka.agent.runner import Runner
from orka.agent.secret_files import SecretFiles
from orka.agent.sessions import Sessions
from orka.agent.state import StateFile
from orka.agent.stream import Stream
from orka.agent.supervisor import Supervised
from orka.agent.volumes import VolumeManager
from orka.api import agent_pb2 as apb
from orka.errors import Invalid
from orka.models import DEFAULT_POOL, Resources, check_name
from orka.rpc import convert
from orka.runtime.base import Driver
from orka.runtime.host_ports import DEFAULT_RANGE, HostPorts
from orka.runtime.identity import DEFAULT_WORKLOAD_USER
from orka.runtime.logs import DEFAULT_MAX_BYTES as DEFAULT_LOG_MAX_BYTES
from orka.runtime.network import DEFAULT_BIN_DIRS, CniNetwork
from orka.runtime.registry import make_driver, takes
from orka.security.tls import TlsFiles
from orka.supervision import PartFailed, Parts
from orka.validation import RESERVED_LABEL_PREFIX, reserved_labels

log = structlog.get_logger("orka.agent")


@dataclass
class AgentConfig:
    name: str
    schedulers: list[str]
    data_dir: Path
    runtimes: list[str] = field(default_factory=lambda: ["process"])
    cpu_millis: int | None = None
    memory_bytes: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_interval: float = 1.0  # until the scheduler says otherwise
    leave_timeout: float = 60.0
    reconnect_max: float = 5.0
    # Per-driver keyword options for make_driver, e.g. {"containerd": {"socket": "/x.sock"}}.
    driver_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Process workloads: who they run as when the spec names no user, whether root may be
    # named at all, and the cgroup under which each instance gets its own (default orka/<name>).
    workload_user: str = DEFAULT_WORKLOAD_USER
    workload_group: str = ""
    allow_root_workloads: bool = False
    cgroup_parent: str = ""
    # Directories whose files workloads may name in secret_env_files (none: no such files).
    secret_dirs: list[Path] = field(default_factory=list)
    # Directories VM images, kernels, initrds and oci-archive: images may come from; a spec
    # naming a file elsewhere is refused at admission. None: `<data dir>/images`.
    allowed_paths: list[Path] | None = None
    # The node's address (instances' ORKA_HOST_IP, where their host ports are reached) and
    # the range host ports are picked from for ports that ask for none.
    host_ip: str = "127.0.0.1"
    host_port_range: tuple[int, int] = DEFAULT_RANGE
    # The node's instance network (orka.runtime.network): its bridge and subnet ("": derived
    # from the node name and data dir), masquerade for traffic leaving the node, and where
    # the CNI plugins are.
    network_bridge: str = ""
    network_subnet: str = ""
    network_masquerade: bool = False
    cni_bin_dirs: list[Path] = field(default_factory=lambda: list(DEFAULT_BIN_DIRS))
    # Each instance's stdout and stderr are rotated past this size (one rotated file kept).
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES
    # The pool the node joins, and where its volumes live (None: `<data dir>/volumes`).
    pool: str = DEFAULT_POOL
    volume_dir: Path | None = None

    def __post_init__(self) -> None:
        try:
            check_name(self.pool, "--pool")
        except ValueError as err:
            raise Invalid(str(err)) from None
        if self.volume_dir is None:
            self.volume_dir = self.data_dir / "volumes"
        elif not self.volume_dir.is_absolute():
            raise Invalid(f"--volume-dir: {str(self.volume_dir)!r} must be an absolute path")
        if not self.schedulers:
            raise Invalid("--scheduler: at least one HOST:PORT is required")
        if not self.runtimes:
            raise Invalid("--runtime: at least one driver is required")
        if self.allowed_paths is None:
            self.allowed_paths = [self.data_dir / "images"]
        for path in self.allowed_paths:
            if not path.is_absolute():
                raise Invalid(f"--allowed-paths: {str(path)!r} must be an absolute path")
        reserved = reserved_labels(self.labels)
        if reserved:
            raise Invalid(
                f"--labels: {', '.join(reserved)}: the {RESERVED_LABEL_PREFIX} prefix is set by"
                " the scheduler only"
            )
        for flag, value in (
            ("--cpu-millis", self.cpu_millis),
            ("--memory-bytes", self.memory_bytes),
            ("--log-max-bytes", self.log_max_bytes),
        ):
            if value is not None and value <= 0:
                raise Invalid(f"{flag}: must be > 0, got {value}")


def detect_capacity() -> Resources:
    return Resources(
        cpu_millis=(os.cpu_count() or 1) * 1000, memory_bytes=psutil.virtual_memory().total
    )


class Agent:
    # The parts' classes: a variant of the agent (a test's, a benchmark's) names its own.
    stream_class: type[Stream] = Stream
    admission_class: type[Admission] = Admission

    def __init__(self, config: AgentConfig, tls: TlsFiles) -> None:
        self.config = config
        self.tls = tls
        self.name = config.name
        detected = detect_capacity()
        self.capacity = Resources(
            cpu_millis=config.cpu_millis or detected.cpu_millis,
            memory_bytes=config.memory_bytes or detected.memory_bytes,
        )
        self.drivers: dict[str, Driver] = {}
        self.healthy: dict[str, Driver] = {}
        self.instances: dict[str, Supervised] = {}
        self.state_file = StateFile(config.data_dir / "agent-state.json")
        # One allocator for every driver: a process and a container must not share a port.
        self.host_ports = HostPorts(*config.host_port_range)
        # Built in start(), once the data dir exists; shared by every driver like the ports.
        self.network: CniNetwork | None = None
        assert config.volume_dir is not None  # set in AgentConfig
        self.volumes = VolumeManager(
            config.volume_dir,
            send=lambda msg: self.stream.send(msg),
            ack=lambda command_id, status: self.stream.ack(command_id, status),
        )
        self.stream = self.stream_class(
            schedulers=config.schedulers,
            tls=tls,
            capacity=self.capacity,
            labels=config.labels,
            healthy=self.healthy,
            instances=self.instances,
            heartbeat_interval=config.heartbeat_interval,
            reconnect_max=config.reconnect_max,
            on_message=self._on_message,
            allocated=self._allocated_now,
            usage=self._usage,
            leaving=lambda: self._leaving,
            pool=config.pool,
            volumes=self.volumes,
        )
        self.admission = self.admission_class(
            capacity=self.capacity,
            allowed_paths=config.allowed_paths or [],
            healthy=self.healthy,
            instances=self.instances,
            shutting_down=lambda: self._leaving or self._stopping.is_set(),
            send=self.stream.send,
            node=self.name,
        )
        self.runner = Runner(
            node=self.name,
            drivers=self.drivers,
            healthy=self.healthy,
            state_file=self.state_file,
            secret_files=SecretFiles(config.secret_dirs),
            admission=self.admission,
            ack=self.stream.ack,
            on_change=self.stream.instance_changed,
            instances=self.instances,
            host_ip=config.host_ip,
            volumes=self.volumes,
        )
        self.connected = self.stream.connected
        self.logs = LogKeeper(self.instances, config.log_max_bytes)
        self.sessions = Sessions(self.instances, self.stream.send, self.logs)
        self.stream.on_disconnect = self.sessions.close_all
        self.parts = Parts("agent", self._fail)
        self._stopping = asyncio.Event()
        self._leaving = False
        # The scheduler's answer to our leave on the current stream (None: none yet).
        self._leave_reply: apb.LeaveReply | None = None
        self._stopped = False
        self._failed: PartFailed | None = None

    # ---- lifecycle ----

    async def start(self) -> None:
        # Traversable only: workloads reach their own work dir (see orka.runtime.process) but
        # can list nothing here, and every file the agent keeps here is 0600.
        self.config.data_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.config.data_dir.chmod(0o711)
        (self.config.data_dir / "runtime").mkdir(mode=0o711, exist_ok=True)
        c = self.config
        self.network = CniNetwork(
            c.data_dir / "network",
            node=self.name,
            host_ports=self.host_ports,
            bridge=c.network_bridge,
            subnet=c.network_subnet,
            masquerade=c.network_masquerade,
            bin_dirs=c.cni_bin_dirs,
        )
        problem = self.network.unavailable()
        if problem:
            log.warning("instance network unavailable", reason=problem)
        else:
            log.info(
                "instance network", bridge=self.network.bridge, subnet=str(self.network.subnet)
            )
        for name in self.config.runtimes:
            driver = make_driver(
                name, self.config.data_dir / "runtime" / name, **self._driver_options(name)
            )
            self.drivers[name] = driver
            health = await driver.health()
            if health.healthy:
                self.healthy[name] = driver
            else:
                log.warning("driver unhealthy", driver=name, message=health.message)
        if not self.healthy:
            raise Invalid(f"--runtime: no healthy driver among {', '.join(self.config.runtimes)}")
        self.parts.watch("state file", self.state_file.writer())
        # Volumes first: a re-adopted instance that restarts finds its volumes mounted.
        await self.volumes.adopt()
        await self.runner.adopt()
        await self._sweep_network()
        self.parts.start("logs", self.logs.run)
        self.parts.start("stream", self.stream.run)

    async def _sweep_network(self) -> None:
        """Tear down the attachments of instances gone while no agent ran; only when every
        driver can say what it has (one that cannot might still run some of them)."""
        if self.network is None or len(self.healthy) != len(self.config.runtimes):
            return
        existing: set[str] = set(self.instances)
        for driver in self.healthy.values():
            existing.update(t.instance for t in await driver.list())
        await self.network.sweep(existing)

    def _driver_options(self, name: str) -> dict[str, Any]:
        options = dict(self.config.driver_options.get(name, {}))
        if name == "process":
            c = self.config
            options.setdefault("user", c.workload_user)
            options.setdefault("group", c.workload_group)
            options.setdefault("allow_root", c.allow_root_workloads)
            options.setdefault("cgroup_parent", c.cgroup_parent or f"orka/{self.name}")
            options.setdefault("host_ports", self.host_ports)
            options.setdefault("host_ip", c.host_ip)
        if self.network is not None and takes(name, "network"):
            options.setdefault("network", self.network)
        return options

    async def run(self) -> None:
        await self.start()
        await self._stopping.wait()
        await self._shutdown()
        if self._failed is not None:
            raise self._failed

    def _fail(self, failure: PartFailed) -> None:
        """A part failed: stop the agent (its instances too, as on SIGINT); run() raises."""
        if self._failed is None:
            self._failed = failure
        self.request_stop(leave=False)

    def request_stop(self, leave: bool) -> None:
        """Signal handlers call this: leave (SIGTERM) or plain stop (SIGINT)."""
        self._leaving = self._leaving or leave
        self._stopping.set()

    async def stop(self, leave: bool = False) -> None:
        self.request_stop(leave)
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        # Stopping ends some parts' tasks before parts.stop() (the state file's writer is
        # flushed): no failures.
        self.parts.stopping()
        try:
            if self._leaving:
                await self._leave()
            # Whatever is still here (no leave, or leave timed out) is stopped and forgotten.
            await self.runner.stop_all("agent stopped")
        finally:
            # The stream and the drivers go away even when a step above failed.
            await self.parts.stop()
            for d in self.drivers.values():
                with contextlib.suppress(Exception):
                    await d.close()
            if self.network is not None:
                with contextlib.suppress(Exception):
                    await self.network.close()
            self.host_ports.close()
            log.info("agent stopped", node=self.name)

    async def _leave(self) -> None:
        """Announce the leave and wait until no instance holds resources here, but only while
        waiting can help: the scheduler reachable (a lost stream: nobody to place
        replacements) and some other node ready to take them (the scheduler's LeaveReply)."""
        if not self.connected.is_set():
            if self.runner.holding:
                log.info(
                    "leaving without waiting", why="scheduler unreachable", count=self._still_here()
                )
            return
        # Sent even with nothing here: the scheduler then records the node as LEFT, not LOST.
        self.stream.leave()
        if not self.runner.holding:
            return
        log.info("leaving: instances to be replaced elsewhere", count=self._still_here())
        deadline = time.monotonic() + self.config.leave_timeout
        while self.runner.holding:
            why = self._no_wait_reason()
            if why:
                log.info("leaving without waiting", why=why, count=self._still_here())
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "leave timeout expired; stopping what is still here",
                    timeout=self.config.leave_timeout,
                    count=self._still_here(),
                )
                return
            await asyncio.sleep(0.1)

    def _no_wait_reason(self) -> str:
        """Why waiting for replacements cannot help any more ("" while it can)."""
        if not self.connected.is_set():
            return "scheduler stream lost"
        if self._leave_reply is not None and not self._leave_reply.wait:
            return self._leave_reply.reason or "the scheduler says nothing can take over"
        return ""

    def _still_here(self) -> int:
        return sum(1 for i in self.instances.values() if i.holds_resources)

    # ---- what the parts share ----

    def _allocated_now(self) -> Resources:
        """What a heartbeat reports as allocated: expired reservations dropped first."""
        self.admission.expire()
        return self.admission.allocated()

    async def _usage(self) -> Resources:
        return await self.runner.usage()

    def _on_message(self, msg: apb.SchedulerMessage) -> None:
        """Route one message from the scheduler to the part it is for."""
        kind = msg.WhichOneof("body")
        if kind == "batch":
            for inner in msg.batch.messages:
                if inner.WhichOneof("body") != "batch":  # never nested; ignore if it were
                    self._on_message(inner)
        elif kind == "offer":
            self.admission.on_offer(msg.offer)
        elif kind == "start":
            self.runner.on_start(msg.start)
        elif kind == "stop":
            self.runner.on_stop(msg.stop)
        elif kind == "leave_reply":
            self._leave_reply = msg.leave_reply
        elif kind == "session_open":
            self.sessions.on_open(msg.session_open)
        elif kind == "session_input":
            self.sessions.on_input(msg.session_input)
        elif kind == "provision_volume":
            self.volumes.on_provision(msg.provision_volume)
        elif kind == "delete_volume":
            self.volumes.on_delete(msg.delete_volume)
        elif kind == "pace":
            self.stream.repace(msg.pace)
        elif kind == "release":
            self.admission.release(msg.release.instance)
            self.stream.ack(msg.release.command_id, convert.ok_status())
