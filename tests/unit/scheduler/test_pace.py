"""Heartbeat pacing: the interval a cluster's size calls for, when it moves, who is told, and
from when a node is judged by what it was told."""

from __future__ import annotations

import time

import pytest

from orka.api import agent_pb2 as apb
from orka.models import NodeState
from orka.scheduler import pace
from orka.scheduler.feed import Feed
from orka.scheduler.liveness import Liveness
from orka.scheduler.pace import HeartbeatPace
from orka.scheduler.registry import Registry


class Session:
    def __init__(self) -> None:
        self.sent: list[apb.SchedulerMessage] = []
        self.closed = False

    def send(self, msg: apb.SchedulerMessage) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("nodes", "rate", "want"),
    [(0, 1000, 1.0), (1000, 1000, 1.0), (1500, 1000, 1.5), (5000, 1000, 5.0), (5000, 0, 1.0)],
)
def test_target(nodes: int, rate: float, want: float) -> None:
    assert HeartbeatPace(1.0, rate).target(nodes) == want


def test_the_interval_moves_by_half_again_or_more_only() -> None:
    p = HeartbeatPace(1.0, 1000)
    steps = []
    for nodes in (500, 1000, 1400, 1499, 1500, 2000, 2249, 2250, 1500, 1000, 0):
        moved = p.retarget(nodes)
        steps.append((nodes, moved, p.interval))
    assert steps == [
        (500, False, 1.0),
        (1000, False, 1.0),
        (1400, False, 1.0),
        (1499, False, 1.0),
        (1500, True, 1.5),
        (2000, False, 1.5),
        (2249, False, 1.5),
        (2250, True, 2.25),
        (1500, True, 1.5),  # 1.5 <= 2.25 / 1.5
        (1000, True, 1.0),
        (0, False, 1.0),
    ]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="interval must be > 0"):
        HeartbeatPace(0, 10)
    with pytest.raises(ValueError, match="must not be negative"):
        HeartbeatPace(1.0, -1)


def test_tell_sends_to_connected_nodes_whose_interval_differs() -> None:
    reg = Registry()
    slow, fast, gone = reg.upsert("slow"), reg.upsert("fast"), reg.upsert("gone")
    slow.session, fast.session = Session(), Session()  # type: ignore[assignment]
    slow.interval, fast.interval, gone.interval = 5.0, 1.0, 1.0
    p = HeartbeatPace(1.0, 1000)
    p.interval = 2.0
    assert p.tell(reg) == 2
    for node in (slow, fast):
        [msg] = node.session.sent  # type: ignore[union-attr]
        assert msg.pace.heartbeat_interval.ToNanoseconds() == 2_000_000_000
    # Longer: counts at once. Shorter: from the node's next heartbeat.
    assert (fast.interval, fast.next_interval) == (2.0, 0.0)
    assert (slow.interval, slow.next_interval) == (5.0, 2.0)
    pace.heard(slow)
    assert (slow.interval, slow.next_interval) == (2.0, 0.0)
    assert gone.interval == 1.0  # no stream: told when it registers
    assert p.tell(reg) == 0  # everyone connected is on 2 s now


def test_liveness_judges_each_node_by_its_own_interval() -> None:
    reg = Registry()
    liveness = Liveness(reg, Feed(reg, 1.0), 1.0, 5.0, clock=time.monotonic)
    paced, plain = reg.upsert("paced"), reg.upsert("plain")
    paced.interval = 4.0  # silent for 8 s is NOT_READY, for 20 s LOST
    now = 1000.0
    paced.last_seen = plain.last_seen = now - 7.9
    liveness.check(now)
    assert (paced.state, plain.state) == (NodeState.READY, NodeState.LOST)
    liveness.check(now + 0.2)
    assert paced.state is NodeState.NOT_READY
    liveness.check(now + 12.0)
    assert paced.state is NodeState.NOT_READY
    liveness.check(now + 12.2)
    assert paced.state is NodeState.LOST
    assert paced.message == "no heartbeat for 20.1s"


def test_each_pass_follows_the_connected_count_and_tells_the_nodes() -> None:
    reg = Registry()
    liveness = Liveness(
        reg, Feed(reg, 1.0), 1.0, 5.0, clock=time.monotonic, pace=HeartbeatPace(1.0, 2.0)
    )
    now = time.monotonic()
    nodes = [reg.upsert(f"n{i}") for i in range(4)]
    for node in nodes[:3]:
        node.session = Session()  # type: ignore[assignment]
        node.last_seen = now
    liveness.check(now)
    assert liveness.pace.interval == 1.5  # 3 connected at 2 a second
    for node in nodes[:3]:
        assert [m.pace.heartbeat_interval.ToNanoseconds() for m in node.session.sent] == [
            1_500_000_000
        ]  # type: ignore[union-attr]
        assert node.interval == 1.5
    assert nodes[3].interval == 0.0  # not connected: nothing sent
    liveness.check(now)
    assert sum(len(n.session.sent) for n in nodes[:3]) == 3  # type: ignore[union-attr]


def test_an_opening_term_follows_the_intervals_its_agents_were_on() -> None:
    p = HeartbeatPace(1.0, 1000)
    # 100 registered of a cluster that beat every 5 s: at most 10 times as many assumed yet.
    assert p.opening(100, [5.0] * 100) is False and p.interval == 1.0
    assert p.opening(300, [5.0] * 300) is True and p.interval == 3.0
    assert p.opening(600, [5.0] * 600) is True and p.interval == 5.0
    # Only upward while it opens; the count alone, down too, once it has opened.
    assert p.opening(700, []) is False and p.interval == 5.0
    assert p.retarget(700) is True and p.interval == 1.0


def test_a_few_agents_cannot_move_an_opening_pace() -> None:
    p = HeartbeatPace(1.0, 1000)
    # The median: three agents claiming ten minutes among 600 on 1 s change nothing ...
    assert p.opening(603, [1.0] * 600 + [600.0] * 3) is False and p.interval == 1.0
    # ... and agents alone, however many say so, make it assume at most 10 times their count.
    assert p.opening(3, [600.0] * 3) is False and p.interval == 1.0
    assert p.opening(200, [600.0] * 200) is True and p.interval == 2.0


def test_while_a_term_opens_each_pass_paces_by_the_registered_nodes_hints() -> None:
    reg = Registry()
    liveness = Liveness(
        reg, Feed(reg, 1.0), 1.0, 5.0, clock=time.monotonic, pace=HeartbeatPace(1.0, 100.0)
    )
    now = 1000.0
    liveness.begin(now)
    nodes = [reg.upsert(f"n{i}") for i in range(60)]
    for node in nodes:
        node.session = Session()  # type: ignore[assignment]
        node.last_seen, node.hinted = now, 5.0
        liveness.registered(now)
    nodes[-1].session = None  # a stream that ended: its word no longer counts, nor it
    nodes[-1].hinted = 600.0
    liveness.check(now + 0.1)
    assert liveness.pace.interval == 5.0  # not 59 / 100 a second: the base, 1 s
    sent = nodes[0].session.sent  # type: ignore[union-attr]
    assert [m.pace.heartbeat_interval.ToNanoseconds() for m in sent] == [5_000_000_000]
    # Opened (two intervals after the last registration): the count, 59 at 100 a second.
    liveness.check(now + 2.5)
    assert liveness.pace.interval == 1.0
    assert all(n.state is NodeState.READY for n in nodes[:-1])
    assert nodes[0].next_interval == 1.0  # a shorter interval: from the node's next beat
