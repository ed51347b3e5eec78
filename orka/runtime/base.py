"""The runtime shim: one interface the agent drives, with one driver per runtime.

Like Kubernetes' CRI, the agent never knows how a task runs; it only starts, watches, stops
and forgets instances through `Driver`. Drivers own their on-node state so that a restarted
agent can re-adopt what still runs (`Driver.list`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from orka.errors import Conflict, Invalid, RuntimeFailure
from orka.models import PortBinding, PortSpec, WorkloadKind, WorkloadSpec
from orka.runtime.execs import ExecHandle, ExecOptions
from orka.runtime.volumes import MountedVolume

# Instance names become directory names, so anything that could escape the data dir is refused.
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def check_instance(instance: str) -> str:
    if not _INSTANCE_RE.match(instance):
        raise Invalid(f"instance name {instance!r} is not a valid runtime task name")
    return instance


class RunSpec(BaseModel):
    """What to run: one instance of a workload."""

    model_config = ConfigDict(frozen=True)

    instance: str
    workload: str
    spec: WorkloadSpec
    # The volumes provisioned for it on this node, in the order the spec gives them (spec
    # volumes, then its template's): drivers mount them (see orka.runtime.volumes).
    volumes: tuple[MountedVolume, ...] = ()


class TaskState(StrEnum):
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    UNKNOWN = "UNKNOWN"


class TaskInfo(BaseModel):
    instance: str
    workload: str
    driver: str
    state: TaskState
    # None when the driver cannot know (e.g. a re-adopted task killed without a record).
    exit_code: int | None = None
    pid: int | None = None
    started_at: float
    finished_at: float | None = None
    message: str = ""
    # Why it ended when the driver knows more than the exit code (e.g. "OOMKilled").
    reason: str = ""
    # Where it can be reached: its IP in the node's instance network ("" for the host network)
    # and the ports it got, with the host port actually bound.
    address: str = ""
    ports: list[PortBinding] = Field(default_factory=list)


class Attachment(BaseModel):
    """What the node's instance network gave one instance; kept on disk so that a restarted
    agent re-adopts it unchanged."""

    model_config = ConfigDict(frozen=True)

    instance: str
    # The instance's IP on the node's bridge, its prefix length and the bridge's own address.
    address: str
    prefix_len: int
    gateway: str
    bridge: str
    ports: list[PortBinding] = Field(default_factory=list)
    # The network namespace a container joins (a path); "" for a VM, whose TAP joins `bridge`.
    netns: str = ""


class InstanceNetwork(Protocol):
    """The node's instance network as the drivers use it (orka/runtime/network.py: CNI).

    Every method is idempotent and safe for instances attached by an earlier agent process.
    """

    async def attach_netns(self, instance: str, ports: list[PortSpec]) -> Attachment:
        """A fresh network namespace on the bridge with an address and the host ports mapped."""
        ...

    async def attach_vm(self, instance: str, ports: list[PortSpec]) -> Attachment:
        """An address for a VM and its host ports forwarded; the VM's own NIC joins `bridge`."""
        ...

    async def detach(self, instance: str) -> None:
        """Give back the address and host ports, remove the namespace and the forwarding rules."""
        ...

    def attachment(self, instance: str) -> Attachment | None:
        """What `instance` holds now (also one attached by an earlier agent), or None."""
        ...

    def unavailable(self) -> str | None:
        """Why this host cannot attach instances (not root, plugins missing...), or None."""
        ...


def network_refusal(network: InstanceNetwork | None, what: str = "ports") -> str | None:
    """Why `what` (an instance's ports, its own network) cannot be had on this node: no
    instance network configured, or one this host cannot run (not root, plugins missing);
    None when it can. Drivers refuse such a spec at admission and at start."""
    if network is None:
        return f"{what}: needs the node's instance network, and this node has none"
    problem = network.unavailable()
    return f"{what}: needs the node's instance network: {problem}" if problem else None


def usable_network(
    network: InstanceNetwork | None, spec: WorkloadSpec, driver: str
) -> tuple[InstanceNetwork | None, str]:
    """The network to attach an instance of `spec` to, or (None, why it cannot be had: "" when
    none is configured). A spec with ports cannot start without one: RuntimeFailure."""
    refused = network_refusal(network)
    if refused is None and network is not None:
        return network, ""
    if spec.ports:
        raise RuntimeFailure(f"{driver}: {refused}")
    return None, (refused or "") if network is not None else ""


class DriverHealth(BaseModel):
    healthy: bool
    message: str = ""
    kinds: list[WorkloadKind] = Field(default_factory=list)


class Usage(BaseModel):
    cpu_millis: int = 0
    memory_bytes: int = 0


@dataclass(eq=False, kw_only=True)
class TrackedTask:
    """What every driver keeps of a task it runs: enough to answer `TaskInfo`.

    Drivers subclass it with their own handles (a pid file, a snapshotter, a domain).
    """

    driver: ClassVar[str] = ""

    instance: str
    workload: str
    started_at: float
    pid: int | None = None
    exit_code: int | None = None
    finished_at: float | None = None
    message: str = ""
    reason: str = ""
    address: str = ""
    ports: list[PortBinding] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task[None] | None = None

    def info(self) -> TaskInfo:
        return TaskInfo(
            instance=self.instance,
            workload=self.workload,
            driver=self.driver,
            state=TaskState.EXITED if self.done.is_set() else TaskState.RUNNING,
            exit_code=self.exit_code,
            pid=self.pid,
            started_at=self.started_at,
            finished_at=self.finished_at,
            message=self.message,
            reason=self.reason,
            address=self.address,
            ports=self.ports,
        )


# The start of a health check command's output kept for its message.
MAX_CHECK_OUTPUT = 4096


class Driver(ABC):
    """A runtime driver. Every method is safe to call for tasks started by an earlier process."""

    # None: the agent bounds the task's log files (copytruncate into `<file>.1`, see
    # orka/runtime/logs.py). A suffix: their writer rotates them itself, renaming the full file
    # to `<file><suffix>` (libvirt's virtlogd: `.0`), and the agent leaves them alone.
    log_backup: ClassVar[str | None] = None
    # Whether its instances have log files at `log_paths` for the agent to bound and index
    # (the fake driver's write none: its agent skips them, a thousand simulated agents in one
    # benchmark process would otherwise stat files that never exist).
    keeps_logs: ClassVar[bool] = True
    name: ClassVar[str]

    @abstractmethod
    async def health(self) -> DriverHealth:
        """Whether the driver can start tasks now, and which workload kinds it serves."""

    def admit(self, spec: WorkloadSpec) -> str | None:
        """Why this node cannot run `spec` (e.g. a user it may not switch to), or None."""
        return None

    @abstractmethod
    async def start(self, run: RunSpec) -> TaskInfo:
        """Start the task; raises `RuntimeFailure` with a message a user can act on."""

    @abstractmethod
    async def wait(self, instance: str) -> TaskInfo:
        """Return once the task has exited (state EXITED)."""

    @abstractmethod
    async def stop(self, instance: str, grace: float) -> TaskInfo:
        """SIGTERM, then SIGKILL after `grace` seconds; idempotent; returns the exited info."""

    @abstractmethod
    async def remove(self, instance: str, keep_network: bool = False) -> None:
        """Stop the task if needed and forget it with its runtime files; idempotent.

        `keep_network`: the instance is about to start again on this node (its restart
        policy), so its address and host ports stay its own for that start."""

    @abstractmethod
    async def list(self) -> list[TaskInfo]:
        """Every task this driver knows on this node, including ones a previous agent started."""

    @abstractmethod
    async def usage(self, instance: str) -> Usage:
        """Current resource usage of the task (zero once it exited)."""

    @abstractmethod
    def log_paths(self, instance: str) -> tuple[Path, Path]:
        """Paths of the task's stdout and stderr logs."""

    @abstractmethod
    async def close(self) -> None:
        """Stop watching tasks; tasks keep running so a restarted agent can re-adopt them."""

    async def exec(self, instance: str, spec: WorkloadSpec, options: ExecOptions) -> ExecHandle:
        """Run a command inside the running instance (`orka exec`, orka/runtime/execs.py)."""
        raise Conflict(f"{self.name}: exec is not supported for this kind of instance")

    async def console(self, instance: str) -> ExecHandle:
        """Attach to the instance's serial console (VMs: orka/runtime/libvirt_console.py)."""
        raise Conflict(f"{self.name}: only VMs have a console; use exec")

    async def check_exec(
        self, instance: str, spec: WorkloadSpec, command: list[str]
    ) -> tuple[int, str]:
        """Run a health check's command inside the running task (non-interactive): its exit
        code and the start of its output (MAX_CHECK_OUTPUT bytes). The caller bounds the time
        and cancels; cancelled, the command is killed. This one goes through the driver's
        `exec` (containerd's); a driver without one refuses (the spec refuses such checks)."""
        try:
            handle = await self.exec(instance, spec, ExecOptions(command=command))
        except Conflict as err:
            raise RuntimeFailure(err.message) from None
        try:
            await handle.close_stdin()
            output = b""
            while (item := await handle.read()) is not None:
                # Past the bound the rest is read and dropped: a chatty check never blocks.
                output += item[1][: MAX_CHECK_OUTPUT - len(output)]
            return await handle.wait(), output.decode(errors="replace")
        except BaseException:
            await handle.kill()
            raise
        finally:
            await handle.close()


TaskT = TypeVar("TaskT", bound=TrackedTask)


class TrackingDriver(Driver, Generic[TaskT]):
    """The `wait`/`stop`/`remove` every driver that keeps a `TrackedTask` per instance shares.

    Subclasses set `_locks` (start, stop and remove of one instance must not interleave) and
    supply how to find a task, how to end a running one and how to forget one.
    """

    _locks: defaultdict[str, asyncio.Lock]

    @abstractmethod
    async def _lookup(self, instance: str) -> TaskT | None:
        """The task, re-adopted from the driver's own state if needed; None when unknown."""

    @abstractmethod
    async def _require(self, instance: str) -> TaskT:
        """`_lookup`, raising NotFound when unknown."""

    @abstractmethod
    async def _stop_running(self, task: TaskT, grace: float) -> None:
        """End a running task (under its lock), typically through `terminate`."""

    @abstractmethod
    async def _discard(self, instance: str, task: TaskT | None, keep_network: bool) -> None:
        """Forget the (exited or unknown) instance and its runtime files (under its lock), and
        give back its address and host ports unless `keep_network`."""

    async def wait(self, instance: str) -> TaskInfo:
        task = await self._require(instance)
        await task.done.wait()
        return task.info()

    async def stop(self, instance: str, grace: float) -> TaskInfo:
        task = await self._require(instance)
        async with self._locks[instance]:
            if not task.done.is_set():
                await self._stop_running(task, grace)
            return task.info()

    async def remove(self, instance: str, keep_network: bool = False) -> None:
        """Kill at once if still running: a graceful stop is the caller's `stop()` beforehand."""
        check_instance(instance)
        task = await self._lookup(instance)
        if task is not None and not task.done.is_set():
            await self.stop(instance, grace=0.0)
        async with self._locks[instance]:
            await self._discard(instance, task, keep_network)
        self._locks.pop(instance, None)


async def cancel_watchers(tasks: Iterable[TrackedTask]) -> None:
    """Cancel the tasks' watchers and wait for them to end (the tasks themselves keep running)."""
    watchers = [t.watcher for t in tasks if t.watcher is not None]
    for watcher in watchers:
        watcher.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)


def exit_message(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code > 128:
        return f"terminated by signal {code - 128}"
    return f"exited with code {code}"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write then rename, so a crash never leaves a half-written record behind (blocking)."""
    tmp = path.with_suffix(".tmp")
    # 0600: records may name what a task runs; only the agent reads them.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        f.write(json.dumps(data))
    os.replace(tmp, path)


async def terminate(
    exited: Callable[[], Awaitable[object]],
    polite: Callable[[], Awaitable[None]],
    forceful: Callable[[], Awaitable[None]],
    grace: float,
    force_timeout: float,
    what: str,
) -> bool:
    """The stop every driver shares: ask politely, wait `grace`, then force and wait again.

    Returns True when forcing was needed; raises RuntimeFailure naming `what` if even that
    did not end it within `force_timeout`.
    """
    await polite()
    try:
        async with asyncio.timeout(max(grace, 0.0)):
            await exited()
        return False
    except TimeoutError:
        pass
    await forceful()
    try:
        async with asyncio.timeout(force_timeout):
            await exited()
    except TimeoutError:
        raise RuntimeFailure(f"{what} is still running after being killed") from None
    return True
