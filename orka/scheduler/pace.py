"""Heartbeat pacing: how often each agent heartbeats, so that a large cluster's heartbeats stay
within a total rate the scheduler can read (Nomad's `max_heartbeats_per_second`).

Up to `max_rate x base` connected nodes, every node heartbeats every `base` seconds (the
`--heartbeat-interval`); above that, every `nodes / max_rate` seconds, and liveness judges
each node's silence against the interval that node was told (NOT_READY after two of them,
LOST after `node_lost_after` scaled by the same factor). The interval moves only once the
target has moved by a factor of STEP, so a cluster registering thousands of agents is told a
few times, not at every registration.

A term that has just begun (a failover, a restart) has no count yet: every agent registers at
once, and counted as they arrive, the first thousand would heartbeat at `base` and all of them
be told a longer interval at every STEP, about as many messages as the registrations themselves
while the scheduler is busiest. So while the term opens (`opening`), the pace also follows the
interval the agents were on before (Register.heartbeat_interval, their last scheduler's pace).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import structlog

from orka.api import agent_pb2 as apb
from orka.rpc import convert
from orka.scheduler.registry import NodeRecord

log = structlog.get_logger("orka.scheduler")

STEP = 1.5
# While a term opens, the pace assumes at most this many times the nodes registered so far.
OPENING_GROWTH = 10


class HeartbeatPace:
    def __init__(self, base: float, max_rate: float) -> None:
        if base <= 0:
            raise ValueError("heartbeat interval must be > 0")
        if max_rate < 0:
            raise ValueError("max heartbeats per second must not be negative")
        self.base = base
        self.max_rate = max_rate  # 0: no bound, every node at `base`
        self.interval = base

    def target(self, nodes: int) -> float:
        if self.max_rate <= 0:
            return self.base
        return max(self.base, nodes / self.max_rate)

    def retarget(self, nodes: int) -> bool:
        """Follow `nodes` connected ones; True when the interval moved (tell the agents)."""
        want = self.target(nodes)
        moves = want >= self.interval * STEP or want <= self.interval / STEP
        if moves:
            self._move(want, nodes)
        return moves

    def opening(self, nodes: int, hints: list[float]) -> bool:
        """`retarget` while a term opens: `hints` are the intervals the `nodes` registered so
        far were on before (those that said). Their median, so a few agents cannot move it,
        and at most the target for OPENING_GROWTH times the nodes counted: an agent's word is
        a hint, never the pace. Only upward: once the term has opened, `retarget` follows
        the count alone, down too. True when the interval moved (tell the agents)."""
        want = self.target(nodes)
        if hints:
            hinted = min(statistics.median_low(hints), self.target(nodes * OPENING_GROWTH))
            want = max(want, hinted)
        moves = want >= self.interval * STEP
        if moves:
            self._move(want, nodes, opening=True)
        return moves

    def _move(self, want: float, nodes: int, opening: bool = False) -> None:
        """Take `want` as the interval, and say so."""
        log.info(
            "heartbeat interval",
            nodes=nodes,
            old=round(self.interval, 3),
            new=round(want, 3),
            opening=opening,
        )
        self.interval = want

    def tell(self, nodes: Iterable[NodeRecord]) -> int:
        """Send the interval to each connected node; how many were told. A longer interval
        counts at once; a shorter one from the node's next heartbeat (`heard`), since the
        node may be asleep on the longer one until it reads this."""
        interval = convert.duration_fields(self.interval)
        msg = apb.SchedulerMessage(pace=apb.Pace(heartbeat_interval=interval))
        told = 0
        for node in nodes:
            if node.session is None or (node.interval or self.base) == self.interval:
                continue
            node.session.send(msg)
            if self.interval > (node.interval or self.base):
                node.interval, node.next_interval = self.interval, 0.0
            else:
                node.next_interval = self.interval
            told += 1
        return told


def heard(node: NodeRecord) -> None:
    """A heartbeat of `node` arrived: a shorter interval it was told now counts."""
    if node.next_interval:
        node.interval, node.next_interval = node.next_interval, 0.0
