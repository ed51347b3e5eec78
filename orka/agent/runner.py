"""The runner: the instances on this node, their state file, and the start and stop commands."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import structlog
from google.rpc import code_pb2, status_pb2

from orka.agent.admission import Admission, driver_name
from orka.agent.secret_files import SecretFiles
from orka.agent.state import StateEncoder, StateFile
from orka.agent.supervisor import Supervised
from orka.agent.volumes import VolumeManager
from orka.api import agent_pb2 as apb
from orka.errors import OrkaError
from orka.models import Resources, VolumeAttachment, WorkloadSpec
from orka.rpc import convert
from orka.rpc.convert_volumes import attachment_from_pb
from orka.runtime.base import Driver, TaskState

log = structlog.get_logger("orka.agent")

# Answers a command: (command id, its status).
Ack = Callable[[str, status_pb2.Status], None]


class Runner:
    """Owns `instances` (name -> Supervised): re-adopts what still runs after a restart,
    starts an instance only once the state file records it, stops and forgets on command,
    and tells `on_change` of every state change (the stream sends it as an event)."""

    def __init__(
        self,
        node: str,
        drivers: Mapping[str, Driver],
        healthy: Mapping[str, Driver],
        state_file: StateFile,
        secret_files: SecretFiles,
        admission: Admission,
        ack: Ack,
        on_change: Callable[[Supervised], None],
        instances: dict[str, Supervised] | None = None,
        host_ip: str = "",
        volumes: VolumeManager | None = None,
    ) -> None:
        self.node = node
        self.volumes = volumes
        self.host_ip = host_ip
        self.drivers = drivers
        self.healthy = healthy
        self.state_file = state_file
        self._encoder = StateEncoder(node)
        self.secret_files = secret_files
        self.admission = admission
        self.ack = ack
        self.on_change = on_change
        self.instances: dict[str, Supervised] = {} if instances is None else instances
        self._background: set[asyncio.Task[None]] = set()

    # ---- adoption after a restart ----

    async def adopt(self) -> None:
        # A file read: off the event loop, like the state file's writes.
        state = await asyncio.to_thread(self.state_file.load, self.node)
        tasks = {}
        for driver in self.drivers.values():
            with contextlib.suppress(Exception):
                for info in await driver.list():
                    tasks[info.instance] = (driver, info)
        for rec in state.instances.values():
            driver = self.drivers.get(driver_name(self.healthy, rec.spec.kind) or "")
            if driver is None:
                continue
            inst = self.new_instance(rec.name, rec.generation, rec.spec, driver, tuple(rec.volumes))
            inst.restarts = rec.restarts
            found = tasks.pop(rec.name, None)
            if rec.phase.value in ("SUCCEEDED", "FAILED", "STOPPED"):
                inst.phase = rec.phase
                inst.exit_code = rec.exit_code
                inst.reason, inst.message = rec.reason, rec.message
                inst.finished_at = rec.finished_at
                self.admission.track(rec.name, inst)  # ended: it holds nothing
                continue
            info = found[1] if found else None
            if info is not None and info.state is TaskState.RUNNING:
                log.info("re-adopted instance", instance=rec.name, pid=info.pid)
                if self.volumes is not None:
                    self.volumes.hold(rec.name, rec.spec.kind, rec.volumes)
            inst.start(adopted=info)
        for driver, info in tasks.values():
            log.info("removing orphan task", instance=info.instance, driver=driver.name)
            with contextlib.suppress(Exception):
                await driver.remove(info.instance)
        self.save()

    def new_instance(
        self,
        name: str,
        generation: int,
        spec: WorkloadSpec,
        driver: Driver,
        volumes: tuple[VolumeAttachment, ...] = (),
    ) -> Supervised:
        inst = Supervised(
            name,
            generation,
            spec,
            driver,
            self.changed,
            self.secret_files,
            host_ip=self.host_ip,
            volumes=self.volumes,
            attachments=volumes,
        )
        self.instances[name] = inst
        self.admission.track(name, inst)
        return inst

    def _remove(self, inst: Supervised) -> None:
        """Forget `inst` if it is still the one kept under its name."""
        if self.instances.get(inst.name) is inst:
            del self.instances[inst.name]
            self.admission.forget(inst.name)
            self.save()

    def changed(self, inst: Supervised) -> None:
        self.admission.track(inst.name, inst)
        self.save()
        self.on_change(inst)

    # ---- the state file ----

    def save(self) -> None:
        # Built when the (coalesced) write happens, not once per change.
        self.state_file.save(self.state)

    def state(self) -> str:
        """The state file's content (orka.agent.state's one layout)."""
        return self._encoder.encode(self.instances.values())

    # ---- commands ----

    def on_start(self, start: apb.StartInstance) -> None:
        a = start.assignment
        if a.instance in self.instances:
            self.ack(start.command_id, convert.ok_status())
            return
        try:
            spec = convert.spec_from_pb(a.spec)
            volumes = tuple(attachment_from_pb(v) for v in a.volumes)
        except OrkaError as err:
            self.ack(
                start.command_id,
                convert.error_status(
                    code_pb2.INVALID_ARGUMENT, f"invalid assignment: {err.message}"
                ),
            )
            return
        reason = self.admission.admit(a.instance, spec)
        self.admission.release(a.instance)
        if reason is not None:
            self.ack(start.command_id, convert.error_status(code_pb2.FAILED_PRECONDITION, reason))
            return
        name = driver_name(self.healthy, spec.kind)
        assert name is not None  # admit checked
        inst = self.new_instance(a.instance, a.generation, spec, self.healthy[name], volumes)
        self.save()
        self._spawn(self._start_recorded(inst, start.command_id))

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
            self._remove(inst)
            why = f"cannot record the instance in the state file: {err}"
            self.ack(command_id, convert.error_status(code_pb2.UNAVAILABLE, why))
            return
        if not inst.stopping and self.instances.get(inst.name) is inst:
            inst.start()
        self.ack(command_id, convert.ok_status())

    def on_stop(self, stop: apb.StopInstance) -> None:
        self._spawn(self._stop(stop))

    async def _stop(self, stop: apb.StopInstance) -> None:
        inst = self.instances.get(stop.instance)
        self.ack(stop.command_id, convert.ok_status())
        if inst is None:
            return
        await inst.stop(remove=stop.remove, reason=stop.reason)
        if stop.remove:
            self._remove(inst)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- what runs ----

    @property
    def holding(self) -> bool:
        """True while any instance still holds resources here (a leave waits for none)."""
        return any(i.holds_resources for i in self.instances.values())

    async def usage(self) -> Resources:
        cpu = mem = 0
        for inst in list(self.instances.values()):
            if inst.holds_resources:
                with contextlib.suppress(Exception):
                    u = await inst.driver.usage(inst.name)
                    cpu += u.cpu_millis
                    mem += u.memory_bytes
        return Resources(cpu_millis=cpu, memory_bytes=mem)

    async def stop_all(self, reason: str) -> None:
        """Stop and forget every instance, and write that down."""
        await asyncio.gather(
            *(i.stop(remove=True, reason=reason) for i in list(self.instances.values())),
            return_exceptions=True,
        )
        for name in list(self.instances):
            self.admission.forget(name)
        self.instances.clear()
        self.save()
        await self.state_file.flush()
