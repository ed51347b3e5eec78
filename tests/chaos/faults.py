"""The soak's fault injector: SIGKILL (then a restart), SIGSTOP (then SIGCONT) and network
partitions (an iptables DROP of everything one process sends), on random members.

It keeps the cluster able to recover: at most one etcd member, one controller and one scheduler
faulted at a time (etcd keeps its quorum, a controller stays to lead), and at most `concurrent`
faults in all. A lone scheduler is faulted too: it holds soft state only and must come back.
Every fault is recorded with its start and end, so the invariant checker can excuse what a
fault explains (a partitioned node's copies run on while it is cut off) and nothing else.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from tests.chaos.cluster import ChaosCluster, Member

KINDS = ("kill", "pause", "partition")


@dataclass
class Fault:
    kind: str
    target: str
    role: str
    started: float
    ended: float | None = None

    def covers(self, t: float, grace: float) -> bool:
        """Whether this fault was on at `t`, or ended less than `grace` seconds before it."""
        return self.started <= t and (self.ended is None or t <= self.ended + grace)


@dataclass
class Faults:
    cluster: ChaosCluster
    seed: int
    concurrent: int = 2
    pause_range: tuple[float, float] = (1.0, 9.0)
    partition_range: tuple[float, float] = (2.0, 12.0)
    restart_range: tuple[float, float] = (0.5, 4.0)
    every: tuple[float, float] = (1.5, 5.0)
    log: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.random = random.Random(seed_of(self.seed))
        self._tasks: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()

    def active(self) -> list[Fault]:
        return [f for f in self.log if f.ended is None]

    def excused(self, members: set[str], t: float, grace: float) -> bool:
        """Whether a fault on any of `members` (any member at all when empty) explains `t`."""
        return any((not members or f.target in members) and f.covers(t, grace) for f in self.log)

    def _eligible(self) -> list[Member]:
        busy = {f.target for f in self.active()}
        busy_roles = [f.role for f in self.active()]
        out = []
        for m in self.cluster.members.values():
            if m.name in busy:
                continue
            if m.role != "agent" and busy_roles.count(m.role) >= 1:
                continue  # one of each kind of service at a time: etcd keeps its quorum
            if m.role in ("etcd", "controller") and len(self.cluster.by_role(m.role)) < 2:
                continue  # a lone store or controller down is an outage, not a fault to survive
            out.append(m)
        return out

    def _kinds(self, member: Member) -> list[str]:
        kinds = ["kill", "pause"]
        if member.role != "etcd" and self.cluster.can_partition:
            kinds.append("partition")
        return kinds

    async def _restart_exited(self) -> None:
        """A process that exited on its own (a service that stopped on a failure) is started
        again, as its systemd unit's Restart= would; the report counts it ("exited <role>")."""
        held = {f.target for f in self.active()}
        for m in self.cluster.members.values():
            if m.name not in held and m.starts and not m.alive:
                self.log.append(Fault("exited", m.name, m.role, time.monotonic(), time.monotonic()))
                await asyncio.to_thread(m.start)

    async def run(self) -> None:
        while not self.stopping.is_set():
            await asyncio.sleep(self.random.uniform(*self.every))
            await self._restart_exited()
            if self.stopping.is_set() or len(self.active()) >= self.concurrent:
                continue
            eligible = self._eligible()
            if not eligible:
                continue
            member = self.random.choice(eligible)
            kind = self.random.choice(self._kinds(member))
            fault = Fault(kind, member.name, member.role, time.monotonic())
            self.log.append(fault)
            task = asyncio.create_task(self._apply(fault, member))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _apply(self, fault: Fault, member: Member) -> None:
        try:
            if fault.kind == "kill":
                await asyncio.to_thread(member.kill)
                await self._hold(self.restart_range)
                await asyncio.to_thread(member.start)
            elif fault.kind == "pause":
                member.pause()
                await self._hold(self.pause_range)
                member.resume()
            else:
                await asyncio.to_thread(member.partition)
                await self._hold(self.partition_range)
                await asyncio.to_thread(member.heal)
        finally:
            fault.ended = time.monotonic()

    async def _hold(self, span: tuple[float, float]) -> None:
        # A stop ends every fault early: the soak then measures how the cluster recovers.
        try:
            await asyncio.wait_for(self.stopping.wait(), self.random.uniform(*span))
        except TimeoutError:
            pass

    async def stop(self) -> None:
        """End every fault (restart, resume, heal) and wait until all are undone."""
        self.stopping.set()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for m in self.cluster.members.values():
            await asyncio.to_thread(m.heal)  # iptables: not on the loop
            m.resume()
            if not m.alive:
                await asyncio.to_thread(m.start)

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.log:
            key = f"{f.kind} {f.role}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))


def seed_of(seed: int) -> int:
    return seed * 7919 + 17
