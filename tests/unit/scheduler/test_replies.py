"""Waiting for agents' replies: one deadline per batch, moved on while the scheduler itself
reads its streams late (the reply may be waiting unread in its own buffers)."""

from __future__ import annotations

import asyncio
import time

from orka.api import agent_pb2 as apb
from orka.rpc import convert
from orka.scheduler.feed import Feed
from orka.scheduler.liveness import READ_LAG, Liveness
from orka.scheduler.registry import Registry
from orka.scheduler.session import MAX_EXCUSE, TIMED_OUT, AgentSession, Reply, replies

TIMEOUT = 0.2


def offered(session: AgentSession, key: str) -> tuple[object, asyncio.Future[Reply]]:
    e = session.expect(apb.SchedulerMessage(), key)
    return e, e.reply


def answer_later(fut: asyncio.Future[Reply], seconds: float) -> None:
    asyncio.get_running_loop().call_later(
        seconds, lambda: fut.done() or fut.set_result(Reply(convert.ok_status()))
    )


async def test_a_reply_after_the_deadline_counts_when_the_scheduler_is_behind() -> None:
    session = AgentSession("n1")
    (e1, f1), (e2, f2) = offered(session, "o1"), offered(session, "o2")
    answer_later(f1, 0.05)
    answer_later(f2, TIMEOUT + 0.3)  # past the deadline, within the excuse
    lags: list[float] = []

    def behind() -> float:
        lags.append(0.25)
        return 0.25

    got = await replies([e1, e2], TIMEOUT, behind)  # type: ignore[list-item]
    assert [r.ok for r in got] == [True, True]
    assert lags == [0.25, 0.25]  # 0.2 + 0.25 + 0.25 >= 0.5
    assert session.waiting == {}  # both keys forgotten


async def test_without_lag_the_deadline_stands() -> None:
    session = AgentSession("n1")
    e, f = offered(session, "o1")
    answer_later(f, TIMEOUT + 0.3)
    t0 = time.monotonic()
    got = await replies([e], TIMEOUT, lambda: 0.0)  # type: ignore[list-item]
    assert got == [TIMED_OUT]
    assert time.monotonic() - t0 < TIMEOUT + 0.25


async def test_the_excuse_is_bounded() -> None:
    session = AgentSession("n1")
    e, _ = offered(session, "o1")  # never answered
    asked: list[float] = []

    def behind() -> float:
        asked.append(1.0)
        return 1.0  # "always far behind"

    t0 = time.monotonic()
    got = await replies([e], TIMEOUT, behind)  # type: ignore[list-item]
    waited = time.monotonic() - t0
    assert got == [TIMED_OUT]
    # The deadline, then MAX_EXCUSE deadlines more at most (each ask capped at what is left).
    assert len(asked) == 1
    assert TIMEOUT * (1 + MAX_EXCUSE) - 0.05 <= waited


def test_lag_is_the_last_windows_median_above_read_lag() -> None:
    reg = Registry()
    liveness = Liveness(reg, Feed(reg, 1.0), 1.0, 5.0, clock=time.monotonic)
    assert liveness.lag() == 0.0  # nothing read yet
    liveness.behind = READ_LAG / 2
    assert liveness.lag() == 0.0  # keeping up
    liveness.behind = 0.7
    assert liveness.lag() == 0.7
