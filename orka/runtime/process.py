"""The `process` driver: plain child processes, no root needed (the embedded default).

Layout per instance: `<data_dir>/instances/<instance>/` (0700, the agent's only) holds
`task.json` (pid, kernel start time, workload, started_at), `stdout.log`, `stderr.log` (0600),
`exit_code` (written by the wrapper) and `exit.json` (written once the driver saw the exit).
The working directory, unless the spec names one, is `<data_dir>/work/<instance>/` (0700,
owned by the user the instance runs as); `work/` and the directories above it inside the data
dir are traversable only (0711), so a workload reaches its own directory and lists nothing.

Isolation (when the agent is root; see `identity.py`, `cgroups.py` and `launch.py`). Each
instance runs as the spec's `user`/`group`, or the agent's default user (`nobody`), never root
unless the node allows it; in its own cgroup with `memory.max`/`cpu.max` (or v1's equivalents)
from its resources, joined before the command execs; with a private /tmp where the platform
allows a mount namespace. An OOM kill is reported as reason `OOMKilled`, exit code 137. An
unprivileged agent runs workloads as itself, and without limits when no cgroup is writable
(it logs so once).

Surviving the agent. Every task runs in its own session (`start_new_session=True`), like Nomad's
executor, so SIGKILLing the agent leaves tasks running; a new driver on the same data dir finds
them through `task.json` and re-adopts them. The pid is only trusted while `/proc/<pid>/stat`
still shows the start time recorded at launch, which guards against pid reuse.

Exit codes. A re-adopted task is no longer our child, so it cannot be waited for. Rather than
lose its exit code, each command runs under a tiny `/bin/sh` wrapper that waits for it and writes
`$?` to `exit_code`. The wrapper traps SIGTERM/SIGINT with a no-op handler (handlers, unlike
ignored signals, reset to default in the command it runs), so when the process group is signalled
the command dies and the wrapper survives long enough to record the code. SIGKILL still goes to
the whole process group, wrapper included, so nothing survives a stop; a code that was never
recorded because we SIGKILLed the group is reported as 137. Exit codes follow the shell
convention: death by signal N is 128+N. Our own children are still waited for for real; adopted
ones are polled (`poll_interval`, one small /proc read each).

When a task's main command ends, whatever it left running in its process group is killed, as a
container runtime does when a container's init exits.

`usage()` reports what the process tree uses. Linux only (`/proc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil
import structlog

from orka.errors import AlreadyExists, Conflict, NotFound, RuntimeFailure
from orka.models import PortBinding, PortSpec, WorkloadKind, WorkloadSpec
from orka.runtime import launch
from orka.runtime.base import (
    Attachment,
    DriverHealth,
    InstanceNetwork,
    RunSpec,
    TaskInfo,
    TrackedTask,
    TrackingDriver,
    Usage,
    cancel_watchers,
    check_instance,
    exit_message,
    network_refusal,
    terminate,
    write_json,
)
from orka.runtime.cgroups import Cgroups, detect
from orka.runtime.execs import ExecHandle, ExecOptions, SubprocessExec
from orka.runtime.host_ports import HostPorts
from orka.runtime.identity import DEFAULT_WORKLOAD_USER, Identity, IdentityRefused, UserPolicy

log = structlog.get_logger(__name__)

SHELL = "/bin/sh"
# $1 is the exit-code file, the rest is the command. See the module docstring for why it traps.
_WRAPPER = 'f=$1; shift\ntrap : TERM INT\n"$@"\nc=$?\necho "$c" > "$f"\nexit "$c"\n'
_WRAPPER_NAME = "orka-task"
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
_TRAP_WAIT = 2.0
SIGKILL_EXIT_CODE = 128 + signal.SIGKILL
# How long a process group may take to disappear after SIGKILL before we call it stuck.
_KILL_TIMEOUT = 5.0

TASK_FILE = "task.json"
EXIT_FILE = "exit.json"
EXIT_CODE_FILE = "exit_code"
OOM_REASON = "OOMKilled"
# The launcher runs as a script: isolated mode (-I: no PYTHON* variables from the workload's
# env, no user site) and no site module (-S: it needs only the standard library; faster start).
_LAUNCH = [sys.executable, "-I", "-S", launch.__file__]


@dataclass(eq=False, kw_only=True)
class _Task(TrackedTask):
    driver: ClassVar[str] = "process"

    dir: Path
    pid: int
    start_ticks: int | None
    # Only set for children of this process; adopted tasks are polled instead.
    proc: asyncio.subprocess.Process | None = None
    killed: bool = False
    memory_limit: int = 0
    # ORKA_VOLUME_<NAME> of its volumes: its execs and health checks see them too.
    volume_env: dict[str, str] = field(default_factory=dict)
    # Kept between usage() calls because psutil's cpu_percent measures since the last call.
    samples: dict[int, psutil.Process] = field(default_factory=dict)


class ProcessDriver(TrackingDriver[_Task]):
    name: ClassVar[str] = "process"

    def __init__(
        self,
        data_dir: Path,
        poll_interval: float = 0.2,
        *,
        user: str = DEFAULT_WORKLOAD_USER,
        group: str = "",
        allow_root: bool = False,
        cgroup_parent: str = "orka",
        private_tmp: bool = True,
        host_ports: HostPorts | None = None,
        host_ip: str = "",
        network: InstanceNetwork | None = None,
    ) -> None:
        self._data = Path(data_dir)
        # Processes share the host's network: each gets its ports from the node's allocator
        # (shared with the other drivers) in ORKA_PORT_<NAME>, and the node's address.
        self._ports = host_ports if host_ports is not None else HostPorts()
        self._host_ip = host_ip
        # Processes with `network: bridge` get a namespace of their own on it (None: refused).
        self._network = network
        self._root = self._data / "instances"
        self._work = self._data / "work"
        self._policy = UserPolicy(default_user=user, default_group=group, allow_root=allow_root)
        self._cgroup_parent = cgroup_parent
        self._cgroups: Cgroups | None = None
        self._cgroups_checked = False
        # None until probed: whether this platform lets us give an instance its own /tmp.
        self._private_tmp: bool | None = None if private_tmp else False
        self._poll = poll_interval
        self._tasks: dict[str, _Task] = {}
        # Start, stop and remove of one instance must not interleave.
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False

    # -- interface ---------------------------------------------------------------------------

    async def health(self) -> DriverHealth:
        kinds = [WorkloadKind.PROCESS]
        if not os.access(SHELL, os.X_OK):
            return DriverHealth(healthy=False, message=f"{SHELL} is missing", kinds=kinds)
        try:
            await asyncio.to_thread(self._probe_isolation)
        except OSError as exc:
            return DriverHealth(healthy=False, message=f"data dir: {exc}", kinds=kinds)
        if not os.access(self._root, os.W_OK):
            return DriverHealth(healthy=False, message=f"{self._root} is not writable", kinds=kinds)
        if self._cgroups is None:
            return DriverHealth(
                healthy=True, message="resource limits are not enforced", kinds=kinds
            )
        return DriverHealth(healthy=True, kinds=kinds)

    def admit(self, spec: WorkloadSpec) -> str | None:
        try:
            self._policy.resolve(spec)
        except IdentityRefused as exc:
            return str(exc)
        return network_refusal(self._network, "network: bridge") if spec.own_network else None

    @property
    def cgroups(self) -> Cgroups | None:
        return self._cgroups

    def _make_dirs(self) -> None:
        """Records and logs private to the agent; the way to work dirs traversable only."""
        self._root.mkdir(parents=True, exist_ok=True)
        self._root.chmod(0o700)
        self._work.mkdir(exist_ok=True)
        self._work.chmod(0o711)
        self._data.chmod(0o711)

    def _probe_isolation(self) -> None:
        """Once: our dirs, which cgroups we can manage, whether a private /tmp works (blocking)."""
        if self._cgroups_checked:
            return
        self._make_dirs()
        self._cgroups_checked = True
        self._cgroups, why = detect(self._cgroup_parent)
        if self._cgroups is None:
            log.warning("process.limits_not_enforced", reason=why)
        else:
            log.info("process.cgroups", version=self._cgroups.version, parent=self._cgroup_parent)
        if self._private_tmp is None:
            if os.geteuid() != 0:
                self._private_tmp = False
            else:
                probe = subprocess.run(
                    [*_LAUNCH, "--probe", "--"], capture_output=True, timeout=10, check=False
                )
                self._private_tmp = probe.returncode == 0
            if not self._private_tmp:
                log.warning("process.no_private_tmp", reason="no mount namespace allowed here")

    async def start(self, run: RunSpec) -> TaskInfo:
        instance = check_instance(run.instance)
        async with self._locks[instance]:
            existing = await self._lookup(instance)
            if existing is not None:
                if not existing.done.is_set():
                    raise AlreadyExists(f"process: instance {instance!r} is already running")
                # A restart of an exited instance reuses its directory and appends to its logs.
                self._tasks.pop(instance, None)
            try:
                identity = self._policy.resolve(run.spec)
            except IdentityRefused as exc:
                raise RuntimeFailure(f"process: {exc}") from None
            try:
                await asyncio.to_thread(self._probe_isolation)
            except OSError as exc:
                raise RuntimeFailure(f"process: data dir: {exc}") from None
            task_dir = self._root / instance
            attachment = await self._connect(run)
            ports = attachment.ports if attachment else self._ports.bindings(instance)
            try:
                argv, cwd, env = await asyncio.to_thread(
                    _prepare, run, task_dir, self._work / instance, identity
                )
                env.update(self._network_env(run.spec.ports, ports))
                volume_env = await asyncio.to_thread(self._volume_env, run, identity)
                env.update(volume_env)
                argv = await asyncio.to_thread(
                    self._isolate, run, identity, argv, attachment.netns if attachment else ""
                )
            except BaseException:
                await self._disconnect(instance)
                raise
            out, err = _open_logs(task_dir)
            try:
                proc = await asyncio.create_subprocess_exec(
                    SHELL,
                    "-c",
                    _WRAPPER,
                    _WRAPPER_NAME,
                    str(task_dir / EXIT_CODE_FILE),
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                await self._disconnect(instance)
                if self._cgroups is not None:
                    await asyncio.to_thread(self._cgroups.remove, instance)
                raise RuntimeFailure(f"process: cannot start {argv[0]!r}: {exc}") from exc
            finally:
                # The child holds its own copies of the descriptors.
                os.close(out)
                os.close(err)
            # Until the wrapper has installed its trap, a SIGTERM would kill the wrapper instead
            # of the command and lose the exit code; a stop right after start must not race it.
            await _await_trap(proc)
            task = _Task(
                instance=instance,
                workload=run.workload,
                dir=task_dir,
                pid=proc.pid,
                start_ticks=_start_ticks(proc.pid),
                started_at=time.time(),
                proc=proc,
                memory_limit=run.spec.resources.memory_bytes,
                volume_env=volume_env,
                ports=ports,
                address=attachment.address if attachment else "",
            )
            record = {
                "instance": instance,
                "workload": run.workload,
                "pid": task.pid,
                "start_ticks": task.start_ticks,
                "started_at": task.started_at,
                "memory_limit": task.memory_limit,
                "user": identity.user,
                "uid": identity.uid,
                "command": argv,
                "ports": [b.model_dump(mode="json") for b in ports],
                "address": task.address,
                "volume_env": volume_env,
            }
            await asyncio.to_thread(write_json, task_dir / TASK_FILE, record)
            self._tasks[instance] = task
            task.watcher = asyncio.create_task(self._watch_child(task), name=f"watch-{instance}")
            log.info(
                "process.started", instance=instance, pid=task.pid, uid=identity.uid, command=argv
            )
            return task.info()

    async def _connect(self, run: RunSpec) -> Attachment | None:
        """The instance's network: its own namespace on the bridge (network: bridge), or the
        host's, with its host ports checked free and kept from other instances."""
        if not run.spec.own_network:
            await asyncio.to_thread(self._ports.reserve, run.instance, run.spec.ports, False)
            return None
        network = self._network
        refused = network_refusal(network, "network: bridge")
        if refused or network is None:
            raise RuntimeFailure(f"process: {refused}")
        return await network.attach_netns(run.instance, run.spec.ports)

    async def _disconnect(self, instance: str) -> None:
        self._ports.release(instance)
        if self._network is not None and self._network.attachment(instance) is not None:
            await self._network.detach(instance)

    def _network_env(self, specs: list[PortSpec], ports: list[PortBinding]) -> dict[str, str]:
        """After the spec's own env: the node decides these, a workload cannot override them.

        ORKA_PORT_<NAME> is where the instance listens (in its own network, or the host port
        on the host's), ORKA_HOST_PORT_<NAME> where it is reached on its node."""
        env = {}
        for spec, b in zip(specs, ports, strict=True):
            env[spec.env_name] = str(b.port or b.host_port)
            env[spec.host_env_name] = str(b.host_port)
        if self._host_ip:
            env["ORKA_HOST_IP"] = self._host_ip
        return env

    def _volume_env(self, run: RunSpec, identity: Identity) -> dict[str, str]:
        """ORKA_VOLUME_<NAME>: each volume's host path (blocking). A volume it may write is
        made its user's, so the instance can write there whoever it runs as."""
        env = {}
        for v in run.volumes:
            path = Path(v.host_path)
            if identity.switch and not v.read_only and path.is_dir():
                try:
                    os.chown(path, identity.uid, identity.gid)
                except OSError as exc:
                    raise RuntimeFailure(
                        f"process: volume {v.name}: cannot give it to the instance's user: {exc}"
                    ) from None
            env[v.env_key] = str(path)
        return env

    def _isolate(
        self, run: RunSpec, identity: Identity, argv: list[str], netns: str = ""
    ) -> list[str]:
        """The command behind the launcher that sets up its cgroup, /tmp and user (blocking).

        Without anything to set up (an unprivileged agent, no cgroups), the command as is.
        """
        prefix: list[str] = ["--netns", netns] if netns else []
        cg = self._cgroups
        if cg is not None:
            try:
                cg.create(run.instance, run.spec.resources)
            except OSError as exc:
                cg.remove(run.instance)
                raise RuntimeFailure(
                    f"process: cannot set up the cgroup of {run.instance!r}: {exc}"
                ) from None
            for path in cg.procs_files(run.instance):
                prefix += ["--cgroup-procs", str(path)]
        if self._private_tmp:
            prefix += ["--private-tmp", "--tmp-size", str(run.spec.resources.memory_bytes)]
            # The instance's own /tmp would hide a volume under the host's (an agent whose
            # data dir is there): the launcher binds each one back in at its path.
            for v in run.volumes:
                if Path(v.host_path).is_relative_to("/tmp"):
                    prefix += ["--keep", str(v.host_path)]
        for v in run.volumes:
            if v.read_only:
                prefix += ["--read-only", str(v.host_path)]
        if identity.switch:
            prefix += ["--uid", str(identity.uid), "--gid", str(identity.gid)]
        if not prefix:
            return argv
        return [*_LAUNCH, *prefix, "--", *argv]

    async def _in_context(
        self, instance: str, spec: WorkloadSpec, command: list[str]
    ) -> tuple[list[str], str, dict[str, str]]:
        """`command` as the instance runs (health checks, `orka exec`): its user and group,
        working dir, environment (ports included), cgroup, and network namespace when it has
        its own, through the launcher. Not its private /tmp (a mount namespace of its own)."""
        task = await self._require(instance)
        try:
            identity = self._policy.resolve(spec)
        except IdentityRefused as exc:
            raise RuntimeFailure(f"process: {exc}") from None
        run = RunSpec(instance=instance, workload=task.workload, spec=spec)
        cwd, env = await asyncio.to_thread(_context, run, self._work / instance, identity)
        env.update(self._network_env(spec.ports, task.ports))
        env.update(task.volume_env)
        argv = [await asyncio.to_thread(_resolve, command[0], env["PATH"], cwd), *command[1:]]
        attachment = self._network.attachment(instance) if self._network is not None else None
        prefix = ["--netns", attachment.netns] if attachment and attachment.netns else []
        if self._cgroups is not None:
            for path in self._cgroups.procs_files(instance):
                prefix += ["--cgroup-procs", str(path)]
        if identity.switch:
            prefix += ["--uid", str(identity.uid), "--gid", str(identity.gid)]
        if prefix:
            argv = [*_LAUNCH, *prefix, "--", *argv]
        return argv, cwd, env

    async def list(self) -> list[TaskInfo]:
        unknown = await asyncio.to_thread(self._scan, set(self._tasks))
        for instance, record in unknown.items():
            await self._adopt(instance, record)
        return [task.info() for task in self._tasks.values()]

    async def usage(self, instance: str) -> Usage:
        task = await self._require(instance)
        if task.done.is_set():
            return Usage()
        return await asyncio.to_thread(_measure, task)

    async def exec(self, instance: str, spec: WorkloadSpec, options: ExecOptions) -> ExecHandle:
        """`orka exec`: the command in the instance's context (`_in_context`), interactive."""
        task = await self._require(instance)
        if task.done.is_set():
            raise Conflict(f"process: instance {instance!r} is not running")
        argv, cwd, env = await self._in_context(instance, spec, list(options.command))
        try:
            return await SubprocessExec.start(argv, env, cwd, options)
        except OSError as exc:
            raise RuntimeFailure(f"process: cannot run {options.command[0]!r}: {exc}") from None

    def log_paths(self, instance: str) -> tuple[Path, Path]:
        task_dir = self._root / check_instance(instance)
        return task_dir / "stdout.log", task_dir / "stderr.log"

    async def close(self) -> None:
        """Stop watching; tasks keep running so that the next agent re-adopts them."""
        if self._closed:
            return
        self._closed = True
        await cancel_watchers(self._tasks.values())
        if self._cgroups is not None:
            await asyncio.to_thread(self._cgroups.remove_parent)

    # -- tracking (the `TrackingDriver` hooks first) -------------------------------------------

    async def _stop_running(self, task: _Task, grace: float) -> None:
        async def term() -> None:
            self._signal(task, signal.SIGTERM)

        async def kill() -> None:
            task.killed = True
            self._signal(task, signal.SIGKILL)

        await terminate(
            task.done.wait,
            term,
            kill,
            grace,
            _KILL_TIMEOUT,
            f"process: instance {task.instance!r} (pid {task.pid})",
        )
        log.info("process.stopped", instance=task.instance, exit_code=task.exit_code)

    async def _discard(self, instance: str, task: _Task | None, keep_network: bool) -> None:
        # What is tracked now, not what the caller looked up before taking the lock.
        tracked = self._tasks.pop(instance, None)
        if tracked is not None and tracked.watcher is not None:
            tracked.watcher.cancel()
        if not keep_network:
            await self._disconnect(instance)
        if self._cgroups is not None:
            await asyncio.to_thread(self._cgroups.remove, instance)
        await asyncio.to_thread(shutil.rmtree, self._root / instance, True)
        await asyncio.to_thread(shutil.rmtree, self._work / instance, True)

    async def _require(self, instance: str) -> _Task:
        task = await self._lookup(check_instance(instance))
        if task is None:
            raise NotFound(f"process: no task {instance!r}")
        return task

    async def _lookup(self, instance: str) -> _Task | None:
        task = self._tasks.get(instance)
        if task is not None:
            return task
        record = await asyncio.to_thread(_read_record, self._root / instance)
        if record is None:
            return None
        return await self._adopt(instance, record)

    def _scan(self, known: set[str]) -> dict[str, dict[str, Any]]:
        """Read the records of every instance dir this driver does not track yet (in a thread)."""
        found: dict[str, dict[str, Any]] = {}
        try:
            entries = list(os.scandir(self._root))
        except FileNotFoundError:
            return found
        for entry in entries:
            if entry.name in known or not entry.is_dir():
                continue
            record = _read_record(Path(entry.path))
            if record is not None:
                found[entry.name] = record
        return found

    async def _adopt(self, instance: str, record: dict[str, Any]) -> _Task:
        # Another caller may have adopted it while we were reading the files.
        if instance in self._tasks:
            return self._tasks[instance]
        if not self._cgroups_checked:
            # A restarted agent adopts before it starts anything: its instances' cgroups are
            # found by name, for their OOM kills and their removal.
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._probe_isolation)
            if instance in self._tasks:
                return self._tasks[instance]
        task = _Task(
            instance=instance,
            workload=str(record.get("workload", "")),
            dir=self._root / instance,
            pid=int(record["pid"]),
            start_ticks=record.get("start_ticks"),
            started_at=float(record.get("started_at", 0.0)),
            memory_limit=int(record.get("memory_limit") or 0),
            volume_env={str(k): str(v) for k, v in (record.get("volume_env") or {}).items()},
            ports=_record_ports(record),
            address=str(record.get("address") or ""),
        )
        self._tasks[instance] = task
        # Its ports stay its own until it is removed, even once it exited (it may restart);
        # those of one with a namespace of its own are the network's (kept on its records).
        if not task.address:
            self._ports.adopt(instance, task.ports, hold=False)
        exit_record = record.get("exit")
        if exit_record is not None:
            task.exit_code = exit_record.get("exit_code")
            task.finished_at = exit_record.get("finished_at")
            task.message = str(exit_record.get("message", ""))
            task.reason = str(exit_record.get("reason", ""))
            task.done.set()
        elif _alive(task.pid, task.start_ticks):
            log.info("process.adopted", instance=instance, pid=task.pid)
            task.watcher = asyncio.create_task(self._watch_adopted(task), name=f"watch-{instance}")
        else:
            await self._finish(task, None)
        return task

    async def _watch_child(self, task: _Task) -> None:
        assert task.proc is not None
        returncode = await task.proc.wait()
        # A negative code means the wrapper itself died of a signal (our SIGKILL of the group).
        code = 128 - returncode if returncode < 0 else returncode
        await self._finish(task, code)

    async def _watch_adopted(self, task: _Task) -> None:
        # Not our child: no wait() and no pidfd event to await, so polling /proc is the way.
        while _alive(task.pid, task.start_ticks):  # noqa: ASYNC110
            await asyncio.sleep(self._poll)
        await self._finish(task, None)

    async def _finish(self, task: _Task, code: int | None) -> None:
        """Record the exit once: exit.json first, so a waiter can rely on it being on disk."""
        if task.done.is_set():
            return
        _sweep_group(task.pid, task.start_ticks)
        if task.killed:
            # A SIGKILLed member can take a moment to die (the launcher may be paging itself
            # in); a stop returns once nothing of the task runs any more.
            await asyncio.to_thread(_await_group_gone, task.pid, _KILL_TIMEOUT)
        oom_kills = 0
        if self._cgroups is not None:
            # Read before the cgroup goes; removing it also kills what escaped the group.
            oom_kills = await asyncio.to_thread(self._cgroups.oom_kills, task.instance)
            await asyncio.to_thread(self._cgroups.remove, task.instance)
        recorded, recorded_at = await asyncio.to_thread(_read_exit_code, task.dir)
        if code is None:
            code = recorded
        if code is None and (task.killed or oom_kills):
            code = SIGKILL_EXIT_CODE
        task.exit_code = code
        task.finished_at = recorded_at if task.proc is None and recorded_at else time.time()
        if oom_kills and code == SIGKILL_EXIT_CODE and not task.killed:
            task.reason = OOM_REASON
            task.message = f"killed by the OOM killer at its memory limit ({task.memory_limit} B)"
        elif task.killed:
            task.message = "killed after the stop grace period"
        elif code is None:
            task.message = "exited while unwatched; exit code unknown"
        else:
            task.message = exit_message(code)
        exit_record = {
            "exit_code": task.exit_code,
            "finished_at": task.finished_at,
            "message": task.message,
            "reason": task.reason,
        }
        try:
            await asyncio.to_thread(write_json, task.dir / EXIT_FILE, exit_record)
        except OSError as exc:
            # Only a restarted agent loses by this; the live state stays right.
            log.warning("process.exit_record_failed", instance=task.instance, error=str(exc))
        task.done.set()
        log.info("process.exited", instance=task.instance, exit_code=code, reason=task.reason)

    def _signal(self, task: _Task, sig: signal.Signals) -> None:
        if task.proc is not None:
            # Our child's pid cannot be reused before we reaped it, and once reaped it is done.
            if task.proc.returncode is not None:
                return
        elif not _alive(task.pid, task.start_ticks):
            return
        # start_new_session made the pid the process group id; signal the whole tree.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(task.pid, sig)


# -- helpers that touch the filesystem (called from threads where they may be slow) ----------


def _prepare(
    run: RunSpec, task_dir: Path, work_dir: Path, identity: Identity
) -> tuple[list[str], str, dict[str, str]]:
    spec = run.spec
    argv = list(spec.command)
    if not argv:
        raise RuntimeFailure("process: the workload has no command to run")
    task_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    work_dir.mkdir(mode=0o700, exist_ok=True)
    if identity.switch:
        os.chown(work_dir, identity.uid, identity.gid)
    cwd, env = _context(run, work_dir, identity)
    argv[0] = _resolve(argv[0], env["PATH"], cwd)
    # Stale records from an earlier run of this instance would be mistaken for this one.
    for name in (TASK_FILE, EXIT_FILE, EXIT_CODE_FILE):
        (task_dir / name).unlink(missing_ok=True)
    return argv, cwd, env


def _context(run: RunSpec, work_dir: Path, identity: Identity) -> tuple[str, dict[str, str]]:
    """An instance's working dir and environment: its command's, and its exec checks'."""
    spec = run.spec
    cwd = spec.working_dir or str(work_dir)
    if not Path(cwd).is_dir():
        raise RuntimeFailure(f"process: working_dir {cwd!r} is not a directory")
    # A minimal environment: the agent's own (secrets, sockets) must not leak into tasks.
    # Another user gets its own dir as HOME, not the agent's.
    home = str(work_dir) if identity.switch else os.environ.get("HOME", str(work_dir))
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": home,
        "ORKA_INSTANCE": run.instance,
        "ORKA_WORKLOAD": run.workload,
    }
    env.update(spec.environment)  # env and secret_env
    return cwd, env


def _record_ports(record: dict[str, Any]) -> list[PortBinding]:
    """The ports a record names; a record from before ports existed (or a damaged entry) has
    none, which only means they are not held against other instances."""
    out = []
    for item in record.get("ports") or []:
        with contextlib.suppress(ValueError, TypeError):
            out.append(PortBinding.model_validate(item))
    return out


def _resolve(command: str, path: str, cwd: str) -> str:
    """Find the executable up front: the wrapper would only report a failure as exit code 127."""
    if "/" in command:
        candidate = Path(cwd, command)
        if not candidate.is_file():
            raise RuntimeFailure(f"command {command!r} not found")
        if not os.access(candidate, os.X_OK):
            raise RuntimeFailure(f"command {command!r} is not executable")
        return str(candidate)
    found = shutil.which(command, path=path)
    if found is None:
        raise RuntimeFailure(f"command {command!r} not found in PATH")
    return found


def _open_logs(task_dir: Path) -> tuple[int, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    # Written by the agent and read by it only: they may hold what the workload printed of
    # its secrets.
    out = os.open(task_dir / "stdout.log", flags, 0o600)
    try:
        err = os.open(task_dir / "stderr.log", flags, 0o600)
    except OSError:
        os.close(out)
        raise
    # Logs kept from an earlier run of the instance (or an older agent) get the same mode.
    os.fchmod(out, 0o600)
    os.fchmod(err, 0o600)
    return out, err


def _read_record(task_dir: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((task_dir / TASK_FILE).read_text())
        if not isinstance(record.get("pid"), int):
            return None
    except (OSError, ValueError):
        return None
    try:
        record["exit"] = json.loads((task_dir / EXIT_FILE).read_text())
    except (OSError, ValueError):
        record["exit"] = None
    return record


def _read_exit_code(task_dir: Path) -> tuple[int | None, float | None]:
    path = task_dir / EXIT_CODE_FILE
    try:
        return int(path.read_text().strip()), path.stat().st_mtime
    except (OSError, ValueError):
        return None, None


# -- /proc -----------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a pid, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    # rest[0] is field 3 (state), so field 22 (starttime) is rest[19].
    return rest[0], int(rest[19])


def _start_ticks(pid: int) -> int | None:
    st = _stat(pid)
    return st[1] if st else None


def _alive(pid: int, start_ticks: int | None) -> bool:
    """Whether the pid is still our live task; without a start time we cannot tell, so no."""
    st = _stat(pid)
    if st is None or start_ticks is None:
        return False
    state, ticks = st
    return ticks == start_ticks and state not in ("Z", "X")


def _sweep_group(pgid: int, start_ticks: int | None) -> None:
    """Kill whatever the task left in its process group once the main command has ended."""
    st = _stat(pgid)
    # A live pid with another start time means the number was reused: not our group.
    if st is not None and st[1] != start_ticks:
        return
    # Otherwise the pid is our (zombie) leader or gone; a pgid is never reused while a member
    # of the group lives, so this reaches only processes the task started.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    """Whether any live (not zombie) process is in process group `pgid` (scans /proc)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        # Fields after the command name: state (3), ppid (4), pgrp (5).
        rest = raw[raw.rfind(")") + 2 :].split()
        if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            return True
    return False


def _await_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.005)


def _measure(task: _Task) -> Usage:
    try:
        root = psutil.Process(task.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return Usage()
    cpu_percent = 0.0
    rss = 0
    seen: dict[int, psutil.Process] = {}
    for proc in procs:
        # Reuse the cached object so cpu_percent measures since the previous sample.
        cached = task.samples.get(proc.pid, proc)
        try:
            cpu_percent += cached.cpu_percent(interval=None)
            rss += cached.memory_info().rss
        except psutil.Error:
            continue
        seen[proc.pid] = cached
    task.samples = seen
    # psutil reports percent of one CPU; 100 % of a CPU is 1000 millicores.
    return Usage(cpu_millis=int(cpu_percent * 10), memory_bytes=rss)


def _catches_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & _SIGTERM_BIT)
    except (OSError, ValueError):
        pass
    return False


def _command_execed(pid: int) -> bool:
    """Whether the wrapper's child has become the command (exec done).

    Between the wrapper's fork and the child's exec, the child still carries the wrapper's
    SIGTERM trap, so a SIGTERM in that window would be swallowed; after exec its argv differs.
    """
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            own = f.read()
    except OSError:
        return True  # no children file (old kernel) or the wrapper is gone: nothing to wait for
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if f.read() != own:
                    return True
        except OSError:
            return True  # the command already ran and exited
    return False


async def _await_trap(proc: asyncio.subprocess.Process) -> None:
    """Wait (a few ms in practice) until SIGTERM would reach the command, not a shell's trap."""
    deadline = time.monotonic() + _TRAP_WAIT
    while proc.returncode is None and time.monotonic() < deadline:
        if _catches_sigterm(proc.pid) and _command_execed(proc.pid):
            return
        await asyncio.sleep(0.002)
