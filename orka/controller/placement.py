"""The placement queue: PENDING instances go to the scheduler in batches; bindings are CAS-written.

An instance is bound exactly once: the scheduler only returns an accepted offer, and the binding
is written only if the instance is still PENDING at the revision we hold. When the write cannot
happen (the instance was deleted or bound meanwhile) the offer is released on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from orka import fit, metrics
from orka.controller import volume_plan
from orka.controller.activity import NORMAL, WARNING, ActivityLog, placed_text
from orka.controller.commands import Assignment, NodeCommand, Release, Start, start_command
from orka.controller.link import PlaceResult, SchedulerLink, assignment_bytes
from orka.controller.repo import Change, Repo
from orka.errors import OrkaError
from orka.models import (
    Instance,
    InstancePhase,
    InstanceReason,
    VolumeAttachment,
    Workload,
    WorkloadSpec,
)

log = structlog.get_logger("orka.controller.placement")


@dataclass
class PlacementConfig:
    # A batch takes whatever is pending, up to this many: small when instances trickle in,
    # large under a backlog. Large batches are what lets the scheduler put several offers
    # (and later starts) to one node in one frame: with fewer instances per batch than
    # nodes, spreading gives each node at most one, so every instance costs four frames on
    # the agent streams (figures: bench/RESULTS.md).
    batch_size: int = 4096
    # ... and at most this many bytes of assignments (each carries its workload's spec), so
    # a batch of large specs stays far below the gRPC message limit (64 MiB).
    batch_bytes: int = 16 << 20
    # Batches overlap their round trips (offers, bind, starts).
    max_batches_in_flight: int = 3
    backoff_start: float = 1.0
    backoff_max: float = 30.0


@dataclass
class _Backoff:
    until: float = 0.0
    delay: float = 0.0


@dataclass
class PlacementQueue:
    repo: Repo
    link: SchedulerLink
    config: PlacementConfig = field(default_factory=PlacementConfig)
    pending: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    inflight: set[str] = field(default_factory=set)
    backoff: dict[str, _Backoff] = field(default_factory=dict)
    # Instances every node refused for reasons waiting cannot fix (no such driver, no node with
    # the selected labels, more than any node's capacity): the cluster shape and the spec they
    # were refused on. Node events do not cut their backoff short until one of those changes.
    parked: dict[str, tuple[int, WorkloadSpec]] = field(default_factory=dict)
    # Unbound volume -> the instance being placed with it (a volume is bound only once).
    placing: dict[str, str] = field(default_factory=dict)
    # Volume -> instances placed with it or waiting for it, woken when it changes.
    waiting_on: dict[str, set[str]] = field(default_factory=dict)
    # cluster_changed() calls so far: a batch that saw one while it was out parks nothing.
    _changes: int = 0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _batches: set[asyncio.Task[None]] = field(default_factory=set)
    # Where placements and failed placements are recorded (orka/controller/activity.py).
    activity: ActivityLog = field(default_factory=ActivityLog)

    def __post_init__(self) -> None:
        self.repo.listeners.append(self._on_change)

    def _on_change(self, change: Change, old: object) -> None:
        if change.kind == "volumes":
            self.volume_changed(change.name)

    def add(self, name: str) -> None:
        if name not in self.pending and name not in self.inflight:
            self.pending[name] = None
            self._wake.set()

    def cluster_changed(self) -> None:
        """A node joined or resources were freed: retry everything now, not after backoff; but
        not what only a new node, new drivers, labels or capacity can place, unless they came."""
        self._changes += 1
        kept: dict[str, _Backoff] = {}
        if self.parked:
            shape = self._shape()
            for name, (parked_on, _) in list(self.parked.items()):
                b = self.backoff.get(name)
                if parked_on == shape and b is not None:
                    kept[name] = b
                else:
                    del self.parked[name]
        self.backoff = kept
        self._wake.set()

    def _shape(self) -> int:
        """What an unresolvable refusal depends on: which nodes exist, with which drivers,
        pool, labels, allocatable and volume backends and space (not their usage, state or
        cordon, which waiting changes). A volume's own change wakes its instances apart
        (volume_changed)."""
        return hash(
            frozenset(
                (
                    n.name,
                    frozenset(n.drivers),
                    n.pool,
                    frozenset(n.labels.items()),
                    n.allocatable.cpu_millis,
                    n.allocatable.memory_bytes,
                    # Where volumes can be made (VOLUME_BACKEND, VOLUME_TOO_BIG).
                    frozenset(n.volume_backends),
                    n.volume_capacity_bytes,
                )
                for n in self.repo.nodes.values()
            )
        )

    async def close(self) -> None:
        for task in list(self._batches):
            task.cancel()
        for task in list(self._batches):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def busy(self, name: str) -> bool:
        return name in self.inflight

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            while len(self._batches) < self.config.max_batches_in_flight:
                batch = self._take(now)
                if not batch:
                    break
                task = asyncio.create_task(self._place(batch))
                self._batches.add(task)
                task.add_done_callback(self._done)
            next_due = min(
                (b.until for n, b in self.backoff.items() if n in self.pending), default=None
            )
            if next_due is not None and not self._wake.is_set():
                asyncio.get_running_loop().call_later(
                    max(0.0, next_due - time.monotonic()) + 0.01, self._wake.set
                )

    def _done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("placement batch failed", error=repr(task.exception()))

    def _take(self, now: float) -> list[Instance]:
        if not self.pending:
            return []
        batch: list[Instance] = []
        size = 0
        limit = self.config.batch_size
        for name in list(self.pending):
            if len(batch) >= limit or size >= self.config.batch_bytes:
                break
            b = self.backoff.get(name)
            if b is not None and b.until > now and not self._spec_changed(name):
                continue
            inst = self.repo.instances.get(name)
            if inst is None or inst.phase is not InstancePhase.PENDING or inst.desired_stop:
                del self.pending[name]
                if self.waiting_on and inst is not None:
                    self._forget_waits(inst)
                continue
            w = self.repo.workloads.get(inst.workload)
            if w is None:
                del self.pending[name]
                continue
            cost = assignment_bytes(Assignment.of(inst, w))
            if batch and size + cost > self.config.batch_bytes:
                break  # the next batch takes it
            del self.pending[name]
            size += cost
            self.inflight.add(name)
            batch.append(inst)
        return batch

    def _spec_changed(self, name: str) -> bool:
        """A parked instance whose workload's spec is no longer the one that was refused."""
        parked = self.parked.get(name)
        if parked is None:
            return False
        inst = self.repo.instances.get(name)
        w = self.repo.workloads.get(inst.workload) if inst is not None else None
        if w is not None and w.spec is parked[1]:
            return False
        del self.parked[name]
        return True

    def _retry_later(self, name: str) -> None:
        b = self.backoff.setdefault(name, _Backoff())
        b.delay = min(max(b.delay * 2, self.config.backoff_start), self.config.backoff_max)
        b.until = time.monotonic() + b.delay
        self.pending[name] = None

    async def _place(self, batch: list[Instance]) -> None:
        assignments = []
        waiting: dict[str, str] = {}
        held_back: list[str] = []
        try:
            for inst in batch:
                w = self.repo.workloads[inst.workload]
                atts, why = self._volumes_of(inst, w)
                if why:
                    waiting[inst.name] = why
                elif self._claim(inst.name, atts):
                    assignments.append(Assignment.of(inst, w, atts))
                else:
                    held_back.append(inst.name)
            if waiting:
                await self._mark_waiting(waiting)
            for name in held_back:
                # Another instance is being placed with its unbound volume: once that one is
                # bound, this one follows it to the volume's node.
                self._retry_later(name)
            if assignments:
                await self._place_assignments(assignments)
        finally:
            for inst in batch:
                self.inflight.discard(inst.name)
            for a in assignments:
                for v in a.volumes:
                    if self.placing.get(v.name) == a.instance:
                        del self.placing[v.name]

    def _volumes_of(self, inst: Instance, w: Workload) -> tuple[tuple[VolumeAttachment, ...], str]:
        """The instance's volume attachments, or why it must wait for one of them."""
        spec = w.spec
        if not spec.volumes and spec.volume_template is None:
            return (), ""
        r = volume_plan.resolve(inst, w, self.repo.volumes, self.repo.classes)
        for name in r.names:
            self.waiting_on.setdefault(name, set()).add(inst.name)
        if r.wait:
            return (), r.wait
        if any(a.backend == "qcow2" for a in r.attachments):
            siblings = self.repo.instances_of(w.name)
            uses = {
                s.name: volume_plan.volume_names(spec, w.name, s.ordinal)
                for s in siblings
                if s.node and not s.terminal
            }
            busy = volume_plan.single_user_busy(
                inst, r.attachments, self.repo.volumes, siblings, uses
            )
            if busy:
                return (), busy
        return r.attachments, ""

    def _claim(self, instance: str, atts: tuple[VolumeAttachment, ...]) -> bool:
        """Take the instance's unbound volumes for its placement; False when another
        placement in flight has one of them (a volume is bound once, with one instance)."""
        unbound = [a.name for a in atts if not a.node]
        if any(self.placing.get(n, instance) != instance for n in unbound):
            return False
        for n in unbound:
            self.placing[n] = instance
        return True

    def _forget_waits(self, inst: Instance) -> None:
        w = self.repo.workloads.get(inst.workload)
        if w is not None:
            self._unwait(inst.name, volume_plan.volume_names(w.spec, w.name, inst.ordinal))

    def _unwait(self, instance: str, names: Iterable[str]) -> None:
        """The instance no longer waits on these volumes (bound, or gone)."""
        for name in names:
            users = self.waiting_on.get(name)
            if users is not None:
                users.discard(instance)
                if not users:
                    del self.waiting_on[name]

    def volume_changed(self, name: str) -> None:
        """A volume changed: the instances that wait for it (or were placed with it) are tried
        again now, not after their backoff."""
        waiting = self.waiting_on.pop(name, None)
        if not waiting:
            return
        for inst in waiting:
            self.backoff.pop(inst, None)
            self.parked.pop(inst, None)
            if inst in self.repo.instances:
                self.add(inst)
        self._wake.set()

    async def _place_assignments(self, assignments: list[Assignment]) -> None:
        changes = self._changes
        try:
            results = await self.link.place(assignments)
        except OrkaError as err:
            await self._mark_unplaced(
                {a.instance: f"scheduler unavailable: {err.message}" for a in assignments}
            )
            return
        bound = {r.instance: r.node for r in results if r.node}
        why = {r.instance: r.reasons for r in results if not r.node}
        unplaced = {name: fit.format_reasons(counts) for name, counts in why.items()}
        metrics.unschedulable(why)
        volumes = {a.instance: a.volumes for a in assignments if a.volumes}
        committed = await self._bind(bound, volumes)
        self._record(results, committed, unplaced)
        if unplaced:
            await self._mark_unplaced(unplaced)
            self._park(why, changed=self._changes != changes)
        await self._start(committed)

    def _record(
        self, results: list[PlaceResult], committed: list[Instance], unplaced: dict[str, str]
    ) -> None:
        record = self.activity.record
        if committed:
            by_name = {r.instance: r for r in results if r.node}
            for inst in committed:
                r = by_name[inst.name]
                text = placed_text(r.node, r.passed_over, r.refusals)
                record("instance", inst.name, NORMAL, "Scheduled", text)
        for name, why in unplaced.items():
            # The same reasons again fold into one entry with a count (retries with backoff).
            record("instance", name, WARNING, "FailedScheduling", f"no node took it: {why}")

    async def _bind(
        self,
        bound: dict[str, str],
        volumes: dict[str, tuple[VolumeAttachment, ...]] | None = None,
    ) -> list[Instance]:
        volumes = volumes or {}
        released: list[tuple[str, str]] = []
        committed: list[Instance] = []
        retry: list[str] = []

        def plan() -> list[Change]:
            changes: list[Change] = []
            now = time.time()
            # Volumes bound by this plan so far: two instances of one batch never bind one
            # volume to two nodes (the claim prevents it; this is the write's own check).
            vols = dict(self.repo.volumes)
            for name, node in bound.items():
                inst = self.repo.instances.get(name)
                if inst is None or inst.phase is not InstancePhase.PENDING or inst.desired_stop:
                    released.append((node, name))
                    continue
                atts = volumes.get(name, ())
                if atts:
                    w = self.repo.workloads.get(inst.workload)
                    binds = (
                        volume_plan.bind_volumes(
                            inst, w, atts, self.repo.nodes.get(node), node, vols
                        )
                        if w is not None
                        else None
                    )
                    if binds is None:
                        # A volume went elsewhere (or away) meanwhile: placed again, anew.
                        released.append((node, name))
                        retry.append(name)
                        continue
                    for v in binds:
                        vols[v.name] = v
                        changes.append(
                            Change("volumes", v.name, v, create=v.name not in self.repo.volumes)
                        )
                new = inst.scheduled(node, now)
                committed.append(new)
                changes.append(Change("instances", name, new))
            return changes

        await self.repo.mutate(plan)
        for inst in committed:
            self._unwait(inst.name, (a.name for a in volumes.get(inst.name, ())))
        for name in retry:
            self._retry_later(name)
        for name in (i.name for i in committed):
            self.backoff.pop(name, None)
        if released:
            cmds: list[NodeCommand] = [Release(node=node, instance=name) for node, name in released]
            try:
                await self.link.command(cmds)
            except OrkaError as err:
                log.warning("release failed", error=err.message)
        return committed

    async def _start(self, committed: list[Instance]) -> None:
        if not committed:
            return
        cmds: list[Start] = []
        for inst in committed:
            w = self.repo.workloads.get(inst.workload)
            if w is None:
                continue
            atts = self.attachments(inst, w)
            if atts is None:
                continue  # a volume went away since the bind: the reconciler resends later
            cmds.append(start_command(inst, w, atts))
        failed: dict[str, str] = {}
        try:
            results = await self.link.command(cmds)
        except OrkaError as err:
            # The start may or may not have reached the node. Unbinding now could run the
            # instance twice; it stays SCHEDULED, the reconciler sends the start again, and a
            # node that never runs it reports so (or is lost), which frees the instance.
            log.warning("start not confirmed; will retry", count=len(cmds), error=err.message)
            return
        for cmd, result in zip(cmds, results, strict=True):
            if not result.ok and not result.unconfirmed:
                failed[cmd.instance] = result.error
        if failed:
            await self._unbind(failed)

    async def _unbind(self, failed: dict[str, str]) -> None:
        """A start the node refused: the instance goes back to PENDING on no node."""

        def plan() -> list[Change]:
            changes = []
            for name, error in failed.items():
                inst = self.repo.instances.get(name)
                if inst is None or inst.phase is not InstancePhase.SCHEDULED:
                    continue
                new = inst.start_refused(error, time.time())
                changes.append(Change("instances", name, new))
            return changes

        await self.repo.mutate(plan)
        for name in failed:
            self._retry_later(name)

    def attachments(self, inst: Instance, w: Workload) -> tuple[VolumeAttachment, ...] | None:
        """A bound instance's volumes as its start carries them (each with its node now);
        None when one cannot be used any more."""
        spec = w.spec
        if not spec.volumes and spec.volume_template is None:
            return ()
        r = volume_plan.resolve(inst, w, self.repo.volumes, self.repo.classes)
        return None if r.wait else r.attachments

    async def _mark_waiting(self, reasons: dict[str, str]) -> None:
        """Instances whose volume cannot be used now: PENDING with the reason, retried when
        the volume changes (volume_changed) or after their backoff."""

        def plan() -> list[Change]:
            changes = []
            for name, why in reasons.items():
                inst = self.repo.instances.get(name)
                if inst is None or inst.phase is not InstancePhase.PENDING:
                    continue
                if inst.reason == InstanceReason.VOLUME_UNAVAILABLE and inst.message == why:
                    continue  # unchanged: no write
                changes.append(Change("instances", name, inst.volume_unavailable(why, time.time())))
            return changes

        await self.repo.mutate(plan)
        for name in reasons:
            if name in self.repo.instances:
                self._retry_later(name)
                self.activity.record("instance", name, WARNING, "VolumeUnavailable", reasons[name])

    def _park(self, why: dict[str, list[fit.ReasonCount]], changed: bool) -> None:
        """Park what only a change of shape can place, unless one came while it was out."""
        shape: int | None = None
        for name, counts in why.items():
            self.parked.pop(name, None)
            inst = self.repo.instances.get(name)
            w = self.repo.workloads.get(inst.workload) if inst is not None else None
            if w is not None and name in self.backoff and fit.unresolvable(counts) and not changed:
                shape = self._shape() if shape is None else shape
                self.parked[name] = (shape, w.spec)

    async def _mark_unplaced(self, reasons: dict[str, str]) -> None:
        def plan() -> list[Change]:
            changes = []
            for name, why in reasons.items():
                inst = self.repo.instances.get(name)
                if inst is None or inst.phase is not InstancePhase.PENDING:
                    continue
                if inst.reason == InstanceReason.UNSCHEDULABLE and inst.message == why:
                    continue  # unchanged: no write
                new = inst.unschedulable(why, time.time())
                changes.append(Change("instances", name, new))
            return changes

        await self.repo.mutate(plan)
        for name in reasons:
            if name in self.repo.instances:
                self._retry_later(name)
        self._wake.set()
