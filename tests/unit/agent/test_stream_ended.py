"""A stream that ends while the agent writes to it (Stream._serve): the write's "RPC already
finished" is not the outcome; the call's own status is, as the reader would have raised it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orka.api import agent_pb2 as apb
from tests.unit.agent.streams import BareStream


class EndedCall:
    """Registers, then has ended with `code` by the time of the next write; its reads of
    what came after wait (the reader has not got to the end yet)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        self.writes = 0
        self.reads = 0

    async def write(self, msg: apb.AgentMessage) -> None:
        self.writes += 1
        if self.writes > 1:
            raise asyncio.InvalidStateError("RPC already finished.")

    async def read(self) -> apb.SchedulerMessage:
        self.reads += 1
        if self.reads == 1:
            return apb.SchedulerMessage(registered=apb.Registered(node="n1"))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return self._details

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(("x-initial", "sent"))

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(("x-reason", "test"))


async def serve(call: EndedCall) -> None:
    stream = BareStream(["127.0.0.1:1"])
    task = asyncio.create_task(stream._serve("127.0.0.1:1", call))  # type: ignore[arg-type]
    await asyncio.wait_for(stream.connected.wait(), 5)
    stream.leave()  # a write: the stream has ended by now
    await asyncio.wait_for(task, 5)


async def test_a_write_on_an_ended_stream_raises_the_streams_own_error() -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await serve(EndedCall(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    err = info.value
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "Socket closed")
    assert tuple(err.trailing_metadata()) == (("x-reason", "test"),)
    assert tuple(err.initial_metadata()) == (("x-initial", "sent"),)


async def test_a_write_on_a_stream_that_ended_ok_is_a_clean_end() -> None:
    await serve(EndedCall(grpc.StatusCode.OK, ""))
