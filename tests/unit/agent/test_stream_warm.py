"""The agent's channels kept warm to the schedulers it is not registered with (`_keep_warm`):
which are dialled, and when a dead one is dialled again. Fake channels: only the policy."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog.testing

from orka.agent.stream import Stream
from tests.unit.agent.streams import BareStream

READY = grpc.ChannelConnectivity.READY
IDLE = grpc.ChannelConnectivity.IDLE
FAILED = grpc.ChannelConnectivity.TRANSIENT_FAILURE


class FakeChannel:
    def __init__(self, state: grpc.ChannelConnectivity) -> None:
        self.state = state
        self.dials = 0
        self.closed = False

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        if try_to_connect:
            self.dials += 1
        return self.state

    async def close(self) -> None:
        self.closed = True


class WarmStream(BareStream):
    """Every channel it makes starts in `state`; all it made are kept in `made`."""

    def __init__(self, addresses: list[str], state: grpc.ChannelConnectivity) -> None:
        super().__init__(addresses)
        self.state = state
        self.made: dict[str, list[FakeChannel]] = {}

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = FakeChannel(self.state)
            self.made.setdefault(target, []).append(channel)
            self._channels[target] = channel  # type: ignore[assignment]
        return channel  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orka.agent.stream.WARM_EVERY", 0.01)
    # The first retry of a failed address comes 10-20 s later: never within a test.
    monkeypatch.setattr("orka.agent.stream.WARM_BACKOFF", 20.0)


async def run_for(stream: Stream, seconds: float) -> None:
    task = asyncio.create_task(stream._keep_warm())
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_other_schedulers_are_dialled_and_the_current_one_left_alone() -> None:
    stream = WarmStream(["a:1", "b:1", "c:1"], READY)
    await run_for(stream, 0.2)
    assert sorted(stream.made) == ["b:1", "c:1"]
    # Connected: one channel each, dialled once, never closed.
    assert [(len(m), m[0].dials, m[0].closed) for m in stream.made.values()] == [(1, 1, False)] * 2


async def test_a_scheduler_that_cannot_be_reached_is_closed_and_not_dialled_again_at_once() -> None:
    stream = WarmStream(["a:1", "b:1"], FAILED)
    await run_for(stream, 0.3)
    # Dialled once, found failing, closed: gRPC's own retries end, and ours wait a backoff.
    assert [(c.dials, c.closed) for c in stream.made["b:1"]] == [(1, True)]
    assert "b:1" not in stream._channels


async def test_an_address_the_connect_loop_just_left_is_not_dialled() -> None:
    # The active scheduler died: the connect loop found it down and moved on to b.
    stream = WarmStream(["a:1", "b:1"], READY)
    stream.targets.failed(None, 0.0)
    assert stream.targets.current == "b:1"
    await run_for(stream, 0.2)
    assert "a:1" not in stream.made


async def test_a_connection_lost_is_dialled_again() -> None:
    stream = WarmStream(["a:1", "b:1"], READY)
    task = asyncio.create_task(stream._keep_warm())
    try:
        for _ in range(500):
            if "b:1" in stream.made:
                break
            await asyncio.sleep(0.01)
        channel = stream.made["b:1"][0]
        channel.state = IDLE  # the standby restarted: gRPC does not reconnect an idle channel
        for _ in range(500):
            if channel.dials >= 2:
                break
            await asyncio.sleep(0.01)
        assert channel.dials >= 2 and not channel.closed
        assert len(stream.made["b:1"]) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_channel_that_cannot_be_made_is_tried_again_next_round() -> None:
    # Making a channel reads the certificate files; one unreadable moment (a rotation) must
    # not end the keeping for good.
    class Flaky(WarmStream):
        refusals = 1

        def _channel(self, target: str) -> grpc.aio.Channel:
            if self.refusals:
                self.refusals -= 1
                raise OSError("certs: cannot read agent.key")
            return super()._channel(target)

    stream = Flaky(["a:1", "b:1"], READY)
    with structlog.testing.capture_logs() as logs:
        await run_for(stream, 0.3)
    assert [(e["event"], e["target"]) for e in logs] == [
        ("could not keep a scheduler connection", "b:1")
    ]
    assert [c.dials for c in stream.made["b:1"]] == [1]
