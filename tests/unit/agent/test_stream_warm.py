"""The agent's channels kept warm to the schedulers it is not registered with (`_keep_warm`):
which are dialled, and when a dead one is dialled again. Fake channels: only the policy."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog.testing

from orka.agent import stream as stream_module
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
    assert [(e["event"], e["target"], e["error"]) for e in logs] == [
        (
            "could not keep a scheduler connection",
            "b:1",
            repr(OSError("certs: cannot read agent.key")),
        )
    ]
    assert [c.dials for c in stream.made["b:1"]] == [1]


async def test_a_failing_scheduler_is_dialled_again_after_a_backoff_that_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, float, float]] = []

    def delay(attempt: int, base: float, cap: float) -> float:
        asked.append((attempt, base, cap))
        return 7.0

    monkeypatch.setattr("orka.agent.stream.backoff.delay", delay)
    stream = WarmStream(["a:1", "b:1", "c:1"], FAILED)
    await stream._keep("b:1", 100.0)  # dialled: no channel yet
    await stream._keep("b:1", 100.5)  # found failing: closed, a backoff of 7 s
    assert [(c.dials, c.closed) for c in stream.made["b:1"]] == [(1, True)]
    assert asked == [(1, stream_module.WARM_BACKOFF / 2, stream_module.WARM_MAX)]
    await stream._keep("b:1", 107.4)  # not yet
    assert len(stream.made["b:1"]) == 1
    await stream._keep("b:1", 107.5)  # due: dialled again
    assert [c.dials for c in stream.made["b:1"]] == [1, 1]
    await stream._keep("b:1", 108.0)  # failing again: the next backoff is longer
    assert [a for a, _, _ in asked] == [1, 2]
    # Each address has its own count: c has not failed.
    await stream._keep("c:1", 108.0)
    assert stream._warm["c:1"].failures == 0 and stream._warm["b:1"].failures == 2
    # Connected at last: the count starts over.
    stream.state = READY
    await stream._keep("b:1", 115.0)
    await stream._keep("b:1", 115.5)
    assert stream._warm["b:1"].failures == 0


async def test_a_failure_of_the_connect_loop_there_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("orka.agent.stream.backoff.delay", lambda a, b, c: 7.0)
    stream = WarmStream(["a:1", "b:1"], IDLE)
    stream._channel("a:1")
    stream.targets.failed(None, 0.0)  # the connect loop could not reach a: on to b
    await stream._keep("a:1", 100.0)
    assert [c.closed for c in stream.made["a:1"]] == [True]
    assert stream._warm["a:1"].failures == 1
    await stream._keep("a:1", 101.0)  # the same failure: not counted again
    assert stream._warm["a:1"].failures == 1
    await stream._keep("a:1", 107.0)  # its backoff over: dialled
    assert [(c.dials, c.closed) for c in stream.made["a:1"]] == [(0, True), (1, False)]
    # a answered the connect loop since: its idle channel is asked to connect, not closed.
    stream.targets._down.pop("a:1")
    await stream._keep("a:1", 108.0)
    assert [(c.dials, c.closed) for c in stream.made["a:1"]] == [(0, True), (2, False)]
    assert stream._warm["a:1"].failures == 1


async def test_the_looks_are_jittered_around_warm_every(monkeypatch: pytest.MonkeyPatch) -> None:
    spreads: list[tuple[float, float]] = []
    slept: list[float] = []

    def uniform(low: float, high: float) -> float:
        spreads.append((low, high))
        return 0.75

    class Stop(Exception):
        pass

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        raise Stop

    monkeypatch.setattr(stream_module.random, "uniform", uniform)
    monkeypatch.setattr(stream_module.asyncio, "sleep", sleep)
    with pytest.raises(Stop):
        await WarmStream(["a:1", "b:1"], READY)._keep_warm()
    assert spreads == [(0.5, 1.5)]
    assert slept == [pytest.approx(stream_module.WARM_EVERY * 0.75)]
