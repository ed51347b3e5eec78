"""The agent's reconnect backoff (Stream._connect_loop): it starts over after every stream that
registered, and grows over dials that did not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from orka.agent import stream as stream_module
from orka.agent.stream import Stream
from orka.models import Resources
from orka.security.tls import TlsFiles


class Scripted(Stream):
    """Each session registers (or not, per `registers`) and then breaks as a lost connection."""

    def __init__(self, registers: list[bool]) -> None:
        tls = TlsFiles(ca=Path("ca"), cert=Path("c"), key=Path("k"))
        super().__init__(
            ["127.0.0.1:1"], tls, Resources(), {}, {}, {}, 1.0, 5.0, lambda m: None,
            Resources, self._usage, lambda: False,
        )  # fmt: skip
        self.registers = registers

    @staticmethod
    async def _usage() -> Resources:
        return Resources()

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
