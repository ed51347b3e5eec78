"""The standby's early takeover: only an address that refuses connections, again and again,
ends the active scheduler's term; one check at a time, however many agents report it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from orka.errors import Unavailable
from orka.scheduler import takeover
from orka.scheduler.takeover import Takeover, refuses


class FakeElection:
    def __init__(self, fails: bool = False) -> None:
        self.identity = "b:7444"
        self.is_leader = False
        self.followed: dict[str, object] | None = {"id": "a:7444", "lease": 7}
        self.evictions: list[str] = []
        self.fails = fails

    async def evict(self, address: str) -> bool:
        if self.fails:
            raise Unavailable("etcd is unreachable")
        self.evictions.append(address)
        return True


class Probe:
    """Answers in turn from `answers` (True: refused), counting each probe."""

    def __init__(self, *answers: bool) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, address: str) -> bool:
        self.asked.append(address)
        await self.gate.wait()
        return self.answers.pop(0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def settle(t: Takeover) -> None:
    if t._task is not None:
        await t._task


async def test_refused_every_time_ends_the_term_once_for_many_agents() -> None:
    election, probe = FakeElection(), Probe(True, True)
    t = Takeover(election, probe, gap=0)  # type: ignore[arg-type]
    probe.gate.clear()
    for _ in range(50):  # fifty agents arrive naming the dead one
        t.suspect(["a:7444"])
    await asyncio.sleep(0)
    probe.gate.set()
    await settle(t)
    assert probe.asked == ["a:7444"] * takeover.PROBES
    assert election.evictions == ["a:7444"] and t.evicted == ["a:7444"]


async def test_one_accepted_connection_is_life_and_cools_the_suspicion() -> None:
    election, probe, clock = FakeElection(), Probe(True, False, True, True), Clock()
    t = Takeover(election, probe, gap=0, clock=clock)  # type: ignore[arg-type]
    t.suspect(["a:7444"])
    await settle(t)
    assert election.evictions == [] and t.probes == 2
    t.suspect(["a:7444"])  # within COOLDOWN of being found alive: not asked again
    await settle(t)
    assert t.probes == 2
    clock.now += takeover.COOLDOWN
    t.suspect(["a:7444"])
    await settle(t)
    assert t.probes == 4 and election.evictions == ["a:7444"]


async def test_only_the_followed_leader_named_unreachable_is_probed() -> None:
    election, probe = FakeElection(), Probe(True, True)
    t = Takeover(election, probe, gap=0)  # type: ignore[arg-type]
    t.suspect([])  # the agent could reach everything it tried
    t.suspect(["c:7444", "b:7444"])  # not the one we follow
    election.followed = None  # nobody followed (we lead, or have not read whom yet)
    t.suspect(["a:7444"])
    election.followed = {"id": "a:7444", "lease": 7}
    election.is_leader = True
    t.suspect(["a:7444"])
    await settle(t)
    assert probe.asked == [] and election.evictions == []


async def test_a_store_that_cannot_evict_leaves_the_lease_to_end_the_term() -> None:
    election, probe = FakeElection(fails=True), Probe(True, True)
    t = Takeover(election, probe, gap=0)  # type: ignore[arg-type]
    t.suspect(["a:7444"])
    await settle(t)  # logged, not raised: the task ends cleanly
    assert t.evicted == []


async def test_close_cancels_a_check_in_flight() -> None:
    election, probe = FakeElection(), Probe(True, True)
    t = Takeover(election, probe, gap=0)  # type: ignore[arg-type]
    probe.gate.clear()
    t.suspect(["a:7444"])
    await asyncio.sleep(0)
    await t.close()
    probe.gate.set()
    await asyncio.sleep(0)
    assert election.evictions == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_refuses_tells_a_closed_port_from_a_listening_one() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await refuses(f"127.0.0.1:{port}") is False
        assert await refuses(f"127.0.0.1:{free_port()}") is True
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("address", ["nonsense", "host:port", ":"])
async def test_refuses_is_no_evidence_for_an_address_it_cannot_dial(address: str) -> None:
    assert await refuses(address, timeout=0.5) is False
