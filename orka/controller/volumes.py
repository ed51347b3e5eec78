"""The Volume resource's life in the controller: what agents report, node loss, deletion and
immediate provisioning.

A volume is local storage on one node. Its record says where it lives (`node`, set when it is
first bound) and in what state its agent last said it is. The pure functions below are the
state machine (each returns the new record, or None for "no change"); `VolumeKeeper` applies
them to what the scheduler's feed says, and runs the commands that make and delete volumes on
their nodes (NodeCommand.provision_volume / delete_volume), resending until they are answered.

    PENDING --agent made it--> AVAILABLE <--instances come and go--> ATTACHED
    AVAILABLE, template volume of a deleted workload --> RELEASED (data kept, taken back later)
    any state --its node LOST--> LOST --node back, volume listed--> the reported state
    DeleteVolume: PENDING without node / LOST --> record removed at once;
                  ATTACHED --> refused; else DELETING --node acks the delete--> removed
    a node registers with a volume nobody has a record of --> recorded as it reports it (its
        data is never deleted unasked: the user sees it and deletes it, or keeps it)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Sequence

import structlog
from pydantic import ValidationError

from orka.controller.commands import (
    ClusterUpdate,
    DeleteVolume,
    NodeCommand,
    NodeSeen,
    NodeSynced,
    ProvisionVolume,
    VolumeReported,
)
from orka.controller.link import SchedulerLink
from orka.controller.repo import Change, Repo
from orka.errors import Conflict, OrkaError
from orka.models import (
    VOLUME_BACKENDS,
    Class,
    InstancePhase,
    Node,
    NodeState,
    Volume,
    VolumeAttachment,
    VolumeReport,
    VolumeSpec,
    VolumeState,
    Workload,
    WorkloadKind,
    backend_for,
)

# How many (node, volume) pairs the keeper remembers having warned about.
MAX_UNRECORDED_SEEN = 10_000

log = structlog.get_logger("orka.controller.volumes")

# How long a provision or delete command may go unanswered (or refused) before it is resent.
RESEND_AFTER = 10.0
# A pass runs at least this often (resends, and volumes waiting for a node to provision on).
PASS_EVERY = 2.0


def size_text(n: int) -> str:
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= size:
            return f"{n // size}{unit}" if n % size == 0 else f"{n / size:.1f}{unit}"
    return f"{n}"


# ---- the state machine ----


def reported(
    vol: Volume, node: str, r: VolumeReport, workload_exists: bool, now: float
) -> Volume | None:
    """Its agent's report. Only the node the volume is bound to speaks for it; a volume being
    deleted stays DELETING until the delete is acknowledged."""
    if not vol.node or vol.node != node or vol.state is VolumeState.DELETING:
        return None
    state = r.state
    if state is VolumeState.LOST:
        return None  # not an agent's to say: it speaks for a volume it has
    if state is VolumeState.RELEASED:
        state = VolumeState.AVAILABLE
    if state is VolumeState.AVAILABLE and vol.workload and not workload_exists:
        state = VolumeState.RELEASED
    update: dict[str, object] = {
        "state": state,
        "attached_to": sorted(r.attached_to) if state is VolumeState.ATTACHED else [],
        "message": r.message if state is VolumeState.FAILED else "",
    }
    if r.backend in VOLUME_BACKENDS and not vol.backend:
        update["backend"] = r.backend
    return _changed(vol, update, now)


def node_lost(vol: Volume, now: float) -> Volume | None:
    """Its node is LOST: so is the data, unless the node comes back. A volume bound there but
    never provisioned holds nothing: it is unbound, to be placed again."""
    if vol.state is VolumeState.PENDING:
        return _changed(vol, {"node": "", "pool": "", "message": ""}, now)
    if vol.state in (VolumeState.LOST, VolumeState.DELETING):
        return None
    return _changed(
        vol,
        {
            "state": VolumeState.LOST,
            "attached_to": [],
            "message": f"node {vol.node} is lost: its local data is gone unless the node returns",
        },
        now,
    )


def not_listed(vol: Volume, now: float) -> Volume | None:
    """Its node registered without it: whatever was there is gone. A volume not made yet
    (PENDING), or whose provisioning failed, stays as it is."""
    if vol.state in (VolumeState.PENDING, VolumeState.FAILED, VolumeState.DELETING):
        return None
    message = f"node {vol.node} registered again without it: its data is gone"
    return _changed(vol, {"state": VolumeState.LOST, "attached_to": [], "message": message}, now)


def found(node: str, pool: str, r: VolumeReport, now: float) -> Volume | None:
    """A volume its node holds with no record: deleted while the node was lost, or a store
    restored from before it was made. Data is never deleted unasked, so it is recorded again
    as its node reports it, for users to see and to delete if they want it gone."""
    if r.state not in (VolumeState.AVAILABLE, VolumeState.ATTACHED, VolumeState.FAILED):
        return None
    try:
        spec = VolumeSpec(
            name=r.name,
            size_bytes=r.size_bytes,
            backend=r.backend if r.backend in VOLUME_BACKENDS else "",
        )
    except ValidationError:
        return None
    return Volume(
        spec=spec,
        state=r.state,
        node=node,
        pool=pool,
        backend=spec.backend,
        attached_to=sorted(r.attached_to) if r.state is VolumeState.ATTACHED else [],
        message=(
            f"found on node {node} with no record (deleted while the node was lost, or the"
            " store is older than the volume): kept; delete it to remove its data"
        ),
        created_at=now,
        updated_at=now,
    )


def released(vol: Volume, now: float) -> Volume | None:
    """A template volume whose workload was deleted: kept, for a workload of that name."""
    if vol.state is not VolumeState.AVAILABLE:
        return None
    return _changed(vol, {"state": VolumeState.RELEASED}, now)


def deleting(vol: Volume, now: float) -> Volume | None:
    """Asked to be deleted. None: remove the record at once (nothing of it on any node, or
    its node is lost)."""
    if vol.state is VolumeState.LOST or not vol.node:
        return None
    if vol.state is VolumeState.DELETING:
        return vol
    return vol.model_copy(update={"state": VolumeState.DELETING, "message": "", "updated_at": now})


def _changed(vol: Volume, update: dict[str, object], now: float) -> Volume | None:
    if all(getattr(vol, k) == v for k, v in update.items()):
        return None
    return vol.model_copy(update={**update, "updated_at": now})


# ---- who uses a volume ----


def names_of(w: Workload) -> set[str]:
    """The volumes a workload names in its spec (not its template's)."""
    return {m.volume for m in w.spec.volumes}


def users(repo: Repo, vol: Volume) -> list[str]:
    """Live instances bound to a node that use the volume (running there, or about to)."""
    out: list[str] = []
    for w in repo.workloads.values():
        template = vol.workload == w.name and w.spec.volume_template is not None
        if not template and vol.name not in names_of(w):
            continue
        for inst in repo.instances_of(w.name):
            if inst.terminal or inst.phase is InstancePhase.PENDING or not inst.node:
                continue
            if template and inst.ordinal != vol.ordinal:
                continue
            out.append(inst.name)
    return sorted(out)


def check_deletable(repo: Repo, vol: Volume) -> None:
    """Conflict (FAILED_PRECONDITION) while anything uses the volume: its data is in use."""
    if vol.state is VolumeState.ATTACHED:
        held = ", ".join(vol.attached_to[:5]) or "an instance"
        raise Conflict(
            f"volume {vol.name!r} is ATTACHED (used by {held}): stop or delete what uses it first"
        )
    using = users(repo, vol)
    if using:
        raise Conflict(
            f"volume {vol.name!r} is used by instance {', '.join(using[:5])}: stop or delete"
            " what uses it first"
        )


def delete_change(vol: Volume, now: float) -> Change:
    new = deleting(vol, now)
    return Change("volumes", vol.name, new)


def workload_removed(repo: Repo, w: Workload, now: float) -> list[Change]:
    """The workload's record is being removed (its instances are gone). With `delete_volumes`
    its template volumes and the volumes it names that no other workload names are deleted;
    without, nothing is deleted and its template volumes are RELEASED."""
    changes: list[Change] = []
    others: set[str] = set()
    if w.delete_volumes:
        for other in repo.workloads.values():
            if other.name != w.name:
                others |= names_of(other)
    named = names_of(w)
    for vol in repo.volumes.values():
        mine = vol.workload == w.name
        if w.delete_volumes and (mine or (vol.name in named and vol.name not in others)):
            if vol.state is not VolumeState.DELETING:
                changes.append(delete_change(vol, now))
        elif mine:
            new = released(vol, now)
            if new is not None:
                changes.append(Change("volumes", vol.name, new))
    return changes


# ---- immediate provisioning ----


def backends_for(vol: Volume, cls: Class | None) -> list[str]:
    """The backends the volume may be made with, in the order of preference."""
    if vol.backend:
        return [vol.backend]
    if vol.spec.backend:
        return [vol.spec.backend]
    if cls is not None and cls.volume is not None and cls.volume.backends:
        return list(cls.volume.backends)
    # No kind to go by (no instance uses it yet): a directory, what processes and
    # containers mount.
    return [backend_for(WorkloadKind.PROCESS)]


def used_bytes(volumes: Iterable[Volume], node: str, skip: str = "") -> int:
    return sum(
        v.spec.size_bytes
        for v in volumes
        if v.node == node and v.name != skip and v.state is not VolumeState.LOST
    )


def pick_node(
    vol: Volume, cls: Class | None, nodes: Iterable[Node], volumes: Sequence[Volume]
) -> tuple[Node, str] | str:
    """The READY, schedulable node of a suitable pool that offers a backend the volume may use
    and has the most volume capacity left, with that backend; or why there is none."""
    allowed = backends_for(vol, cls)
    best: tuple[int, str, Node, str] | None = None
    for node in nodes:
        if node.state is not NodeState.READY or not node.schedulable or node.draining:
            continue
        if node.leaving or (vol.spec.pool and node.pool != vol.spec.pool):
            continue
        backend = next((b for b in allowed if b in node.volume_backends), None)
        if backend is None:
            continue
        free = node.volume_capacity_bytes - used_bytes(volumes, node.name, skip=vol.name)
        if free < vol.spec.size_bytes:
            continue
        key = (-free, node.name)
        if best is None or key < (best[0], best[1]):
            best = (-free, node.name, node, backend)
    if best is None:
        pool = f" of pool {vol.spec.pool}" if vol.spec.pool else ""
        return (
            f"waiting for a node: no READY node{pool} offers {' or '.join(allowed)} with"
            f" {size_text(vol.spec.size_bytes)} free"
        )
    return best[2], best[3]


def attachment(vol: Volume) -> VolumeAttachment:
    return VolumeAttachment(
        name=vol.name,
        size_bytes=vol.spec.size_bytes,
        backend=vol.backend,
        node=vol.node,
        pool=vol.pool,
        env_name=vol.name,
    )


class VolumeKeeper:
    """Applies the feed's volume reports and node changes to Volume records, and drives the
    provision and delete commands (one pass per kick, at least every PASS_EVERY seconds)."""

    def __init__(self, repo: Repo, link: SchedulerLink) -> None:
        self.repo = repo
        self.link = link
        self._dirty = asyncio.Event()
        # (command, volume name) -> when (time.monotonic) it was last sent: a delete right
        # after a provision is not held back by the provision's resend timer.
        self._sent: dict[tuple[str, str], float] = {}
        self._unrecorded_seen: set[tuple[str, str]] = set()

    def kick(self) -> None:
        self._dirty.set()

    def _on_change(self, change: Change, old: object) -> None:
        if change.kind == "volumes":
            self._dirty.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.repo.listeners.append(self._on_change)
        try:
            while True:
                tick = loop.call_later(PASS_EVERY, self._dirty.set)
                try:
                    await self._dirty.wait()
                finally:
                    tick.cancel()
                self._dirty.clear()
                try:
                    await self.pass_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("volume pass failed")
                    await asyncio.sleep(0.5)
        finally:
            with contextlib.suppress(ValueError):
                self.repo.listeners.remove(self._on_change)

    # ---- what the scheduler tells us ----

    async def on_updates(self, updates: Sequence[ClusterUpdate]) -> None:
        lost: set[str] = set()
        reports: list[tuple[str, VolumeReport]] = []
        syncs: dict[str, list[VolumeReport]] = {}
        for u in updates:
            if isinstance(u, NodeSeen):
                if u.node.state is NodeState.LOST:
                    lost.add(u.node.name)
                else:
                    lost.discard(u.node.name)
            elif isinstance(u, VolumeReported):
                reports.append((u.node, u.report))
            elif isinstance(u, NodeSynced):
                lost.discard(u.node)
                syncs[u.node] = u.volumes
                reports += [(u.node, r) for r in u.volumes]
        if not (lost or reports or syncs):
            return

        def plan() -> list[Change]:
            now = time.time()
            changed: dict[str, Volume] = {}

            def current(name: str) -> Volume | None:
                return changed.get(name) or self.repo.volumes.get(name)

            for node, r in reports:
                vol = current(r.name)
                if vol is None and node in syncs:
                    pool = self.repo.nodes[node].pool if node in self.repo.nodes else ""
                    kept = found(node, pool, r, now)
                    if kept is not None:
                        changed[r.name] = kept
                    continue
                if vol is None or (vol.node and vol.node != node):
                    if node in syncs:
                        self._unrecorded(node, r.name, vol)
                    continue
                new = reported(vol, node, r, vol.workload in self.repo.workloads, now)
                if new is not None:
                    changed[vol.name] = new
            removed: list[str] = []
            # One walk over the volumes, not one per node (a controller connecting hears every
            # node's sync at once).
            on_synced: dict[str, list[Volume]] = {}
            for vol in self.repo.volumes.values():
                if vol.node in syncs:
                    on_synced.setdefault(vol.node, []).append(vol)
            for node, vols in on_synced.items():
                names = {r.name for r in syncs[node]}
                for vol in vols:
                    if vol.name in names:
                        continue
                    vol = current(vol.name) or vol
                    if vol.state is VolumeState.DELETING:
                        removed.append(vol.name)  # not there any more: deleted
                        continue
                    new = not_listed(vol, now)
                    if new is not None:
                        changed[vol.name] = new
            for vol in list(self.repo.volumes.values()) if lost else ():
                if vol.node in lost:
                    new = node_lost(current(vol.name) or vol, now)
                    if new is not None:
                        changed[vol.name] = new
            changes = [Change("volumes", n, v) for n, v in changed.items() if n not in removed]
            return changes + [Change("volumes", n, None) for n in removed]

        changes = await self.repo.mutate(plan)
        if changes or lost:
            self.kick()

    def _unrecorded(self, node: str, name: str, vol: Volume | None) -> None:
        """A node holds a volume whose name a volume on another node now has. Its data is
        never deleted unasked: it stays on the node, said once per node and name."""
        if (node, name) in self._unrecorded_seen:
            return
        self._unrecorded_seen.add((node, name))
        log.warning(
            "a node holds a volume whose name is now another node's; its data is left there",
            node=node,
            volume=name,
            recorded_on=vol.node if vol is not None else "",
        )

    # ---- the pass: deletes and immediate provisioning ----

    def _due(self, cmd: type[NodeCommand], name: str, now: float) -> bool:
        return now - self._sent.get((cmd.__name__, name), -1e9) >= RESEND_AFTER

    async def pass_once(self) -> None:
        mono = time.monotonic()
        to_send: list[NodeCommand] = []

        def plan() -> list[Change]:
            now = time.time()
            changes: list[Change] = []
            to_send.clear()
            vols = list(self.repo.volumes.values())
            for vol in vols:
                node = self.repo.nodes.get(vol.node) if vol.node else None
                gone = vol.node and (node is None or node.state is NodeState.LOST)
                if vol.state is VolumeState.DELETING:
                    if not vol.node or gone:
                        changes.append(Change("volumes", vol.name, None))
                    elif self._due(DeleteVolume, vol.name, mono):
                        to_send.append(DeleteVolume(node=vol.node, volume=vol.name))
                    continue
                if gone and node is not None:
                    new = node_lost(vol, now)
                    if new is not None:
                        changes.append(Change("volumes", vol.name, new))
                    continue
                if vol.workload and vol.workload not in self.repo.workloads:
                    new = released(vol, now)
                    if new is not None:
                        changes.append(Change("volumes", vol.name, new))
                    continue
                changes += self._provision(vol, vols, now, mono, to_send)
            return changes

        await self.repo.mutate(plan)
        if to_send:
            for cmd in to_send:
                name = cmd.volume if isinstance(cmd, DeleteVolume) else cmd.volume.name
                self._sent[(type(cmd).__name__, name)] = mono
            await self._command(to_send)
        for key in [k for k in self._sent if k[1] not in self.repo.volumes]:
            del self._sent[key]
        if len(self._unrecorded_seen) > MAX_UNRECORDED_SEEN:
            self._unrecorded_seen.clear()  # said again, at worst: bounded whatever nodes send

    def _provision(
        self,
        vol: Volume,
        vols: list[Volume],
        now: float,
        mono: float,
        to_send: list[NodeCommand],
    ) -> list[Change]:
        """A PENDING volume of a class with `immediate`: bound to a node now, and made there."""
        if vol.state is not VolumeState.PENDING or not vol.spec.class_name:
            return []
        cls = self.repo.classes.get(vol.spec.class_name)
        if cls is None or cls.volume is None or not cls.volume.immediate:
            return []
        if vol.node:
            if self._due(ProvisionVolume, vol.name, mono):
                to_send.append(ProvisionVolume(node=vol.node, volume=attachment(vol)))
            return []
        picked = pick_node(vol, cls, self.repo.nodes.values(), vols)
        if isinstance(picked, str):
            new = _changed(vol, {"message": picked}, now)
            return [Change("volumes", vol.name, new)] if new is not None else []
        node, backend = picked
        bound = vol.model_copy(
            update={
                "node": node.name,
                "pool": node.pool,
                "backend": backend,
                "message": "",
                "updated_at": now,
            }
        )
        vols[vols.index(vol)] = bound  # the next volume of this pass sees the space taken
        to_send.append(ProvisionVolume(node=node.name, volume=attachment(bound)))
        return [Change("volumes", vol.name, bound)]

    async def _command(self, cmds: list[NodeCommand]) -> None:
        try:
            results = await self.link.command(cmds)
        except OrkaError as err:
            log.warning("volume commands not delivered", count=len(cmds), error=err.message)
            return
        done: list[tuple[NodeCommand, str]] = []
        for cmd, result in zip(cmds, results, strict=True):
            if result.ok:
                done.append((cmd, ""))
            elif not result.unconfirmed:
                log.warning("volume command refused", node=cmd.node, error=result.error)
                done.append((cmd, result.error))
        if done:
            await self.repo.mutate(lambda: self._answered(done))

    def _answered(self, done: list[tuple[NodeCommand, str]]) -> list[Change]:
        """A delete acknowledged removes the record; a refused one stays DELETING (resent
        later: what held the volume lets go of it) with the node's reason. A refused
        provision is FAILED with it."""
        now = time.time()
        changes: list[Change] = []
        for cmd, error in done:
            if isinstance(cmd, DeleteVolume):
                vol = self.repo.volumes.get(cmd.volume)
                if vol is None or vol.node != cmd.node or vol.state is not VolumeState.DELETING:
                    continue
                if not error:
                    changes.append(Change("volumes", vol.name, None))
                else:
                    new = _changed(vol, {"message": f"node {cmd.node} refused: {error}"}, now)
                    if new is not None:
                        changes.append(Change("volumes", vol.name, new))
            elif isinstance(cmd, ProvisionVolume) and error:
                vol = self.repo.volumes.get(cmd.volume.name)
                if vol is None or vol.node != cmd.node or vol.state is not VolumeState.PENDING:
                    continue
                new = _changed(vol, {"state": VolumeState.FAILED, "message": error}, now)
                if new is not None:
                    changes.append(Change("volumes", vol.name, new))
        return changes
