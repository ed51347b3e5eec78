"""Liveness: the clock that turns a silent node NOT_READY, then LOST; node state changes."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence

import structlog

from orka.models import NodeState
from orka.scheduler.feed import Feed
from orka.scheduler.pace import HeartbeatPace
from orka.scheduler.registry import NodeRecord, Registry

log = structlog.get_logger("orka.scheduler")

# Longest wait between two passes: a node is declared at most this late.
MAX_TICK = 0.25
# Behind by more than this share of a heartbeat interval (half the heartbeats read over the
# last half interval were read at least that much later than their nodes' usual), the
# scheduler stops counting its nodes' silence until it has caught up.
BEHIND_SHARE = 0.5
# Reads later than this (the median of a window) count as the scheduler lagging behind its
# agents' streams for what waits on their replies (offers: session.replies).
READ_LAG = 0.1
# A term's grace (`registered`) never runs past this many seconds after the term began. Nomad
# gives every node `failover_heartbeat_ttl` (5 minutes) after a leader election; this one ends
# as soon as the registrations have.
MAX_GRACE = 60.0
# Seconds a node's lag floor rises per heartbeat, so that a clock stepped back on the node
# stops looking like late reads within minutes. A backlog grows far faster than this.
LAG_FLOOR_DRIFT = 0.01


def lateness(node: NodeRecord, lag: float) -> float | None:
    """How much later than usual a heartbeat of `node` was read, given `lag`: our clock when
    read minus the node's `sent_at`. Measured from the node's own least lag (its clock's
    offset from ours plus the network), so no clock offset counts, only a late read. None
    for a node's first heartbeat here: nothing to compare it with yet (a scheduler taking
    thousands of registrations reads every first heartbeat late, and counting them as on
    time would hide that it is behind)."""
    floor = node.lag_floor
    node.lag_floor = min(lag, floor + LAG_FLOOR_DRIFT)
    if floor == float("inf"):
        return None
    return lag - node.lag_floor


class Liveness:
    """Owns node state. Its `run()` is the scheduler's one clock: each pass checks every
    node's silence, then runs the other duties paced by the same clock (`on_pass`: the usage
    report, reservation expiry), in that order, so a stepped test clock sees each pass whole.
    """

    def __init__(
        self,
        registry: Registry,
        feed: Feed,
        heartbeat_interval: float,
        node_lost_after: float,
        clock: Callable[[], float],
        on_pass: Sequence[Callable[[float], None]] = (),
        pace: HeartbeatPace | None = None,
    ) -> None:
        self.registry = registry
        self.feed = feed
        self.heartbeat_interval = heartbeat_interval
        self.node_lost_after = node_lost_after
        # How often nodes heartbeat now: the configured interval unless the cluster's size
        # stretches it (no bound without a pace).
        self.pace = pace or HeartbeatPace(heartbeat_interval, 0.0)
        self.clock = clock
        self.on_pass = list(on_pass)
        # How much later than usual each heartbeat read in the current window was read (the
        # window is half an interval: about half the live nodes).
        self._late: list[float] = []
        self._window_start = 0.0
        # The median of those over the last whole window that read any (None: none yet): a
        # median, because the streams a busy scheduler reads are not served alike, and one
        # slow agent must not make it look behind either.
        self.behind: float | None = None
        # Until then no node's silence is judged (`registered`); the term's start, from run().
        self.grace_until = 0.0
        self._began: float | None = None

    def lag(self) -> float:
        """How many seconds late this scheduler reads its agents' streams now: the median
        lateness of the heartbeats of the last window, when above READ_LAG; else 0."""
        behind = self.behind
        return behind if behind is not None and behind > READ_LAG else 0.0

    def begin(self, now: float) -> None:
        """The term this clock serves began at `now` (run() calls it)."""
        self._began = now
        self.grace_until = 0.0

    def registered(self, now: float) -> None:
        """An agent registered at `now`. When a term begins (a start, a restart, a failover)
        every agent registers at once, and the scheduler taking them reads heartbeats late
        before any node has the lateness measure `excuse` relies on (a node's first heartbeat
        only sets its floor): judged on raw silence, registered nodes would go NOT_READY and
        LOST, their streams closed, and each would register again, more load on a scheduler
        already behind. So in a term's first MAX_GRACE seconds silence is not judged until two
        intervals after the latest registration (by then every node has had a heartbeat to
        set its floor). A node's stream that ends is still seen at once (the gateway)."""
        if self._began is None or now - self._began >= MAX_GRACE:
            return
        until = min(self._began + MAX_GRACE, now + 2 * self.pace.interval)
        self.grace_until = max(self.grace_until, until)

    def heard(self, late: float) -> None:
        """A heartbeat was read `late` seconds later than its node's heartbeats usually are
        (gateway: measured against the node's own lag floor, so no clock offset counts)."""
        self._late.append(late)

    def set_state(self, node: NodeRecord, state: NodeState, message: str = "") -> None:
        if node.state is state:
            return
        log.info("node state", node=node.name, old=node.state.value, new=state.value)
        was_lost = node.state in (NodeState.LOST, NodeState.LEFT)
        node.state = state
        node.message = message
        self.registry.changed(node)
        self.feed.publish_node(node)
        if was_lost and state is NodeState.READY:
            # The controller may have replaced what this node runs while it was away.
            self.feed.publish_sync(node)

    async def run(self) -> None:
        tick = min(self.heartbeat_interval / 4, MAX_TICK)
        self.begin(self.clock())
        loop = asyncio.get_running_loop()
        self._window_start = loop.time()
        while True:
            asleep = loop.time()
            await asyncio.sleep(tick)
            woke = loop.time()
            late = woke - asleep - tick
            interval = self.pace.interval
            if woke - self._window_start >= interval / 2:
                if self._late:
                    # A window in which nothing was read tells nothing: the last figure
                    # stands. (Were every node gone, their streams would end, keepalive at
                    # the latest, and a node without a stream is never excused.)
                    self.behind = statistics.median_low(self._late)
                    self._late = []
                self._window_start = woke
            if self.behind is not None and self.behind > BEHIND_SHARE * interval:
                # Even the freshest heartbeats it reads are old: the rest wait unread in
                # its buffers. Nobody's silence grows until it has caught up.
                self.excuse(woke - asleep)
            elif late > tick:
                self.excuse(late)
            now = self.clock()
            self.check(now)
            for duty in self.on_pass:
                duty(now)

    def excuse(self, seconds: float) -> None:
        """This scheduler did not keep up for `seconds`: its pass came that late (an event
        loop busy with other work, the process paused), or most of the heartbeats it reads
        come late (`heard`). What the nodes sent meanwhile still waits, unread, in
        its own buffers, behind the backlog the scheduler is working through. That time is
        not counted as the nodes' silence: a scheduler that falls behind under load must not
        turn the nodes it has not got round to NOT_READY, then LOST, and close their streams,
        which makes every one of them reconnect and register again, more load on a scheduler
        already behind. (Cassandra's failure detector likewise convicts no peer after a
        local pause.) A node that really went silent is declared at most that much later."""
        for node in self.registry:
            if node.session is not None:  # a node without a stream has nothing waiting
                node.last_seen += seconds

    def check(self, now: float) -> None:
        """One pass over every node at time `now`; then the heartbeat pace follows the number
        of connected nodes."""
        base = self.heartbeat_interval
        connected = 0
        judge = now >= self.grace_until
        hints: list[float] = []  # while the term opens (`judge` False): HeartbeatPace.opening
        for node in list(self.registry):
            if node.session is not None:
                connected += 1
                if not judge and node.hinted:
                    hints.append(node.hinted)
            if not judge or node.state in (NodeState.LOST, NodeState.LEFT):
                continue
            silent = now - node.last_seen
            interval = node.interval or base
            if silent > self.node_lost_after * interval / base:
                if node.session is not None:
                    node.session.close()
                node.reports.clear()
                for name in list(node.holds):
                    node.drop_hold(name)
                self.set_state(node, NodeState.LOST, f"no heartbeat for {silent:.1f}s")
            elif silent > 2 * interval and node.state is NodeState.READY:
                self.set_state(node, NodeState.NOT_READY, f"no heartbeat for {silent:.1f}s")
        moved = self.pace.retarget(connected) if judge else self.pace.opening(connected, hints)
        if moved:
            self.pace.tell(self.registry)
