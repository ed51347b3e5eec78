"""Liveness: the clock that turns a silent node NOT_READY, then LOST; node state changes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

from orka.models import NodeState
from orka.scheduler.feed import Feed
from orka.scheduler.registry import NodeRecord, Registry

log = structlog.get_logger("orka.scheduler")

# Longest wait between two passes: a node is declared at most this late.
MAX_TICK = 0.25


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
    ) -> None:
        self.registry = registry
        self.feed = feed
        self.heartbeat_interval = heartbeat_interval
        self.node_lost_after = node_lost_after
        self.clock = clock
        self.on_pass = list(on_pass)

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
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(tick)
            late = loop.time() - asleep - tick
            if late > tick:
                self.excuse(late)
            now = self.clock()
            self.check(now)
            for duty in self.on_pass:
                duty(now)

    def excuse(self, seconds: float) -> None:
        """This scheduler did not run for `seconds` (its pass came that late: an event loop
        busy with other work, or the process paused), so it read nothing in that time, and
        what the nodes sent meanwhile still waits, unread, in its own buffers. That time is
        not counted as the nodes' silence: a scheduler that falls behind under load must not
        turn the nodes it has not got round to NOT_READY, then LOST, and close their streams,
        which makes every one of them reconnect and register again, more load on a scheduler
        already behind. (Cassandra's failure detector likewise convicts no peer after a
        local pause.) A node that really went silent is declared at most that much later."""
        for node in self.registry:
            if node.session is not None:  # a node without a stream has nothing waiting
                node.last_seen += seconds

    def check(self, now: float) -> None:
        """One pass over every node at time `now`."""
        interval = self.heartbeat_interval
        for node in list(self.registry):
            if node.state in (NodeState.LOST, NodeState.LEFT):
                continue
            silent = now - node.last_seen
            if silent > self.node_lost_after:
                if node.session is not None:
                    node.session.close()
                node.reports.clear()
                for name in list(node.holds):
                    node.drop_hold(name)
                self.set_state(node, NodeState.LOST, f"no heartbeat for {silent:.1f}s")
            elif silent > 2 * interval and node.state is NodeState.READY:
                self.set_state(node, NodeState.NOT_READY, f"no heartbeat for {silent:.1f}s")
