"""Fans stored changes out to `WatchEvents` subscribers."""

from __future__ import annotations

import asyncio
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


class Subscriber:
    def __init__(self, workload: str) -> None:
        self.workload = workload
        self.queue: asyncio.Queue[pb.Event | None] = asyncio.Queue()
        # How far behind it was when it was cut off; 0 while it keeps up.
        self.cut_off = 0

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
        for sub in list(self.subscribers):
            if not sub.wants(value):
                continue
            if sub.queue.qsize() >= MAX_BACKLOG:
                self.subscribers.discard(sub)
                sub.cut_off = sub.queue.qsize()
                sub.queue.put_nowait(None)
                continue
            sub.queue.put_nowait(event)

    def close(self) -> None:
        for sub in self.subscribers:
            sub.queue.put_nowait(None)
        self.subscribers.clear()


def to_event(kind: int, value: BaseModel) -> pb.Event:
    event = pb.Event(type=kind, time=time.time())  # type: ignore[arg-type]
    if isinstance(value, Workload):
        event.workload.CopyFrom(convert.workload_to_pb(value))
    elif isinstance(value, Instance):
        event.instance.CopyFrom(convert.instance_to_pb(value))
    elif isinstance(value, Node):
        event.node.CopyFrom(convert.node_to_pb(value))
    return event
