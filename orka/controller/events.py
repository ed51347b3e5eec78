"""Fans stored changes out to `WatchEvents` subscribers, and keeps a bounded history of them
so that a watcher can resume from a revision (`since_revision`).

Every event is a store write and carries the revision of the commit that made it; a commit's
events share it and arrive together (listeners run synchronously for a whole commit). The
history holds the latest changes, oldest first; `floor` is the newest revision whose changes
may have been dropped from it, so a resume from R needs R >= floor. History entries keep the
stored model, not a built message: converting every change costs the controller more than
the rare resume does.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from orka.api import controller_pb2 as pb
from orka.controller.repo import Change
from orka.errors import Invalid, OutOfRange
from orka.models import Instance, Node, Workload, WorkloadSpec
from orka.rpc import convert

# A subscriber that falls this far behind is cut off rather than growing without bound. One
# burst of creates can queue tens of thousands of events at once (100 workloads of 100
# replicas: 10,100 ADDED events before any is sent), so the bound is well above that; at a
# few hundred bytes an event it is tens of MiB per subscriber at worst. It is half the
# history, so a watcher cut off here can resume from where it was cut.
MAX_BACKLOG = 50_000
# ... and one whose backlog passes this many bytes too: events of big workloads (a spec may
# be 1 MiB) would otherwise let one slow watcher grow the controller by that much per update.
MAX_BACKLOG_BYTES = 64 << 20
# The changes kept for resuming watchers, by count and by (estimated) bytes.
MAX_HISTORY = 2 * MAX_BACKLOG
MAX_HISTORY_BYTES = 2 * MAX_BACKLOG_BYTES
# What a history entry weighs in the byte bound besides a workload's spec: about an event's
# serialized size, which is what the entry turns into.
ENTRY_BYTES = 300


@dataclass(frozen=True, slots=True)
class Entry:
    revision: int
    type: int  # pb.Event.Type
    value: BaseModel
    weight: int
    # When the controller saw the change: a replayed event keeps the time it happened.
    time: float


def _workload_of(value: BaseModel) -> str | None:
    if isinstance(value, Workload):
        return value.name
    if isinstance(value, Instance):
        return value.workload
    return None


class Subscriber:
    def __init__(self, workload: str, revision: int = 0) -> None:
        self.workload = workload
        self.queue: asyncio.Queue[pb.Event | None] = asyncio.Queue()
        # The revision the subscriber has been sent everything up to: where it resumes from.
        self.sent = revision
        # Set when it is cut off at a change of this revision: the events of that revision
        # already queued are not sent either, so `sent` stays a whole revision.
        self.cut_at = 0
        # How far behind it was when it was cut off; 0 while it keeps up.
        self.cut_off = 0
        self.cut_off_bytes = 0
        # The serialized size of each queued event, oldest first, and their sum.
        self._sizes: collections.deque[int] = collections.deque()
        self.backlog_bytes = 0

    def put(self, event: pb.Event, size: int) -> None:
        self._sizes.append(size)
        self.backlog_bytes += size
        self.queue.put_nowait(event)

    def take(self, first: pb.Event, limit: int, max_bytes: int) -> tuple[list[pb.Event], bool]:
        """`first` (just taken off the queue) and what else is queued now, in order, up to
        `limit` events and `max_bytes` (at least one event); and whether the close marker
        came among them. The backlog shrinks by what is taken."""
        sizes = self._sizes
        if self.cut_at and first.revision >= self.cut_at:
            self._drop_rest()
            return [], True
        items = [first]
        total = sizes[0] if sizes else 0
        closed = False
        while len(items) < limit and not self.queue.empty():
            # The close marker is always last and has no size.
            if len(sizes) > len(items) and total + sizes[len(items)] > max_bytes:
                break
            more = self.queue.get_nowait()
            if more is None:
                closed = True
                break
            if self.cut_at and more.revision >= self.cut_at:
                self._drop_rest()
                closed = True
                break
            total += sizes[len(items)]
            items.append(more)
        for _ in range(min(len(items), len(sizes))):
            self.backlog_bytes -= sizes.popleft()
        self.sent = items[-1].revision or self.sent
        return items, closed

    def _drop_rest(self) -> None:
        """Discard what is queued after a cut (its revision's remaining events, the marker)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self._sizes.clear()
        self.backlog_bytes = 0

    def over_bound(self, size: int) -> bool:
        return self.queue.qsize() >= MAX_BACKLOG or self.backlog_bytes + size > MAX_BACKLOG_BYTES

    def wants(self, value: BaseModel) -> bool:
        return not self.workload or _workload_of(value) == self.workload


class EventHub:
    """`revision` is the repo's current revision (a callable, read when an event is made)."""

    def __init__(self, revision: Callable[[], int] = lambda: 0) -> None:
        self.subscribers: set[Subscriber] = set()
        self.revision = revision
        self.history: collections.deque[Entry] = collections.deque()
        self.history_bytes = 0
        self.floor = 0
        self._spec_sizes: dict[str, tuple[WorkloadSpec, int]] = {}

    def on_change(self, change: Change, old: BaseModel | None) -> None:
        value = change.value if change.value is not None else old
        if value is None:
            return
        if change.value is None:
            kind = pb.Event.DELETED
        elif old is None:
            kind = pb.Event.ADDED
        else:
            kind = pb.Event.MODIFIED
        revision = self.revision()
        now = time.time()
        self._remember(Entry(revision, kind, value, self._weight(value, kind), now))
        if not self.subscribers:
            return
        event = to_event(kind, value, revision, now)
        size = event.ByteSize()
        for sub in list(self.subscribers):
            if not sub.wants(value):
                continue
            if sub.over_bound(size):
                self.subscribers.discard(sub)
                sub.cut_off = sub.queue.qsize()
                sub.cut_off_bytes = sub.backlog_bytes
                sub.cut_at = revision
                sub.queue.put_nowait(None)
                continue
            sub.put(event, size)

    def _weight(self, value: BaseModel, kind: int) -> int:
        if not isinstance(value, Workload):
            return ENTRY_BYTES
        # The spec is most of a workload and may be up to 1 MiB; status writes keep the same
        # spec object, so its size is measured once per spec.
        name = value.name
        hit = self._spec_sizes.get(name)
        if hit is None or hit[0] is not value.spec:
            hit = (value.spec, len(value.spec.model_dump_json()))
            self._spec_sizes[name] = hit
        if kind == pb.Event.DELETED:
            del self._spec_sizes[name]
        return ENTRY_BYTES + hit[1]

    def _remember(self, entry: Entry) -> None:
        history = self.history
        history.append(entry)
        self.history_bytes += entry.weight
        while len(history) > MAX_HISTORY or self.history_bytes > MAX_HISTORY_BYTES:
            gone = history.popleft()
            self.history_bytes -= gone.weight
            self.floor = gone.revision

    def subscribe(self, workload: str, since: int) -> Subscriber:
        """A subscriber for changes after revision `since` (0: after now), with the retained
        ones already queued. Synchronous: no change can fall between the replay and the live
        events."""
        current = self.revision()
        if since < 0:
            raise Invalid(f"since_revision: must be >= 0, got {since}", field="since_revision")
        if since > current:
            raise Invalid(
                f"since_revision: {since} is ahead of the store's current revision {current}",
                field="since_revision",
            )
        if since and since < self.floor:
            raise OutOfRange(
                f"since_revision: {since} is older than the oldest change this controller still"
                f" holds (revision {self.floor}); list again and watch from the list's revision"
            )
        sub = Subscriber(workload, since or current)
        if since:
            for entry in self._after(since):
                if sub.wants(entry.value):
                    event = to_event(entry.type, entry.value, entry.revision, entry.time)
                    sub.put(event, event.ByteSize())
        self.subscribers.add(sub)
        return sub

    def _after(self, since: int) -> list[Entry]:
        history = self.history
        # Binary search: revisions only grow along the history.
        lo, hi = 0, len(history)
        while lo < hi:
            mid = (lo + hi) // 2
            if history[mid].revision <= since:
                lo = mid + 1
            else:
                hi = mid
        return [history[i] for i in range(lo, len(history))]

    def reset(self, revision: int) -> None:
        """The cache was reloaded at `revision`: changes before it are gone from the history
        (another writer's came without events), and every watcher must list again."""
        self.history.clear()
        self.history_bytes = 0
        self.floor = revision
        self.close()

    def close(self) -> None:
        for sub in self.subscribers:
            sub.queue.put_nowait(None)
        self.subscribers.clear()


def to_event(kind: int, value: BaseModel, revision: int = 0, at: float = 0.0) -> pb.Event:
    """The event of a change; `at`, when the controller saw it (0: now)."""
    at_fields = convert.timestamp_fields(at or time.time())
    if isinstance(value, Instance):
        # The hot case (every placement writes an instance two or three times): the instance
        # is built inside the event rather than built alone and copied in.
        fields = convert.instance_fields(value)
        if kind != pb.Event.DELETED:
            fields["revision"] = revision
        return pb.Event(type=kind, event_time=at_fields, revision=revision, instance=fields)  # type: ignore[arg-type]
    event = pb.Event(
        type=kind,  # type: ignore[arg-type]
        event_time=at_fields,
        revision=revision,
    )
    if isinstance(value, Workload):
        event.workload.CopyFrom(convert.workload_to_pb(value))
    elif isinstance(value, Node):
        event.node.CopyFrom(convert.node_to_pb(value))
    # An added or modified object was written by the change itself.
    if kind != pb.Event.DELETED:
        getattr(event, event.WhichOneof("object")).revision = revision
    return event
