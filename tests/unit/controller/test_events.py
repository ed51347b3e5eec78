"""A subscriber's backlog: bounded in events and in bytes, batches bounded in bytes."""

from __future__ import annotations

import pytest

from orka.api import controller_pb2 as pb
from orka.controller import events
from orka.controller.events import EventHub, Subscriber
from orka.controller.repo import Change
from orka.errors import Invalid, OutOfRange
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


def hub_at(revision: list[int]) -> EventHub:
    return EventHub(lambda: revision[0])


def test_a_subscriber_resumes_after_its_revision_from_the_history() -> None:
    rev = [0]
    hub = hub_at(rev)
    for r, gen in ((1, 1), (2, 2), (2, 3), (3, 4)):
        rev[0] = r
        hub.on_change(Change("workloads", "big", workload(gen, 1)), None)
    sub = hub.subscribe("", 1)
    queued = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert [(e.revision, e.workload.revision) for e in queued if e] == [(2, 2), (2, 2), (3, 3)]
    assert [hub.subscribe("", r).queue.qsize() for r in (3, 2, 0)] == [0, 1, 0]
    with pytest.raises(Invalid, match=r"^since_revision: 4 is ahead"):
        hub.subscribe("", 4)
    with pytest.raises(Invalid, match=r"^since_revision: must be >= 0"):
        hub.subscribe("", -1)


def test_the_history_is_bounded_and_older_revisions_are_out_of_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(events, "MAX_HISTORY", 3)
    rev = [0]
    hub = hub_at(rev)
    for r in range(1, 6):
        rev[0] = r
        hub.on_change(Change("workloads", "big", workload(r, 1)), None)
    assert [e.revision for e in hub.history] == [3, 4, 5] and hub.floor == 2
    assert hub.subscribe("", 2).queue.qsize() == 3
    with pytest.raises(OutOfRange, match="list again"):
        hub.subscribe("", 1)
    # A reload forgets the history: nothing before it can be resumed.
    hub.reset(5)
    assert not hub.history and hub.floor == 5 and not hub.subscribers
    with pytest.raises(OutOfRange):
        hub.subscribe("", 4)


def test_a_cut_off_subscriber_gets_whole_revisions_only() -> None:
    rev = [0]
    hub = hub_at(rev)
    sub = hub.subscribe("", 0)
    rev[0] = 1
    hub.on_change(Change("workloads", "big", workload(1, 1)), None)
    rev[0] = 2
    for gen in range(2, 4):
        hub.on_change(Change("workloads", "big", workload(gen, 1)), None)
    # Cut at the third event of revision 2: the two of revision 2 queued are withheld too.
    sub.cut_at, sub.cut_off = 2, 3
    sub.queue.put_nowait(None)
    first = sub.queue.get_nowait()
    assert first is not None
    taken, closed = sub.take(first, limit=10, max_bytes=1 << 20)
    assert [e.revision for e in taken] == [1] and closed and sub.sent == 1
    assert sub.queue.empty() and sub.backlog_bytes == 0
