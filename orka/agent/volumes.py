"""The agent's volumes: provisioned on this node's backends before the instances that use
them start, tracked by which instances hold them, and reported to the scheduler at each change.

- `acquire` (the supervisor, before each start): provisions what is not there yet (one
  provisioning per volume, however many instances wait for it), then records the instance as
  holding each volume (ATTACHED) and gives the driver its MountedVolumes. A failure marks the
  volume FAILED with the backend's message and raises RuntimeFailure: the instance is FAILED,
  never started.
- `release` (an instance ends or is removed): AVAILABLE again once nothing holds it.
- ProvisionVolume / DeleteVolume from the scheduler, each acked: a delete is refused with
  FAILED_PRECONDITION while an instance holds the volume.
- `adopt` at agent start: every volume the backends hold, readied again (ext4 mounted).

Nothing here raises out to the agent: a full or broken volume is its instances' error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from google.rpc import code_pb2, status_pb2

from orka.api import agent_pb2 as apb
from orka.errors import OrkaError, RuntimeFailure
from orka.models import (
    MAX_VOLUME_BYTES,
    MIN_VOLUME_BYTES,
    VolumeAttachment,
    VolumeReport,
    VolumeState,
    WorkloadKind,
    check_name,
)
from orka.rpc import convert
from orka.rpc.convert_volumes import attachment_from_pb, report_to_pb
from orka.runtime.volume_ext4 import Ext4Backend
from orka.runtime.volume_qcow2 import Qcow2Backend
from orka.runtime.volume_tools import fs_size
from orka.runtime.volumes import MountedVolume, VolumeBackend

log = structlog.get_logger("orka.agent.volumes")

Ack = Callable[[str, status_pb2.Status], None]
Send = Callable[[apb.AgentMessage], None]


def default_backends(root: Path) -> dict[str, VolumeBackend]:
    """Every backend this agent knows, each under its own directory of `root`."""
    return {"ext4": Ext4Backend(root / "ext4"), "qcow2": Qcow2Backend(root / "qcow2")}


@dataclass
class _Volume:
    name: str
    backend: str
    size_bytes: int
    state: VolumeState = VolumeState.PENDING
    message: str = ""
    host_path: Path | None = None
    # Instances holding it (started, or starting, on it) -> their kind.
    holders: dict[str, WorkloadKind] = field(default_factory=dict)
    provisioning: asyncio.Task[None] | None = None

    def report(self) -> VolumeReport:
        return VolumeReport(
            name=self.name,
            state=self.state,
            size_bytes=self.size_bytes,
            backend=self.backend,
            message=self.message,
            attached_to=sorted(self.holders),
        )


class VolumeManager:
    def __init__(
        self,
        root: Path,
        send: Send,
        ack: Ack,
        backends: Mapping[str, VolumeBackend] | None = None,
    ) -> None:
        self.root = root
        self.send = send
        self.ack = ack
        self.all_backends = dict(backends if backends is not None else default_backends(root))
        # Only those that work on this node are offered (NodeInfo.volume_backends).
        self.backends: dict[str, VolumeBackend] = {}
        self.volumes: dict[str, _Volume] = {}
        self._background: set[asyncio.Task[None]] = set()

    # ---- at start ----

    async def adopt(self) -> None:
        # Traversable only (like the data dir): an instance reaches its own volume's
        # directory, and can list nothing here.
        await asyncio.to_thread(self.root.mkdir, 0o711, True, True)
        await asyncio.to_thread(self.root.chmod, 0o711)
        for name, backend in self.all_backends.items():
            problem = backend.unavailable()
            if problem:
                log.warning("volume backend unavailable", backend=name, reason=problem)
                continue
            self.backends[name] = backend
            try:
                found = await backend.adopt()
            except Exception as err:  # one broken backend must not stop the agent
                log.warning("volumes not re-adopted", backend=name, error=str(err))
                continue
            for p in found:
                self.volumes[p.name] = _Volume(
                    p.name, name, p.size_bytes, VolumeState.AVAILABLE, host_path=p.host_path
                )
            if found:
                log.info("re-adopted volumes", backend=name, count=len(found))

    # ---- what the node announces ----

    def backend_names(self) -> list[str]:
        return sorted(self.backends)

    def capacity_bytes(self) -> int:
        return fs_size(self.root) if self.backends else 0

    def reports(self) -> list[VolumeReport]:
        return [v.report() for v in self.volumes.values()]

    def statuses(self) -> list[apb.VolumeStatus]:
        return [report_to_pb(r) for r in self.reports()]

    def _changed(self, vol: _Volume) -> None:
        self.send(apb.AgentMessage(volume_status=report_to_pb(vol.report())))

    def _set(self, vol: _Volume, state: VolumeState, message: str = "") -> None:
        if vol.holders and state is VolumeState.AVAILABLE:
            state = VolumeState.ATTACHED
        vol.state, vol.message = state, message
        self._changed(vol)

    # ---- instances ----

    def ready(self, attachments: Iterable[VolumeAttachment]) -> bool:
        """Whether every volume is provisioned here already (no wait before a start)."""
        for a in attachments:
            vol = self.volumes.get(a.name)
            if vol is None or vol.host_path is None or vol.provisioning is not None:
                return False
        return True

    async def acquire(
        self, instance: str, kind: WorkloadKind, attachments: Iterable[VolumeAttachment]
    ) -> tuple[MountedVolume, ...]:
        """Provision (if needed) and hold each volume for `instance`; RuntimeFailure (the
        backend's message) when one cannot be had: the instance must not start."""
        mounted = []
        for a in attachments:
            vol = await self._provisioned(a)
            if vol.backend == "qcow2" and kind is WorkloadKind.VM:
                # A qcow2 disk serves one running VM at a time.
                others = [h for h, k in vol.holders.items() if h != instance and k is kind]
                if others:
                    raise RuntimeFailure(f"volume {a.name}: in use by VM {others[0]}")
            assert vol.host_path is not None
            if instance not in vol.holders:
                vol.holders[instance] = kind
                self._set(vol, VolumeState.ATTACHED)
            mounted.append(
                MountedVolume(
                    name=a.name,
                    backend=vol.backend,
                    host_path=vol.host_path,
                    mount_path=a.mount_path,
                    read_only=a.read_only,
                    size_bytes=vol.size_bytes,
                    env_name=a.env_name or a.name,
                )
            )
        return tuple(mounted)

    def hold(
        self, instance: str, kind: WorkloadKind, attachments: Iterable[VolumeAttachment]
    ) -> None:
        """An instance re-adopted while running holds its volumes (no provisioning)."""
        for a in attachments:
            vol = self.volumes.get(a.name)
            if vol is not None and instance not in vol.holders:
                vol.holders[instance] = kind
                self._set(vol, VolumeState.ATTACHED)

    def release(self, instance: str) -> None:
        for vol in self.volumes.values():
            if vol.holders.pop(instance, None) is None:
                continue
            if not vol.holders and vol.state is VolumeState.ATTACHED:
                self._set(vol, VolumeState.AVAILABLE)
            else:
                self._changed(vol)  # attached_to is one shorter

    async def _provisioned(self, a: VolumeAttachment) -> _Volume:
        # Checked like any input from outside: these become file names and file sizes.
        try:
            check_name(a.name, "volume")
        except ValueError as err:
            raise RuntimeFailure(str(err)) from None
        if not MIN_VOLUME_BYTES <= a.size_bytes <= MAX_VOLUME_BYTES:
            raise RuntimeFailure(
                f"volume {a.name}: size {a.size_bytes} is outside"
                f" {MIN_VOLUME_BYTES}..{MAX_VOLUME_BYTES} bytes"
            )
        vol = self.volumes.get(a.name)
        if vol is not None and vol.state is VolumeState.DELETING:
            raise RuntimeFailure(f"volume {a.name}: is being deleted on this node")
        if vol is not None and vol.backend != a.backend and vol.host_path is not None:
            raise RuntimeFailure(
                f"volume {a.name}: is a {vol.backend} volume on this node, not {a.backend}"
            )
        if vol is None or (vol.host_path is None and vol.provisioning is None):
            vol = _Volume(a.name, a.backend, a.size_bytes, holders=vol.holders if vol else {})
            self.volumes[a.name] = vol
            vol.provisioning = asyncio.create_task(self._provision(vol))
        if vol.provisioning is not None:
            # Shielded: an instance stopped while it waits leaves the provisioning running.
            await asyncio.shield(vol.provisioning)
        if vol.host_path is None:
            raise RuntimeFailure(vol.message or f"volume {a.name}: not provisioned")
        return vol

    async def _provision(self, vol: _Volume) -> None:
        """Never raises: the outcome is the volume's state."""
        self._set(vol, VolumeState.PENDING)
        try:
            backend = self.backends.get(vol.backend)
            if backend is None:
                offered = ", ".join(self.backends) or "none"
                raise RuntimeFailure(
                    f"volume {vol.name}: no {vol.backend or '(unnamed)'} backend on this node"
                    f" (offered: {offered})"
                )
            started = asyncio.get_running_loop().time()
            p = await backend.provision(vol.name, vol.size_bytes)
            vol.host_path = p.host_path
            log.info(
                "volume ready",
                volume=vol.name,
                backend=vol.backend,
                seconds=round(asyncio.get_running_loop().time() - started, 3),
            )
            self._set(vol, VolumeState.AVAILABLE)
        except Exception as err:
            message = err.message if isinstance(err, OrkaError) else f"volume {vol.name}: {err}"
            log.warning("volume provisioning failed", volume=vol.name, error=message[:300])
            self._set(vol, VolumeState.FAILED, message)
        finally:
            vol.provisioning = None

    # ---- commands ----

    def on_provision(self, msg: apb.ProvisionVolume) -> None:
        self._spawn(self._provision_command(msg))

    async def _provision_command(self, msg: apb.ProvisionVolume) -> None:
        try:
            a = attachment_from_pb(msg.volume)
            await self._provisioned(a)
        except OrkaError as err:
            self.ack(
                msg.command_id, convert.error_status(code_pb2.FAILED_PRECONDITION, err.message)
            )
            return
        except Exception as err:  # a malformed attachment
            self.ack(msg.command_id, convert.error_status(code_pb2.INVALID_ARGUMENT, str(err)))
            return
        self.ack(msg.command_id, convert.ok_status())

    def on_delete(self, msg: apb.DeleteVolume) -> None:
        vol = self.volumes.get(msg.volume)
        if vol is not None and vol.holders:
            why = f"volume {msg.volume} is in use by {', '.join(sorted(vol.holders))}"
            self.ack(msg.command_id, convert.error_status(code_pb2.FAILED_PRECONDITION, why))
            return
        self._spawn(self._delete(msg))

    async def _delete(self, msg: apb.DeleteVolume) -> None:
        name = msg.volume
        vol = self.volumes.get(name)
        try:
            if vol is not None:
                if vol.provisioning is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(vol.provisioning)
                self._set(vol, VolumeState.DELETING)
                backends = (
                    [self.all_backends[vol.backend]] if vol.backend in self.all_backends else []
                )
            else:
                # Not known here: whatever any backend still holds of it goes (idempotent).
                backends = list(self.backends.values())
            for backend in backends:
                await backend.delete(name)
        except Exception as err:
            message = err.message if isinstance(err, OrkaError) else str(err)
            if vol is not None:
                self._set(vol, VolumeState.FAILED, message)
            self.ack(msg.command_id, convert.error_status(code_pb2.UNAVAILABLE, message))
            return
        if vol is not None and self.volumes.get(name) is vol:
            if vol.holders:  # an instance took it while it was being deleted: keep it
                self.ack(
                    msg.command_id,
                    convert.error_status(code_pb2.FAILED_PRECONDITION, f"volume {name} in use"),
                )
                return
            del self.volumes[name]
        self.ack(msg.command_id, convert.ok_status())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
