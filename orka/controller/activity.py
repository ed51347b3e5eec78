"""Recent activity of each object: what `orka describe` shows at its end (Kubernetes' Events).

One `ActivityLog` per controller, written on the leader only and kept in memory: a new leader
(a failover, a restart) starts with an empty log. It is a window on what happened lately, not
a history: per object it keeps the `per_object` latest entries, and it keeps the objects it
wrote to most recently, `max_objects` of them (least recently written dropped first), so
100,000 instances cannot grow it past `per_object * max_objects` entries.

Repeats are folded like Kubernetes' event aggregation: an entry with the same type, reason and
message as one the object already holds bumps that entry's `count` and `last_time` (and moves
it to the newest place) instead of adding one; so a retried placement or a crash loop is one
entry with a count, not a flood.

Recording, for any part of the controller that holds the log (`Controller.activity`, also
`Reconciler.activity`, `PlacementQueue.activity` and `ControllerApi.activity`):

    activity.record("workload", "web", NORMAL, "RolloutStep", "replaced web-3 with web-7")
    activity.record("workload", "web", WARNING, "RolloutFailed", "web-7 exited with code 1")

`kind` is "workload", "instance" or "node"; `type` NORMAL or WARNING; `reason` a short
CamelCase code that stays the same for the same kind of happening (a script may match on it);
`message` the words for people. Recording costs a dict look-up and an append: fine on hot
paths, but record decisions and changes, not every report.

What is recorded by itself (`on_change`, a listener on the repo's writes, plus the placement
queue): placements (the chosen node, the nodes passed over and why, offers refused), failed
placements (aggregated), starts, restarts with exit codes, exits, losses, stops, health
changes, node state changes (READY, NOT_READY, LOST, LEFT), cordon, uncordon and drain,
workload creation, updates and deletion.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from orka import fit
from orka.models import (
    HealthState,
    Instance,
    InstancePhase,
    InstanceReason,
    Node,
    NodeState,
    RolloutState,
    Workload,
)

NORMAL = "Normal"
WARNING = "Warning"
Type = Literal["Normal", "Warning"]
KINDS = ("workload", "instance", "node")

PER_OBJECT = 20
MAX_OBJECTS = 10_000
# One entry's message at most: entries repeat messages from reports and the scheduler.
MAX_MESSAGE = 1024


@dataclass(slots=True)
class Activity:
    """One entry: `count` times between `first_time` and `last_time` (Unix seconds)."""

    type: str
    reason: str
    message: str
    count: int
    first_time: float
    last_time: float
    # Grows with every record() of the whole log: orders entries and pages (newest first).
    seq: int = 0


class ActivityLog:
    def __init__(
        self,
        per_object: int = PER_OBJECT,
        max_objects: int = MAX_OBJECTS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.per_object = per_object
        self.max_objects = max_objects
        self.clock = clock
        # (kind, name) -> entries oldest first; the dict is in least recently written order.
        self._objects: OrderedDict[tuple[str, str], list[Activity]] = OrderedDict()
        self._seq = 0

    def __len__(self) -> int:
        """Entries held, over all objects."""
        return sum(len(v) for v in self._objects.values())

    @property
    def objects(self) -> int:
        return len(self._objects)

    def record(self, kind: str, name: str, type: str, reason: str, message: str) -> None:
        """Add an entry to object `kind`/`name`, or count a repeat of one it holds."""
        key = (kind, name)
        now = self.clock()
        self._seq += 1
        message = message[:MAX_MESSAGE]
        entries = self._objects.get(key)
        if entries is None:
            entries = self._objects[key] = []
            if len(self._objects) > self.max_objects:
                self._objects.popitem(last=False)
        else:
            self._objects.move_to_end(key)
            for i, e in enumerate(entries):
                if e.reason == reason and e.message == message and e.type == type:
                    del entries[i]
                    e.count += 1
                    e.last_time = now
                    e.seq = self._seq
                    entries.append(e)
                    return
        entries.append(Activity(type, reason, message, 1, now, now, self._seq))
        if len(entries) > self.per_object:
            del entries[0]

    def entries(self, kind: str, name: str) -> list[Activity]:
        """The object's entries, newest first (empty for an object with none)."""
        return list(reversed(self._objects.get((kind, name), ())))

    def forget(self, kind: str, name: str) -> None:
        self._objects.pop((kind, name), None)

    def clear(self) -> None:
        self._objects.clear()

    # ---- what the repo's writes say by themselves ----

    def on_change(self, change: object, old: BaseModel | None) -> None:
        """Repo listener (orka/controller/repo.py): record what a write changed."""
        value = getattr(change, "value", None)
        if isinstance(value, Instance) or (value is None and isinstance(old, Instance)):
            self._instance(value, old if isinstance(old, Instance) else None)
        elif isinstance(value, Node):
            self._node(value, old if isinstance(old, Node) else None)
        elif isinstance(value, Workload) or (value is None and isinstance(old, Workload)):
            self._workload(value, old if isinstance(old, Workload) else None)
        elif value is None and isinstance(old, Node):
            self.forget("node", old.name)

    def _instance(self, new: Instance | None, old: Instance | None) -> None:
        if new is None:
            if old is not None:
                self.forget("instance", old.name)
            return
        if old is None:
            return  # created PENDING: its placement says more
        name = new.name
        if new.restarts > old.restarts:
            # No message detail: it would differ per restart and defeat the aggregation.
            text = _exit_text(new.model_copy(update={"message": ""}), "restarted")
            self.record("instance", name, WARNING, "Restarted", text)
        if new.phase is not old.phase:
            self._phase(new, old)
        elif (
            new.phase is InstancePhase.PENDING
            and new.reason == InstanceReason.START_REFUSED
            and new.message != old.message
        ):
            self.record("instance", name, WARNING, "StartRefused", new.message)
        if new.health is not old.health:
            if new.health is HealthState.UNHEALTHY:
                text = new.health_message or "health check failing"
                self.record("instance", name, WARNING, "Unhealthy", text)
            elif new.health is HealthState.HEALTHY and old.health is HealthState.UNHEALTHY:
                self.record("instance", name, NORMAL, "Healthy", "health check passing again")

    def _phase(self, new: Instance, old: Instance) -> None:
        name, phase = new.name, new.phase
        if phase is InstancePhase.SCHEDULED:
            return  # the placement queue records it, with the reasons
        if phase is InstancePhase.PENDING and new.reason == InstanceReason.START_REFUSED:
            self.record("instance", name, WARNING, "StartRefused", new.message)
        elif phase is InstancePhase.RUNNING:
            self.record("instance", name, NORMAL, "Started", f"running on node {new.node}")
        elif phase is InstancePhase.SUCCEEDED:
            self.record("instance", name, NORMAL, "Succeeded", _exit_text(new, "finished"))
        elif phase is InstancePhase.FAILED:
            self.record("instance", name, WARNING, "Failed", _exit_text(new, "failed"))
        elif phase is InstancePhase.LOST:
            reason = new.reason or "Lost"
            self.record("instance", name, WARNING, reason, new.message or "lost")
        elif phase is InstancePhase.DISCONNECTED:
            self.record("instance", name, WARNING, new.reason, new.message)
        elif phase is InstancePhase.STOPPING:
            self.record("instance", name, NORMAL, "Stopping", new.message or "stopping")
        elif phase is InstancePhase.STOPPED:
            self.record("instance", name, NORMAL, "Stopped", new.message or "stopped")

    def _node(self, new: Node, old: Node | None) -> None:
        name = new.name
        if old is None:
            self.record("node", name, NORMAL, "Registered", f"joined in state {new.state.value}")
            return
        if new.state is not old.state:
            type_ = NORMAL if new.state in (NodeState.READY, NodeState.LEFT) else WARNING
            reason = _NODE_REASONS.get(new.state, "NodeStateChanged")
            text = f"{old.state.value} -> {new.state.value}"
            if new.message:
                text += f": {new.message}"
            self.record("node", name, type_, reason, text)
        if new.draining and not old.draining:
            self.record("node", name, NORMAL, "Draining", "draining: instances move elsewhere")
        elif not new.schedulable and old.schedulable and not new.draining:
            self.record("node", name, NORMAL, "Cordoned", "no new placements")
        elif new.schedulable and not old.schedulable:
            self.record("node", name, NORMAL, "Uncordoned", "placements allowed again")

    def _workload(self, new: Workload | None, old: Workload | None) -> None:
        if new is None:
            if old is not None:
                self.forget("workload", old.name)
            return
        if old is None:
            who = f" by {new.created_by}" if new.created_by else ""
            self.record("workload", new.name, NORMAL, "Created", f"generation 1{who}")
        elif new.generation > old.generation:
            who = f" by {new.updated_by}" if new.updated_by else ""
            text = f"generation {old.generation} -> {new.generation}{who}"
            self.record("workload", new.name, NORMAL, "Updated", text)
        if new.deleting and not (old is not None and old.deleting):
            self.record("workload", new.name, NORMAL, "Deleting", "stopping its instances")
        if old is not None:
            self._rollout(new, old)

    def _rollout(self, new: Workload, old: Workload) -> None:
        """A rollout step: its state changed, or it began another revision (one place in
        rollout.py makes each transition; this sees its result as the reconciler writes it)."""
        r, was = new.rollout, old.rollout
        if (r.state, r.revision) == (was.state, was.revision):
            return
        if r.revision != was.revision and r.rollback_of:
            # An automatic rollback: its revision's cause names what failed.
            cause = next((v.cause for v in new.revisions if v.revision == r.revision), "")
            text = f"revision {r.rollback_of} failed; revision {r.revision} rolls back"
            self.record("workload", new.name, WARNING, "RollingBack", _then(text, cause))
            return
        reason, type_ = _ROLLOUT_REASONS[r.state]
        text = _then(f"revision {r.revision}: {r.state.value.lower().replace('_', ' ')}", r.message)
        self.record("workload", new.name, type_, reason, text)


_NODE_REASONS = {
    NodeState.READY: "NodeReady",
    NodeState.NOT_READY: "NodeNotReady",
    NodeState.LOST: "NodeLost",
    NodeState.LEFT: "NodeLeft",
}


def _then(text: str, more: str) -> str:
    return f"{text}: {more}" if more else text


_ROLLOUT_REASONS: dict[RolloutState, tuple[str, Type]] = {
    RolloutState.PROGRESSING: ("RolloutProgressing", NORMAL),
    RolloutState.PAUSED: ("RolloutPaused", NORMAL),
    RolloutState.AWAITING_PROMOTION: ("RolloutAwaitingPromotion", NORMAL),
    RolloutState.COMPLETE: ("RolloutComplete", NORMAL),
    RolloutState.FAILED: ("RolloutFailed", WARNING),
    RolloutState.ROLLED_BACK: ("RolledBack", WARNING),
}


def _exit_text(inst: Instance, what: str) -> str:
    code = "" if inst.exit_code is None else f"exited with code {inst.exit_code}; "
    detail = f" ({inst.message})" if inst.message else ""
    return f"{code}{what}{detail}"


def placed_text(node: str, passed_over: Sequence[fit.ReasonCount], refusals: dict[str, str]) -> str:
    """'placed on node-2; 3 nodes passed over: 2 nodes: insufficient memory; 1 node: cordoned'
    (and the nodes that refused the offer before it, with their reasons)."""
    text = f"placed on {node}"
    total = sum(c.node_count for c in passed_over)
    if total:
        nodes = "node" if total == 1 else "nodes"
        text += f"; {total} {nodes} passed over: {fit.format_reasons(passed_over)}"
    if refusals:
        refused = ", ".join(f"{n}: {why}" for n, why in sorted(refusals.items()))
        text += f"; refused the offer: {refused}"
    return text
