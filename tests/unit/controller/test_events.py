"""A subscriber's backlog: bounded in events and in bytes, batches bounded in bytes."""

from __future__ import annotations

import pytest

from orka.api import controller_pb2 as pb
from orka.controller import events
from orka.controller.events import EventHub, Subscriber
from orka.controller.repo import Change
from orka.models import Workload, WorkloadSpec


def workload(i: int, size: int) -> Workload:
    spec = WorkloadSpec(name="big", kind="PROCESS", command=["x"], env={"V": f"{i}" * size})
    return Workload(spec=spec)


def test_backlog_bytes_follow_what_is_queued_and_taken() -> None:
    sub = Subscriber("")
    for i in range(5):
        sub.put(pb.Event(type=pb.Event.ADDED), 100 + i)
    assert sub.backlog_bytes == 510
    first = sub.queue.get_nowait()
    assert first is not None
    # Batches stop before passing the byte bound (the first event always goes).
    taken, closed = sub.take(first, limit=10, max_bytes=250)
    assert (len(taken), closed, sub.backlog_bytes) == (2, False, 309)
    first = sub.queue.get_nowait()
    assert first is not None
    taken, closed = sub.take(first, limit=10, max_bytes=10)
    assert (len(taken), closed, sub.backlog_bytes) == (1, False, 207)
    sub.queue.put_nowait(None)
    first = sub.queue.get_nowait()
    assert first is not None
    taken, closed = sub.take(first, limit=10, max_bytes=1 << 20)
    assert (len(taken), closed, sub.backlog_bytes) == (2, True, 0)


def test_a_subscriber_past_the_byte_bound_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_BACKLOG_BYTES", 50_000)
    hub = EventHub()
    sub = Subscriber("")
    hub.subscribers.add(sub)
    old = None
    for i in range(10):
        w = workload(i % 10, 10_000)
        hub.on_change(Change("workloads", "big", w), old)
        old = w
    assert sub not in hub.subscribers
    assert sub.cut_off == 4 and 40_000 < sub.cut_off_bytes <= 50_000
    assert sub.queue.qsize() == 5  # four events and the close marker
