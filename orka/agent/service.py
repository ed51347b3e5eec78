"""The node agent: one stream to the scheduler, admission of offers, supervised instances."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import structlog

from orka.agent.secret_files import SecretFiles
from orka.agent.state import StateFile
from orka.agent.supervisor import Supervised
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.errors import Invalid, OrkaError, from_rpc_error
from orka.memo import ByIdentity
from orka.models import (
    FAKE_DRIVER,
    KIND_DRIVER,
    OCI_ARCHIVE_PREFIX,
    TERMINAL_PHASES,
    Resources,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert
from orka.rpc.client import refused_role, secure_channel
from orka.rpc.frames import drain
from orka.runtime.base import Driver, TaskState
from orka.runtime.identity import DEFAULT_WORKLOAD_USER
from orka.runtime.registry import make_driver
from orka.security.tls import TlsFiles
from orka.validation import RESERVED_LABEL_PREFIX, path_within, quote, reserved_labels

log = structlog.get_logger("orka.agent")

VERSION = "0.1.0"


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

    def __post_init__(self) -> None:
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
        ):
            if value is not None and value <= 0:
                raise Invalid(f"{flag}: must be > 0, got {value}")


def node_files(spec: WorkloadSpec) -> list[tuple[str, str]]:
    """(field, path) of each file on the node that running `spec` opens."""
    files: list[tuple[str, str]] = []
    if spec.kind is WorkloadKind.VM and spec.image:
        files.append(("spec.image", spec.image))
    if spec.kind is WorkloadKind.CONTAINER and spec.image.startswith(OCI_ARCHIVE_PREFIX):
        files.append(("spec.image", spec.image.removeprefix(OCI_ARCHIVE_PREFIX)))
    if spec.kind is WorkloadKind.VM and spec.vm is not None:
        files += [
            (f"spec.vm.{k}", p)
            for k, p in (("kernel", spec.vm.kernel), ("initrd", spec.vm.initrd))
            if p
        ]
    return files


def detect_capacity() -> Resources:
    return Resources(
        cpu_millis=(os.cpu_count() or 1) * 1000, memory_bytes=psutil.virtual_memory().total
    )


# Heartbeats carry every instance's status once in this many beats (changes go as events).
FULL_STATUS_EVERY = 10
# Usage is read from the drivers once in this many intervals.
USAGE_EVERY = 5
# A heartbeat due within this share of an interval leaves early with a frame being sent anyway.
EARLY_BEAT = 0.5


def _status_of(inst: Supervised) -> apb.InstanceStatus:
    """What `convert.report_to_pb(inst.report(), inst.resources)` gives, without the model."""
    msg = apb.InstanceStatus(
        name=inst.name,
        workload=inst.workload,
        phase=convert.phase_to_pb(inst.phase),
        reason=inst.reason,
        message=inst.message,
        restarts=inst.restarts,
        started_at=inst.started_at or 0.0,
        finished_at=inst.finished_at or 0.0,
        generation=inst.generation,
    )
    if inst.exit_code is not None:
        msg.exit_code = inst.exit_code
    res = inst.resources
    msg.resources.cpu_millis = res.cpu_millis
    msg.resources.memory_bytes = res.memory_bytes
    return msg


# A spec's JSON text, made once per spec (specs are frozen) and spliced into every write.
_spec_json: ByIdentity[WorkloadSpec, str] = ByIdentity(
    lambda spec: spec.model_dump_json(), weigh=len, max_weight=32 << 20
)


_TERMINAL_PB = frozenset(convert.phase_to_pb(p) for p in TERMINAL_PHASES)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}Mi"


class Agent:
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
        # instance -> (resources, deadline): accepted offers not yet started.
        self.reservations: dict[str, tuple[Resources, float]] = {}
        self.state_file = StateFile(config.data_dir / "agent-state.json")
        self.secret_files = SecretFiles(config.secret_dirs)
        self.interval = config.heartbeat_interval
        # The heartbeat schedule (event loop time of the next beat), shared with the writer.
        self._next_beat = float("inf")
        self._beat = 0
        self._usage_now = Resources()
        self._outbox: asyncio.Queue[apb.AgentMessage | None] | None = None
        # instance -> its event message still in the outbox, so a newer state replaces it.
        self._unsent_events: dict[str, apb.AgentMessage] = {}
        self._stopping = asyncio.Event()
        self._leaving = False
        self._stopped = False
        self._main: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle ----

    async def start(self) -> None:
        # Traversable only: workloads reach their own work dir (see orka.runtime.process) but
        # can list nothing here, and every file the agent keeps here is 0600.
        self.config.data_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.config.data_dir.chmod(0o711)
        (self.config.data_dir / "runtime").mkdir(mode=0o711, exist_ok=True)
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
        await self._adopt()
        self._main = asyncio.create_task(self._connect_loop(), name="agent-stream")

    def _driver_options(self, name: str) -> dict[str, Any]:
        options = dict(self.config.driver_options.get(name, {}))
        if name == "process":
            c = self.config
            options.setdefault("user", c.workload_user)
            options.setdefault("group", c.workload_group)
            options.setdefault("allow_root", c.allow_root_workloads)
            options.setdefault("cgroup_parent", c.cgroup_parent or f"orka/{self.name}")
        return options

    async def run(self) -> None:
        await self.start()
        await self._stopping.wait()
        await self._shutdown()

    def request_stop(self, leave: bool) -> None:
        """Signal handlers call this: leave (SIGTERM) or plain stop (SIGINT)."""
        self._leaving = self._leaving or leave
        self._stopping.set()

    async def stop(self, leave: bool = False) -> None:
        self.request_stop(leave)
        await self._shutdown()

    async def crash(self) -> None:
        """Tests only: vanish like a SIGKILL, leaving every task running."""
        self._stopped = True
        if self._main is not None:
            self._main.cancel()
        for inst in self.instances.values():
            await inst.close()
        await self.state_file.flush()

    async def _shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._leaving and self.connected.is_set():
                await self._leave()
            # Whatever is still here (no leave, or leave timed out) is stopped and forgotten.
            await asyncio.gather(
                *(
                    i.stop(remove=True, reason="agent stopped")
                    for i in list(self.instances.values())
                ),
                return_exceptions=True,
            )
            self.instances.clear()
            self._save()
            await self.state_file.flush()
        finally:
            # The stream and the drivers go away even when a step above failed.
            if self._main is not None:
                self._main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._main
            for d in self.drivers.values():
                with contextlib.suppress(Exception):
                    await d.close()
            log.info("agent stopped", node=self.name)

    async def _leave(self) -> None:
        log.info("leaving: waiting for instances to be replaced", count=len(self.instances))
        self._send(apb.AgentMessage(leave=apb.Leave(reason="agent shutting down")))
        deadline = time.monotonic() + self.config.leave_timeout
        while time.monotonic() < deadline:
            if not any(i.holds_resources for i in self.instances.values()):
                break
            await asyncio.sleep(0.1)

    # ---- adoption after a restart ----

    async def _adopt(self) -> None:
        # A file read: off the event loop, like the state file's writes.
        state = await asyncio.to_thread(self.state_file.load, self.name)
        tasks = {}
        for driver in self.drivers.values():
            with contextlib.suppress(Exception):
                for info in await driver.list():
                    tasks[info.instance] = (driver, info)
        for rec in state.instances.values():
            driver_name = self._driver_name(rec.spec.kind)
            driver = self.drivers.get(driver_name or "")
            if driver is None:
                continue
            inst = self._new_instance(rec.name, rec.generation, rec.spec, driver)
            inst.restarts = rec.restarts
            found = tasks.pop(rec.name, None)
            if rec.phase.value in ("SUCCEEDED", "FAILED", "STOPPED"):
                inst.phase = rec.phase
                inst.exit_code = rec.exit_code
                inst.reason, inst.message = rec.reason, rec.message
                inst.finished_at = rec.finished_at
                continue
            info = found[1] if found else None
            if info is not None and info.state is TaskState.RUNNING:
                log.info("re-adopted instance", instance=rec.name, pid=info.pid)
            inst.start(adopted=info)
        for driver, info in tasks.values():
            log.info("removing orphan task", instance=info.instance, driver=driver.name)
            with contextlib.suppress(Exception):
                await driver.remove(info.instance)
        self._save()

    def _driver_name(self, kind: WorkloadKind) -> str | None:
        wanted = KIND_DRIVER[kind]
        if wanted in self.healthy:
            return wanted
        if FAKE_DRIVER in self.healthy:
            return FAKE_DRIVER
        return None

    def _new_instance(
        self, name: str, generation: int, spec: WorkloadSpec, driver: Driver
    ) -> Supervised:
        inst = Supervised(name, generation, spec, driver, self._changed, self.secret_files)
        self.instances[name] = inst
        return inst

    def _changed(self, inst: Supervised) -> None:
        self._save()
        if self._outbox is None:
            return  # registering sends every status
        unsent = self._unsent_events.get(inst.name)
        if unsent is not None and unsent.event.phase not in _TERMINAL_PB:
            # Its previous state has not left yet (STARTING, when a driver reports RUNNING
            # at once): send the newest in its place. Terminal states are never replaced, so
            # an exit code or failure reason always reaches the scheduler.
            unsent.event.CopyFrom(_status_of(inst))
            return
        msg = apb.AgentMessage(event=_status_of(inst))
        self._unsent_events[inst.name] = msg
        self._send(msg)

    def _save(self) -> None:
        # Built when the (coalesced) write happens, not once per change.
        self.state_file.save(self._state)

    def _state(self) -> str:
        """The state file's content: AgentState's JSON layout, written here because this runs
        for every write. Only each instance's few status fields are encoded each time; its
        spec, most of the text, is spliced in from `_spec_json`."""
        entries = []
        for inst in self.instances.values():
            status = json.dumps(
                {
                    "name": inst.name,
                    "workload": inst.workload,
                    "generation": inst.generation,
                    "phase": inst.phase.value,
                    "restarts": inst.restarts,
                    "exit_code": inst.exit_code,
                    "started_at": inst.started_at,
                    "finished_at": inst.finished_at,
                    "reason": inst.reason,
                    "message": inst.message,
                },
                separators=(",", ":"),
            )
            entries.append(
                f'{json.dumps(inst.name)}:{status[:-1]},"spec":{_spec_json(inst.spec)}}}'
            )
        return f'{{"node":{json.dumps(self.name)},"instances":{{{",".join(entries)}}}}}'

    # ---- the stream ----

    def _send(self, msg: apb.AgentMessage) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(msg)

    def _register_message(self) -> apb.AgentMessage:
        reg = apb.Register(
            node=apb.NodeInfo(
                capacity=convert.resources_to_pb(self.capacity),
                allocatable=convert.resources_to_pb(self.capacity),
                # orka.io/node is the scheduler's to set, from our certificate.
                labels=self.config.labels,
                drivers=sorted(self.healthy),
                version=VERSION,
            )
        )
        reg.instances.extend(_status_of(inst) for inst in self.instances.values())
        return apb.AgentMessage(register=reg)

    async def _connect_loop(self) -> None:
        attempt = 0
        while not self._stopped:
            target = self.config.schedulers[attempt % len(self.config.schedulers)]
            try:
                await self._session(target)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as err:
                refused = refused_role(err.details() or "", "scheduler")
                if refused is not None:
                    # Registering with such a peer would let it command this node.
                    log.error("refusing the scheduler", target=target, reason=refused)
                else:
                    log.warning(
                        "scheduler stream ended",
                        target=target,
                        code=err.code().name,
                        error_reason=from_rpc_error(err).reason,
                        details=err.details(),
                    )
            except Exception:
                log.exception("scheduler stream failed", target=target)
            self.connected.clear()
            self._outbox = None
            attempt += 1
            delay = min(0.2 * 2 ** min(attempt, 6), self.config.reconnect_max)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def _session(self, target: str) -> None:
        async with secure_channel(target, self.tls, "scheduler") as channel:
            stub = apb_grpc.SchedulerStub(channel)
            call = stub.Connect()
            outbox: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
            self._unsent_events.clear()
            await call.write(self._register_message())
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
                raise Invalid("scheduler did not acknowledge the registration")
            self.interval = first.registered.heartbeat_interval or self.interval
            self._outbox = outbox
            self.connected.set()
            log.info("registered", scheduler=target, node=first.registered.node)
            if self._leaving:
                self._send(apb.AgentMessage(leave=apb.Leave(reason="agent shutting down")))
            writer = asyncio.create_task(self._writer(call, outbox))
            beats = asyncio.create_task(self._heartbeats())
            try:
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        break
                    self._on_message(msg)
            finally:
                writer.cancel()
                beats.cancel()
                self._outbox = None

    async def _writer(
        self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[apb.AgentMessage | None]
    ) -> None:
        unsent = self._unsent_events
        loop = asyncio.get_running_loop()
        while True:
            msg = await outbox.get()
            if msg is None:
                return
            items, _ = drain(msg, outbox)
            has_beat = False
            for item in items:
                body = item.WhichOneof("body")
                if body == "event" and unsent.get(item.event.name) is item:
                    del unsent[item.event.name]  # leaving now: later changes need a new event
                has_beat = has_beat or body == "heartbeat"
            now = loop.time()
            if not has_beat and now >= self._next_beat - self.interval * EARLY_BEAT:
                # The next heartbeat is due soon: it rides in this frame rather than costing
                # a write (and the scheduler a read) of its own a moment later.
                items.append(self._heartbeat_message())
                self._next_beat = now + self.interval
            if len(items) == 1:
                await call.write(msg)
            else:
                await call.write(apb.AgentMessage(batch=apb.AgentBatch(messages=items)))

    async def _heartbeats(self) -> None:
        """One heartbeat per interval, on a fixed schedule.

        Every state change already goes out at once as an event, and registering sends the
        full list, so a heartbeat carries the instance statuses only every
        FULL_STATUS_EVERY beats (a safety net, cheap for the scheduler when nothing changed).
        The schedule does not drift: a beat that was late (a busy loop) does not push the
        next one back by the same amount, which is what would turn a node NOT_READY.
        A beat may also leave early, in a frame the writer is sending anyway (`_writer`);
        the schedule then starts again from that beat.
        """
        loop = asyncio.get_running_loop()
        self._next_beat = loop.time()
        usage_at = -1e9
        while True:
            now = loop.time()
            if now >= self._next_beat:
                if now - usage_at >= USAGE_EVERY * self.interval:
                    usage_at = now
                    self._usage_now = await self._usage()
                self._send(self._heartbeat_message())
                now = loop.time()
                self._next_beat += self.interval
                if self._next_beat < now:
                    self._next_beat = now  # far behind: the next one at once, but no burst
            await asyncio.sleep(max(0.0, self._next_beat - now))

    def _heartbeat_message(self) -> apb.AgentMessage:
        self._expire_reservations()
        hb = apb.Heartbeat(
            usage=convert.resources_to_pb(self._usage_now),
            allocated=convert.resources_to_pb(self._allocated()),
            sent_at=time.time(),
        )
        if self._beat % FULL_STATUS_EVERY == FULL_STATUS_EVERY - 1:
            hb.instances.extend(_status_of(inst) for inst in self.instances.values())
        self._beat += 1
        return apb.AgentMessage(heartbeat=hb)

    async def _usage(self) -> Resources:
        cpu = mem = 0
        for inst in list(self.instances.values()):
            if inst.holds_resources:
                with contextlib.suppress(Exception):
                    u = await inst.driver.usage(inst.name)
                    cpu += u.cpu_millis
                    mem += u.memory_bytes
        return Resources(cpu_millis=cpu, memory_bytes=mem)

    # ---- admission and commands ----

    def _allocated(self) -> Resources:
        cpu = mem = 0
        for inst in self.instances.values():
            if inst.holds_resources:
                cpu += inst.resources.cpu_millis
                mem += inst.resources.memory_bytes
        for res, _ in self.reservations.values():
            cpu += res.cpu_millis
            mem += res.memory_bytes
        return Resources(cpu_millis=cpu, memory_bytes=mem)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for name, (_, deadline) in list(self.reservations.items()):
            if deadline < now:
                del self.reservations[name]

    def _admit(self, name: str, spec: WorkloadSpec) -> str | None:
        """Our own check of an offer; returns why not, or None to accept."""
        if self._leaving or self._stopping.is_set():
            return "node is shutting down"
        driver_name = self._driver_name(spec.kind)
        if driver_name is None:
            return f"no healthy {KIND_DRIVER[spec.kind]} driver"
        refusal = self.healthy[driver_name].admit(spec)
        if refusal is not None:
            return refusal
        used = self._allocated()
        if name in self.reservations:
            used = used - self.reservations[name][0]
        free = self.capacity - used
        outside = self._outside_allowed(spec)
        if outside is not None:
            return outside
        need = spec.resources
        if need.cpu_millis > free.cpu_millis:
            return f"insufficient cpu: {need.cpu_millis}m requested, {free.cpu_millis}m free"
        if need.memory_bytes > free.memory_bytes:
            return (
                f"insufficient memory: {_mib(need.memory_bytes)} requested,"
                f" {_mib(free.memory_bytes)} free"
            )
        return None

    def _outside_allowed(self, spec: WorkloadSpec) -> str | None:
        """Files a driver opens on this node (VM disks, kernels, initrds, OCI archives) must
        be under --allowed-paths, so a workload cannot boot or import whatever the agent can
        read. The path and, through symlinks, the file it names are both checked."""
        roots = [str(p) for p in self.config.allowed_paths or []]
        for field_name, path in node_files(spec):
            real = os.path.realpath(path)
            real_roots = [os.path.realpath(r) for r in roots]
            if not (path_within(path, roots) and path_within(real, real_roots)):
                return (
                    f"{field_name}: {quote(path, 512)} is outside the paths this node allows"
                    f" ({', '.join(roots) or 'none'}; agent flag --allowed-paths)"
                )
        return None

    def _on_message(self, msg: apb.SchedulerMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "batch":
            for inner in msg.batch.messages:
                if inner.WhichOneof("body") != "batch":  # never nested; ignore if it were
                    self._on_message(inner)
        elif kind == "offer":
            self._on_offer(msg.offer)
        elif kind == "start":
            self._on_start(msg.start)
        elif kind == "stop":
            task = asyncio.create_task(self._on_stop(msg.stop))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif kind == "release":
            self.reservations.pop(msg.release.instance, None)
            self._ack(msg.release.command_id, True, "")

    def _ack(self, command_id: str, ok: bool, error: str) -> None:
        self._send(apb.AgentMessage(ack=apb.CommandAck(command_id=command_id, ok=ok, error=error)))

    def _on_offer(self, offer: apb.Offer) -> None:
        name = offer.assignment.instance
        try:
            spec = convert.spec_from_pb(offer.assignment.spec)
            reason = None if name in self.instances else self._admit(name, spec)
        except OrkaError as err:
            spec, reason = None, f"invalid assignment: {err.message}"
        if reason is None and spec is not None and name not in self.instances:
            hold = offer.hold_seconds or 30.0
            self.reservations[name] = (spec.resources, time.monotonic() + hold)
        self._send(
            apb.AgentMessage(
                offer_reply=apb.OfferReply(
                    offer_id=offer.offer_id, accepted=reason is None, reason=reason or ""
                )
            )
        )

    def _on_start(self, start: apb.StartInstance) -> None:
        a = start.assignment
        if a.instance in self.instances:
            self._ack(start.command_id, True, "")
            return
        try:
            spec = convert.spec_from_pb(a.spec)
        except OrkaError as err:
            self._ack(start.command_id, False, f"invalid assignment: {err.message}")
            return
        reason = self._admit(a.instance, spec)
        self.reservations.pop(a.instance, None)
        if reason is not None:
            self._ack(start.command_id, False, reason)
            return
        driver_name = self._driver_name(spec.kind)
        assert driver_name is not None  # _admit checked
        inst = self._new_instance(a.instance, a.generation, spec, self.healthy[driver_name])
        self._save()
        task = asyncio.create_task(self._start_recorded(inst, start.command_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _start_recorded(self, inst: Supervised, command_id: str) -> None:
        """Start only once the state file records the instance (write-ahead): an agent
        killed right after a start must find it on restart, or the task would be an orphan
        removed and started again elsewhere.

        The ack follows the record, so an acknowledged start is one a restarted agent knows
        of; and it leaves in the same frame as the instance's first state (STARTING, or
        RUNNING from a driver that starts at once), which the supervisor sets before the
        writer runs again."""
        try:
            await self.state_file.persist()
        except OSError as err:
            # Unrecorded, it must not run: refused, the controller places it again.
            if self.instances.get(inst.name) is inst:
                del self.instances[inst.name]
                self._save()
            self._ack(command_id, False, f"cannot record the instance in the state file: {err}")
            return
        if not inst.stopping and self.instances.get(inst.name) is inst:
            inst.start()
        self._ack(command_id, True, "")

    async def _on_stop(self, stop: apb.StopInstance) -> None:
        inst = self.instances.get(stop.instance)
        self._ack(stop.command_id, True, "")
        if inst is None:
            return
        await inst.stop(remove=stop.remove, reason=stop.reason)
        if stop.remove and self.instances.get(stop.instance) is inst:
            del self.instances[stop.instance]
            self._save()
