"""Heartbeat pacing on real gRPC with real agents: a cluster above the scheduler's heartbeat
budget is told a longer interval, beats at it, is judged by it (no node goes NOT_READY for
beating slowly), goes back to the short interval when it shrinks, and a silent node is still
declared, at the stretched times."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from orka.agent.service import Agent
from orka.api import agent_pb2 as apb
from orka.models import NodeState
from orka.scheduler.registry import NodeRecord
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from tests.integration.cluster import Cluster, crash, eventually

# 3 agents at 2 heartbeats/s in all: 1.5 s each, 7.5 times the configured 0.2 s.
BASE, LOST_AFTER, RATE = 0.2, 1.0, 2.0


async def test_a_cluster_over_its_heartbeat_budget_beats_slower_and_is_judged_by_it(
    certs_dir: Path, tmp_path: Path
) -> None:
    c = Cluster(
        certs_dir,
        tmp_path,
        heartbeat_interval=BASE,
        node_lost_after=LOST_AFTER,
        max_heartbeats_per_second=RATE,
    )
    try:
        await c.start(agents=3, runtimes=["fake"])
        sched = c.scheduler
        changes: list[tuple[str, NodeState, float]] = []
        original = sched.liveness.set_state

        def record(node: NodeRecord, state: NodeState, message: str = "") -> None:
            changes.append((node.name, state, time.monotonic()))
            original(node, state, message)

        sched.liveness.set_state = record  # type: ignore[method-assign]
        agents = list(c.agents.values())

        async def paced_at(interval: float, among: list[str]) -> bool:
            nodes = [sched.registry.get(name) for name in among]
            return all(
                n is not None and n.interval == interval and not n.next_interval for n in nodes
            ) and all(c.agents[name].stream.interval == interval for name in among)

        await eventually(lambda: paced_at(1.5, list(c.agents)), timeout=10)
        beats = [a.stream._beat for a in agents]
        window = 4.6  # three intervals and a bit: 3 beats each (4 at most), not 23
        await asyncio.sleep(window)  # a measuring window, not a wait for a condition
        sent = [a.stream._beat - b for a, b in zip(agents, beats, strict=True)]
        assert all(2 <= n <= 4 for n in sent), sent
        # Judged by 1.5 s, none went NOT_READY (by the configured 0.2 s each would be LOST).
        assert changes == []
        assert all(n.state is NodeState.READY for n in sched.registry)

        # A shorter interval starts with a beat at once, not at the end of the long sleep
        # the heartbeat loop is in (the scheduler judges by the short one from then on).
        first = agents[0]
        start = first.stream._beat
        await eventually(lambda: _beat_after(first, start), timeout=5, interval=0.01)
        before = first.stream._beat  # it just beat: its next is 1.5 s away
        told_at = time.monotonic()
        first.stream.repace(apb.Pace(heartbeat_interval=Duration(nanos=400_000_000)))
        await eventually(lambda: _beat_after(first, before), timeout=5)
        assert time.monotonic() - told_at < 1.0  # not 1.5 s later, on the old schedule

        # Two leave: one node left, under the budget: back to max(0.2, 1 / 2) = 0.5 s, told
        # at once, and the node stays READY through the change.
        keep = agents[2]
        for agent in agents[:2]:
            await agent.stop()
        await eventually(lambda: paced_at(0.5, [keep.config.name]), timeout=10)
        assert [ch for ch in changes if ch[0] == keep.config.name] == []

        # It falls silent: NOT_READY after two of its intervals, LOST after node_lost_after
        # scaled by 0.5 / 0.2 (2.5 s), not after the configured 1 s.
        crashed_at = time.monotonic()
        await crash(keep)

        async def lost() -> bool:
            node = sched.registry.get(keep.config.name)
            return node is not None and node.state is NodeState.LOST

        await eventually(lost, timeout=15)
        mine = [(state, at - crashed_at) for name, state, at in changes if name == keep.config.name]
        assert [state for state, _ in mine] == [NodeState.NOT_READY, NodeState.LOST]
        assert mine[0][1] >= 2 * 0.5 - 0.5  # its last beat may be up to an interval old
        assert mine[1][1] >= LOST_AFTER * 0.5 / BASE - 0.5
        node = sched.registry.get(keep.config.name)
        assert node is not None
        assert float(node.message.split()[-1].rstrip("s")) >= LOST_AFTER * 0.5 / BASE
    finally:
        await c.stop()


async def test_a_new_term_paces_its_first_registrations_by_the_interval_they_were_on(
    certs_dir: Path, tmp_path: Path
) -> None:
    """A restarted scheduler has no count yet: the one agent back of three, which beat every
    1.5 s, is left on 1.5 s while the term opens (counted alone it would be told 0.5 s), and
    told the count's 0.5 s once it has opened; it never goes NOT_READY meanwhile."""
    opts = {"heartbeat_interval": BASE, "node_lost_after": LOST_AFTER}
    c = Cluster(certs_dir, tmp_path, **opts, max_heartbeats_per_second=RATE)
    try:
        await c.start(agents=3, runtimes=["fake"], reconnect_max=0.5)
        await eventually(lambda: _paced(c, 1.5), timeout=10)
        port = c.scheduler.port
        await c.scheduler.stop()
        for name in ("node-2", "node-3"):
            await c.agents.pop(name).stop()
        [back] = c.agents.values()
        back.connected.clear()
        c.scheduler = Scheduler(
            SchedulerConfig(listen=f"127.0.0.1:{port}", max_heartbeats_per_second=RATE, **opts),  # type: ignore[arg-type]
            TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
        )
        await c.scheduler.start()
        sched = c.scheduler
        changes: list[tuple[str, NodeState]] = []
        original = sched.liveness.set_state

        def record(node: NodeRecord, state: NodeState, message: str = "") -> None:
            changes.append((node.name, state))
            original(node, state, message)

        sched.liveness.set_state = record  # type: ignore[method-assign]
        await asyncio.wait_for(back.connected.wait(), 10)
        node = sched.registry.get("node-1")
        assert node is not None and node.hinted == 1.5
        await eventually(lambda: _paced(c, 1.5), timeout=5, interval=0.02)
        assert sched.liveness.grace_until > sched.clock()  # still opening
        # Opened: two intervals after the registration, the count's max(0.2, 1 / 2 s).
        await eventually(lambda: _paced(c, 0.5), timeout=15)
        assert sched.clock() >= sched.liveness.grace_until
        assert changes == []
    finally:
        await c.stop()


async def _paced(c: Cluster, interval: float) -> bool:
    nodes = [c.scheduler.registry.get(name) for name in c.agents]
    return (
        c.scheduler.liveness.pace.interval == interval
        and all(n is not None and n.session is not None for n in nodes)
        and all(a.stream.interval == interval for a in c.agents.values())
    )


async def _beat_after(agent: Agent, count: int) -> bool:
    return agent.stream._beat > count
