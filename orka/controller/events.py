"""Fans stored changes out to `WatchEvents` subscribers."""

from __future__ import annotations

import asyncio
import collections
import time

from pydantic import BaseModel

from orka.api import controller_pb2 as pb
from orka.controller.repo import Change
from orka.models import Instance, Node, Workload
from orka.rpc import convert

# A subscriber that falls this far behind is cut off rather than growing without bound. One
# burst of creates can queue tens of thousands of events at once (100 workloads of 100
# replicas: 10,100 ADDED events before any is sent), so the bound is well above that; at a
# few hundred bytes an event it is tens of MiB per subscriber at worst.
MAX_BACKLOG = 100_000
# ... and one whose backlog passes this many bytes too: events of big workloads (a spec may
# be 1 MiB) would otherwise let one slow watcher grow the controller by that much per update.
MAX_BACKLOG_BYTES = 64 << 20


class Subscriber:
    def __init__(self, workload: str) -> None:
        self.workload = workload
        self.queue: asyncio.Queue[pb.Event | None] = asyncio.Queue()
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
            total += sizes[len(items)]
            items.append(more)
        for _ in range(min(len(items), len(sizes))):
            self.backlog_bytes -= sizes.popleft()
        return items, closed

    def over_bound(self, size: int) -> bool:
        return self.queue.qsize() >= MAX_BACKLOG or self.backlog_bytes + size > MAX_BACKLOG_BYTES

    def wants(self, value: BaseModel) -> bool:
        if not self.workload:
            return True
        if isinstance(value, Workload):
            return value.name == self.workload
        if isinstance(value, Instance):
            return value.workload == self.workload
        return False


class EventHub:
    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()

    def on_change(self, change: Change, old: BaseModel | None) -> None:
        if not self.subscribers:
            return
        value = change.value if change.value is not None else old
        if value is None:
            return
        if change.value is None:
            kind = pb.Event.DELETED
        elif old is None:
            kind = pb.Event.ADDED
        else:
            kind = pb.Event.MODIFIED
        event = to_event(kind, value)
        size = event.ByteSize()
        for sub in list(self.subscribers):
            if not sub.wants(value):
                continue
            if sub.over_bound(size):
                self.subscribers.discard(sub)
                sub.cut_off = sub.queue.qsize()
                sub.cut_off_bytes = sub.backlog_bytes
                sub.queue.put_nowait(None)
                continue
            sub.put(event, size)

    def close(self) -> None:
        for sub in self.subscribers:
            sub.queue.put_nowait(None)
        self.subscribers.clear()


def to_event(kind: int, value: BaseModel) -> pb.Event:
    event = pb.Event(type=kind, event_time=convert.timestamp_fields(time.time()))  # type: ignore[arg-type]
    if isinstance(value, Workload):
        event.workload.CopyFrom(convert.workload_to_pb(value))
    elif isinstance(value, Instance):
        event.instance.CopyFrom(convert.instance_to_pb(value))
    elif isinstance(value, Node):
        event.node.CopyFrom(convert.node_to_pb(value))
    return event
