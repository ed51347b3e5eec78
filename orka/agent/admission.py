"""Admission: the agent's own check of an offer, and the room it reserves for accepted ones."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from google.rpc import code_pb2

from orka import fit
from orka.agent.supervisor import Supervised
from orka.api import agent_pb2 as apb
from orka.errors import OrkaError
from orka.models import (
    FAKE_DRIVER,
    KIND_DRIVER,
    OCI_ARCHIVE_PREFIX,
    Resources,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert
from orka.runtime.base import Driver
from orka.validation import path_within, quote

# How long an offer is held when the scheduler names no time.
DEFAULT_HOLD_SECONDS = 30.0


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


@dataclass(frozen=True, slots=True)
class Reservation:
    """What an accepted offer holds on this node until its start comes or `deadline` passes."""

    resources: Resources
    deadline: float
    host_ports: frozenset[fit.HostPort] = fit.NO_HOST_PORTS


class Reservations(dict[str, Reservation]):
    """Accepted offers by instance, with the room they hold summed as they come and go: an
    offer is checked against what the node holds, and during a burst hundreds are reserved
    at once, so the sum is not recounted per offer."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_millis = 0
        self.memory_bytes = 0

    def _add(self, r: Reservation, sign: int) -> None:
        self.cpu_millis += sign * r.resources.cpu_millis
        self.memory_bytes += sign * r.resources.memory_bytes

    def __setitem__(self, name: str, r: Reservation) -> None:
        old = self.get(name)
        if old is not None:
            self._add(old, -1)
        super().__setitem__(name, r)
        self._add(r, 1)

    def __delitem__(self, name: str) -> None:
        self._add(self[name], -1)
        super().__delitem__(name)

    def pop(self, name: str, *default: Reservation | None) -> Reservation | None:  # type: ignore[override]
        if name in self:
            r = super().pop(name)
            self._add(r, -1)
            return r
        if default:
            return default[0]
        raise KeyError(name)

    def clear(self) -> None:
        super().clear()
        self.cpu_millis = self.memory_bytes = 0


class Held(Protocol):
    """What admission reads of an instance on this node."""

    @property
    def resources(self) -> Resources: ...

    @property
    def holds_resources(self) -> bool: ...


def driver_name(healthy: Mapping[str, Driver], kind: WorkloadKind) -> str | None:
    """The healthy driver that runs `kind` here (the fake one runs every kind)."""
    wanted = KIND_DRIVER[kind]
    if wanted in healthy:
        return wanted
    if FAKE_DRIVER in healthy:
        return FAKE_DRIVER
    return None


class Admission:
    """Answers offers: accepted only when a healthy driver runs the kind, its files are under
    the allowed paths, and the node has room and the fixed host ports free beside what runs
    and what is reserved; an accepted offer reserves them until the start comes or the hold
    runs out."""

    def __init__(
        self,
        capacity: Resources,
        allowed_paths: list[Path],
        healthy: Mapping[str, Driver],
        instances: Mapping[str, Supervised],
        shutting_down: Callable[[], bool],
        send: Callable[[apb.AgentMessage], None],
        node: str = "",
    ) -> None:
        self.node = node
        self.capacity = capacity
        self.allowed_paths = allowed_paths
        self.healthy = healthy
        self.instances = instances
        self.shutting_down = shutting_down
        self.send = send
        # Accepted offers not yet started, by instance.
        self.reservations = Reservations()
        # What the instances here hold (those that hold any), kept as they change (`track`)
        # rather than summed per offer: an agent running hundreds of instances admits each
        # new one against them, which summed every time made a burst quadratic.
        self._held: dict[str, Resources] = {}
        self._held_cpu = 0
        self._held_mem = 0
        for name, inst in instances.items():
            self.track(name, inst)

    def track(self, name: str, inst: Held) -> None:
        """`name` is now `inst` (added, or its state changed): count what it holds. The
        runner calls this on every change of an instance it keeps; a change of an instance
        no longer kept under that name (stopped and replaced) is ignored."""
        if self.instances.get(name) is not inst:
            return
        self._drop(name)
        if inst.holds_resources:
            r = inst.resources
            self._held[name] = r
            self._held_cpu += r.cpu_millis
            self._held_mem += r.memory_bytes

    def forget(self, name: str) -> None:
        """`name` is no longer kept here (the runner removed it)."""
        self._drop(name)

    def _drop(self, name: str) -> None:
        r = self._held.pop(name, None)
        if r is not None:
            self._held_cpu -= r.cpu_millis
            self._held_mem -= r.memory_bytes

    def allocated(self) -> Resources:
        res = self.reservations
        return Resources(
            cpu_millis=self._held_cpu + res.cpu_millis,
            memory_bytes=self._held_mem + res.memory_bytes,
        )

    def host_ports(self, besides: str) -> set[fit.HostPort]:
        """The host ports held here by instances that run or start (those they fix, and those
        the node picked for them) and by accepted offers, apart from `besides`' own
        reservation."""
        used: set[fit.HostPort] = set()
        for inst in self.instances.values():
            if inst.holds_resources:
                used.update(inst.spec.fixed_host_ports)
                used.update((b.host_port, b.protocol) for b in inst.ports)
        for name, r in self.reservations.items():
            if name != besides:
                used.update(r.host_ports)
        return used

    def expire(self) -> None:
        now = time.monotonic()
        for name, r in list(self.reservations.items()):
            if r.deadline < now:
                del self.reservations[name]

    def release(self, instance: str) -> None:
        self.reservations.pop(instance, None)

    def admit(self, name: str, spec: WorkloadSpec) -> str | None:
        """Our own check of an offer; returns why not, or None to accept."""
        if self.shutting_down():
            return fit.SHUTTING_DOWN.message
        driver = driver_name(self.healthy, spec.kind)
        if driver is None:
            return fit.no_driver(KIND_DRIVER[spec.kind]).message
        refusal = self.healthy[driver].admit(spec)
        if refusal is not None:
            return refusal
        used = self.allocated()
        if name in self.reservations:
            used = used - self.reservations[name].resources
        outside = self._outside_allowed(spec)
        if outside is not None:
            return outside
        cap = self.capacity
        room = fit.Room(cap.cpu_millis, cap.memory_bytes, used.cpu_millis, used.memory_bytes)
        reason = fit.resources(spec.resources, room)
        if reason is not None:
            return fit.explain_resources(reason, spec.resources, room)
        # The same order as the scheduler's rule: resources, then host ports.
        wanted = spec.fixed_host_ports
        if wanted:
            taken = fit.ports_taken(wanted, self.host_ports(besides=name))
            if taken is not None:
                return taken.message
        return None

    def _outside_allowed(self, spec: WorkloadSpec) -> str | None:
        """Files a driver opens on this node (VM disks, kernels, initrds, OCI archives) must
        be under --allowed-paths, so a workload cannot boot or import whatever the agent can
        read. The path and, through symlinks, the file it names are both checked."""
        roots = [str(p) for p in self.allowed_paths]
        for field_name, path in node_files(spec):
            real = os.path.realpath(path)
            real_roots = [os.path.realpath(r) for r in roots]
            if not (path_within(path, roots) and path_within(real, real_roots)):
                return (
                    f"{field_name}: {quote(path, 512)} is outside the paths this node allows"
                    f" ({', '.join(roots) or 'none'}; agent flag --allowed-paths)"
                )
        return None

    def _volume_elsewhere(self, a: apb.Assignment) -> str | None:
        """The scheduler's volume rule as this node sees it: a volume bound to another node
        has its data there, never here (the rest of the rule, backends and room, is the
        volume manager's to check when it provisions)."""
        for v in a.volumes:
            if v.node and self.node and v.node != self.node:
                return fit.volume_elsewhere(v.name, v.node).message
        return None

    def on_offer(self, offer: apb.Offer) -> None:
        name = offer.assignment.instance
        try:
            spec = convert.spec_from_pb(offer.assignment.spec)
            reason = None if name in self.instances else self.admit(name, spec)
            reason = reason or self._volume_elsewhere(offer.assignment)
            code = code_pb2.FAILED_PRECONDITION
        except OrkaError as err:
            spec, reason = None, f"invalid assignment: {err.message}"
            code = code_pb2.INVALID_ARGUMENT
        if reason is None and spec is not None and name not in self.instances:
            hold = offer.hold_seconds or DEFAULT_HOLD_SECONDS
            self.reservations[name] = Reservation(
                spec.resources, time.monotonic() + hold, spec.fixed_host_ports
            )
        status = convert.ok_status() if reason is None else convert.error_status(code, reason)
        self.send(
            apb.AgentMessage(offer_reply=apb.OfferReply(offer_id=offer.offer_id, status=status))
        )
