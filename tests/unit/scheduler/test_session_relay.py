"""The session relay's flow control and ends, with the agent side played by the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from google.rpc import code_pb2

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Invalid, Unavailable
from orka.scheduler.registry import Registry
from orka.scheduler.session import AgentSession
from orka.scheduler.streams import WINDOW, SessionRelay


def connected(registry: Registry, name: str = "n1") -> AgentSession:
    session = AgentSession(name)
    registry.upsert(name).session = session
    return session


async def opening(node: str = "n1") -> AsyncIterator[apb.SessionRequest]:
    yield apb.SessionRequest(node=node, open=apb.SessionOpen(logs=pb.ReadLogsRequest(instance="i")))
    await asyncio.Event().wait()


def sent(agent: AgentSession) -> list[apb.SchedulerMessage]:
    out = []
    while not agent.outbox.empty():
        msg = agent.outbox.get_nowait()
        if msg is not None:
            out.append(msg)
    return out


def chunk(sid: str, n: int) -> apb.SessionOutput:
    return apb.SessionOutput(session=sid, log=pb.LogChunk(data=b"%d" % n))


async def test_credit_is_given_back_as_the_reader_takes_outputs() -> None:
    registry = Registry()
    agent = connected(registry)
    relay = SessionRelay(registry)
    stream = relay.session(opening())
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    (open_msg,) = sent(agent)
    sid = open_msg.session_open.session
    assert open_msg.session_open.credit == WINDOW
    for n in range(WINDOW):
        relay.on_output(agent, chunk(sid, n))
    taken = [(await first).output.log.data]
    for _ in range(WINDOW // 2):
        taken.append((await anext(stream)).output.log.data)
    assert taken == [b"%d" % n for n in range(WINDOW // 2 + 1)]
    (credit,) = sent(agent)
    assert (credit.session_input.session, credit.session_input.credit) == (sid, WINDOW // 2)
    # Ending the reader's call cancels the session on the agent.
    await stream.aclose()
    (cancel,) = sent(agent)
    assert cancel.session_input.cancel and len(relay) == 0


async def test_an_agent_past_its_credit_ends_the_session() -> None:
    registry = Registry()
    agent = connected(registry)
    relay = SessionRelay(registry)
    stream = relay.session(opening())
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    sid = sent(agent)[0].session_open.session
    for n in range(WINDOW + 5):
        relay.on_output(agent, chunk(sid, n))
    async with asyncio.timeout(5):
        outputs = [await first] + [r async for r in stream]
    assert len(outputs) == WINDOW + 1
    assert outputs[-1].output.end.code == code_pb2.RESOURCE_EXHAUSTED
    assert any(m.session_input.cancel for m in sent(agent))


async def test_another_agents_outputs_and_a_gone_agent() -> None:
    registry = Registry()
    agent = connected(registry, "n1")
    other = connected(registry, "n2")
    relay = SessionRelay(registry)
    stream = relay.session(opening())
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    sid = sent(agent)[0].session_open.session
    relay.on_output(other, chunk(sid, 1))  # not its session: dropped
    relay.agent_gone(agent)
    end = (await first).output.end
    assert end.code == code_pb2.UNAVAILABLE and "n1" in end.message


async def test_opening_errors() -> None:
    registry = Registry()
    relay = SessionRelay(registry)
    with pytest.raises(Unavailable, match="node n9 is not connected"):
        await anext(relay.session(opening("n9")))

    async def no_open() -> AsyncIterator[apb.SessionRequest]:
        yield apb.SessionRequest(node="n1")

    with pytest.raises(Invalid, match="must name node and open"):
        await anext(relay.session(no_open()))
