"""The agent's reconnect backoff (Stream._connect_loop): it starts over after every stream that
registered, and grows over dials that did not."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orka.agent import stream as stream_module
from tests.unit.agent.streams import BareStream


class Scripted(BareStream):
    """Each session registers (or not, per `registers`) and then breaks as a lost connection."""

    def __init__(self, registers: list[bool]) -> None:
        super().__init__(["127.0.0.1:1"], reconnect_max=5.0)
        self.registers = registers

    async def session(self, target: str) -> None:
        if not self.registers:
            await asyncio.Event().wait()  # the script is over: stay "connected"
        if self.registers.pop(0):
            self.connected.set()
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "Socket closed"
        )


async def attempts_for(registers: list[bool], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []

    def delay(attempt: int, base: float, cap: float) -> float:
        seen.append(attempt)
        return 0.0

    monkeypatch.setattr(stream_module.backoff, "delay", delay)
    stream = Scripted(registers)
    task = asyncio.create_task(stream._connect_loop())
    for _ in range(500):
        if not stream.registers:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return seen


async def test_the_backoff_starts_over_after_each_stream_that_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A scheduler that fails over again and again: every break is a first retry.
    assert await attempts_for([True, True, True, True], monkeypatch) == [1, 1, 1, 1]


async def test_the_backoff_grows_over_dials_that_did_not_register(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await attempts_for([True, False, False, False, True, False], monkeypatch) == [
        1, 2, 3, 4, 1, 2,
    ]  # fmt: skip


async def test_the_first_dials_that_do_not_register_start_from_the_first_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await attempts_for([False, False, True, False], monkeypatch) == [1, 2, 1, 2]
