"""Liveness on a real event loop: the scheduler's own stalls are not the nodes' silence."""

from __future__ import annotations

import asyncio
import time

import pytest

from orka.models import NodeState
from orka.scheduler.feed import Feed
from orka.scheduler.liveness import LAG_FLOOR_DRIFT, MAX_GRACE, Liveness, lateness
from orka.scheduler.registry import NodeRecord, Registry


class Stream:
    closed = False

    def close(self) -> None:
        self.closed = True


INTERVAL, LOST_AFTER = 0.4, 1.2


def stall(seconds: float) -> None:
    """Blocks the event loop, as a scheduler busy with other work does."""
    time.sleep(seconds)


def cluster() -> tuple[Registry, Liveness]:
    reg = Registry()
    liveness = Liveness(reg, Feed(reg, INTERVAL), INTERVAL, LOST_AFTER, clock=time.monotonic)
    return reg, liveness


async def test_a_stalled_scheduler_does_not_declare_its_nodes_silent() -> None:
    reg, liveness = cluster()
    connected, gone = reg.upsert("connected"), reg.upsert("gone")
    connected.session = Stream()  # type: ignore[assignment]
    gone.session = None  # its stream ended: nothing of it can be waiting unread
    states: dict[str, set[NodeState]] = {"connected": set(), "gone": set()}
    original = liveness.set_state
    lost = asyncio.Event()

    def record(node, state, message=""):  # type: ignore[no-untyped-def]
        states[node.name].add(state)
        original(node, state, message)
        if node is connected and state is NodeState.LOST:
            lost.set()

    liveness.set_state = record  # type: ignore[method-assign]
    clock = asyncio.create_task(liveness.run())
    try:
        await asyncio.sleep(0.1)
        connected.last_seen = gone.last_seen = time.monotonic()
        # The event loop is blocked for longer than node_lost_after: what the connected node
        # sent meanwhile would still be unread in the scheduler's buffers.
        stall(LOST_AFTER * 2)
        await asyncio.sleep(0.15)  # a few passes once the loop runs again
        assert states["connected"] == set() and connected.state is NodeState.READY
        assert connected.session.closed is False  # type: ignore[union-attr]
        assert gone.state is NodeState.LOST  # no stream: its silence is its own
        # Truly silent from here on: still declared, NOT_READY first, then LOST.
        async with asyncio.timeout(20 * LOST_AFTER):
            await lost.wait()
        assert states["connected"] == {NodeState.NOT_READY, NodeState.LOST}
        assert connected.session.closed is True  # type: ignore[union-attr]
    finally:
        clock.cancel()


async def test_a_scheduler_reading_old_heartbeats_stops_counting_silence_until_caught_up() -> None:
    reg, liveness = cluster()
    read, waiting = reg.upsert("read"), reg.upsert("waiting")
    read.session = waiting.session = Stream()  # type: ignore[assignment]
    changes: list[tuple[str, NodeState]] = []
    original = liveness.set_state

    def record(node, state, message=""):  # type: ignore[no-untyped-def]
        changes.append((node.name, state))
        original(node, state, message)

    liveness.set_state = record  # type: ignore[method-assign]
    clock = asyncio.create_task(liveness.run())
    try:
        read.last_seen = waiting.last_seen = time.monotonic()
        # For three node_lost_after, most heartbeats read come five intervals late, one
        # stream's on time (a busy scheduler does not serve its streams alike): `waiting`'s
        # are in the backlog behind them, not missing.
        end = time.monotonic() + 3 * LOST_AFTER
        while time.monotonic() < end:
            liveness.heard(5 * INTERVAL)
            liveness.heard(0.0)
            liveness.heard(5 * INTERVAL)
            read.last_seen = time.monotonic()
            await asyncio.sleep(0.02)
        # Then nothing read at all for longer than NOT_READY takes (the loop runs): no news
        # is not catching up.
        await asyncio.sleep(4 * INTERVAL)
        assert changes == []
        # Caught up (fresh heartbeats from `read`), and still nothing from `waiting`. (A
        # generous bound: on a loaded host the late passes are excused too.)
        end = time.monotonic() + 20 * LOST_AFTER
        while time.monotonic() < end and waiting.state is not NodeState.LOST:
            liveness.heard(0.01)
            read.last_seen = time.monotonic()
            await asyncio.sleep(0.02)
        assert changes == [("waiting", NodeState.NOT_READY), ("waiting", NodeState.LOST)]
        assert read.state is NodeState.READY
    finally:
        clock.cancel()


def test_lateness_is_measured_on_the_nodes_own_clock() -> None:
    node = Registry().upsert("n1")
    # The node's clock is 10 s behind ours: its heartbeats look 10 s old, and are on time.
    # The first one only sets where it starts from.
    assert [lateness(node, 10.0 + net) for net in (0.003, 0.001, 0.002)] == [None, 0.0, 0.0]
    # Read about 3 s later than its usual: measured from its floor (10.002 s by now), which
    # rises by one drift per beat.
    assert lateness(node, 13.001) == pytest.approx(13.001 - 10.002 - LAG_FLOOR_DRIFT)
    # Its clock stepped back 5 s more: no longer late after enough beats, never negative.
    seen = [lateness(node, 15.0) for _ in range(600)]
    assert seen[0] == pytest.approx(15.0 - 10.002 - 2 * LAG_FLOOR_DRIFT)
    assert seen[-1] == 0.0 and min(seen) >= 0.0


def one_node(began: float | None, last_seen: float) -> tuple[Liveness, NodeRecord]:
    """A liveness clock (its term begun at `began`, unless None) over one connected node."""
    reg = Registry()
    liveness = Liveness(reg, Feed(reg, INTERVAL), INTERVAL, LOST_AFTER, clock=time.monotonic)
    if began is not None:
        liveness.begin(began)
    node = reg.upsert("node")
    node.session = Stream()  # type: ignore[assignment]
    node.last_seen = last_seen
    return liveness, node


def test_a_term_judges_no_silence_until_two_intervals_after_the_last_registration() -> None:
    # Registrations arriving at a new term: each pushes the first judgement to two intervals
    # after it, so the nodes registered first are not judged while the rest still arrive.
    liveness, first = one_node(100.0, 100.0)
    liveness.registered(100.0)
    for at in (100.5, 101.0, 101.5):  # others register; `first` is never heard again
        liveness.registered(at)
    liveness.check(101.5 + 2 * INTERVAL - 0.01)  # 2.29 s of silence, past LOST_AFTER
    assert first.state is NodeState.READY and not first.session.closed  # type: ignore[union-attr]
    liveness.check(101.5 + 2 * INTERVAL)
    assert first.state is NodeState.LOST and first.session.closed  # type: ignore[union-attr]


def test_the_grace_ends_max_grace_after_the_term_began() -> None:
    # An agent that registers again and again (flapping, or a node key's holder) cannot keep
    # the scheduler from judging silence past MAX_GRACE.
    liveness, quiet = one_node(0.0, MAX_GRACE - 1.0)
    at = 0.0
    while at < MAX_GRACE + 10:
        liveness.registered(at)
        at += INTERVAL
    assert liveness.grace_until == MAX_GRACE
    liveness.check(MAX_GRACE - 0.01)
    assert quiet.state is NodeState.READY
    liveness.check(MAX_GRACE)  # 1 s silent: more than two intervals
    assert quiet.state is NodeState.NOT_READY


def test_without_a_term_begun_registrations_grant_no_grace() -> None:
    liveness, node = one_node(None, 0.0)
    liveness.registered(0.0)
    liveness.check(2 * INTERVAL + 0.01)
    assert node.state is NodeState.NOT_READY
