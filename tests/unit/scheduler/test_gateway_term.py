"""The agent gateway at the end of a term: a registration on its way is refused, not kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from orka.api import agent_pb2 as apb
from orka.errors import NotLeader
from orka.scheduler.feed import Feed
from orka.scheduler.gateway import Gateway
from orka.scheduler.liveness import Liveness
from orka.scheduler.registry import Registry

REGISTER = apb.AgentMessage(register=apb.Register(node=apb.NodeInfo(labels={"zone": "a"})))


def gateway() -> Gateway:
    registry = Registry()
    feed = Feed(registry, 1.0)
    liveness = Liveness(registry, feed, 0.2, 1.0, time.monotonic)
    return Gateway(registry, feed, liveness, 5.0, time.monotonic)


async def agent(
    messages: asyncio.Queue[apb.AgentMessage | None],
) -> AsyncIterator[apb.AgentMessage]:
    while (msg := await messages.get()) is not None:
        yield msg


async def test_a_stream_opened_before_the_term_ended_registers_nothing_after_it() -> None:
    gw = gateway()
    messages: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
    replies = gw.connect(agent(messages), "node-1")
    first = asyncio.ensure_future(anext(replies))
    await asyncio.sleep(0)  # the stream opens; its registration is not sent yet
    gw.stand_by("no longer active")
    messages.put_nowait(REGISTER)
    with pytest.raises(NotLeader, match="no longer active"):
        await asyncio.wait_for(first, 5)
    assert list(gw.registry) == []


async def test_a_registration_within_the_term_is_answered() -> None:
    gw = gateway()
    messages: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
    replies = gw.connect(agent(messages), "node-1")
    messages.put_nowait(REGISTER)
    reply = await asyncio.wait_for(anext(replies), 5)
    assert reply.WhichOneof("body") == "registered" and reply.registered.node == "node-1"
    assert [(n.name, n.labels["zone"]) for n in gw.registry] == [("node-1", "a")]

    # Ending the term ends the registered stream with NOT_LEADER too.
    gw.stand_by("no longer active")
    with pytest.raises(NotLeader, match="no longer active"):
        await asyncio.wait_for(anext(replies), 5)
