"""The agent's connect loop and sessions (Stream.run, _connect_loop, _attempt, session,
_serve) against stand-in channels and calls: which scheduler it dials next, when it leaves a
dial out, which channels it drops, and how a session starts and ends."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import structlog.testing

from orka.agent import stream as stream_module
from orka.agent.stream import MAX_SKIPPED_DIALS
from orka.api import agent_pb2 as apb
from orka.errors import Invalid
from tests.unit.agent.streams import BareStream
from tests.unit.rpc.test_targets import not_leader

READY = grpc.ChannelConnectivity.READY
FAILED = grpc.ChannelConnectivity.TRANSIENT_FAILURE
UNAVAILABLE = grpc.aio.AioRpcError(
    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "Socket closed"
)


class FakeCall:
    """A scheduler's end of one stream: answers each read from `answers` (EOF after them),
    keeps what was written."""

    def __init__(self, answers: list[apb.SchedulerMessage]) -> None:
        self.answers = list(answers)
        self.written: list[apb.AgentMessage] = []
        self.cancelled = False

    async def write(self, msg: apb.AgentMessage) -> None:
        self.written.append(msg)

    async def read(self) -> Any:
        await asyncio.sleep(0)
        return self.answers.pop(0) if self.answers else grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeChannel:
    def __init__(self, state: grpc.ChannelConnectivity = READY) -> None:
        self.state = state
        self.closed = False
        self.calls: list[FakeCall] = []

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.state

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        def open_call() -> FakeCall:
            call = FakeCall([])
            self.calls.append(call)
            return call

        return open_call

    def __getattr__(self, kind: str) -> Any:
        # The stub's other methods (unary_unary, ...): made, never called here.
        return lambda *args, **kwargs: None

    async def close(self) -> None:
        self.closed = True


class Channels(BareStream):
    """Its channels are FakeChannels, each kept in `made` per address."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(addresses)
        self.made: dict[str, list[FakeChannel]] = {}

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = FakeChannel()
            self.made.setdefault(target, []).append(channel)
            self._channels[target] = channel  # type: ignore[assignment]
        return channel  # type: ignore[return-value]


# ---- run ----


class Warmless(BareStream):
    """Its connect loop returns at once; its keeping warm only says it ran and ended."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(addresses)
        self.warm: list[str] = []

    async def _keep_warm(self) -> None:
        self.warm.append("started")
        try:
            await asyncio.Event().wait()
        finally:
            self.warm.append("ended")

    async def _connect_loop(self) -> None:
        for _ in range(3):
            await asyncio.sleep(0)


async def test_one_scheduler_has_nothing_to_keep_warm() -> None:
    stream = Warmless(["a:1"])
    await stream.run()
    assert stream.warm == []


async def test_run_ends_its_keeping_warm_and_closes_every_channel() -> None:
    stream = Warmless(["a:1", "b:1"])
    channels = {"a:1": FakeChannel(), "b:1": FakeChannel()}
    stream._channels = dict(channels)  # type: ignore[arg-type]
    assert await stream.run() is None
    assert stream.warm == ["started", "ended"]
    assert [c.closed for c in channels.values()] == [True, True]
    assert stream._channels == {}


# ---- the connect loop ----


class Dials(Channels):
    """Each dial fails with `failure`; the log says what each turn of the loop did."""

    def __init__(self, addresses: list[str], failure: BaseException | None) -> None:
        super().__init__(addresses)
        self.failure = failure
        self.log: list[str] = []

    async def _attempt(self, target: str) -> tuple[bool, BaseException | None]:
        await asyncio.sleep(0)
        self._channel(target)
        self.log.append(f"dial {target}")
        return False, self.failure


async def loop_until(stream: Dials, turns: int) -> list[str]:
    task = asyncio.create_task(stream._connect_loop())
    for _ in range(1000):
        if len(stream.log) >= turns:
            break
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return stream.log[:turns]


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float, float]]:
    """A port that refused connections: every pause ends saying so (the probe that follows
    says it listens, unless the test sets it: `probing`). Returns the backoff's arguments,
    one entry per pause asked for."""
    delays: list[tuple[int, float, float]] = []

    def delay(attempt: int, base: float, cap: float) -> float:
        delays.append((attempt, base, cap))
        return 0.1

    async def pause(seconds: float, target: str) -> bool:
        await asyncio.sleep(0)
        return True

    async def listening(target: str) -> bool:
        # No real probe: these addresses are names, and resolving one is traffic off the
        # machine. A test that cares what the probe says sets its own (`probing`).
        await asyncio.sleep(0)
        return True

    monkeypatch.setattr(stream_module.backoff, "delay", delay)
    monkeypatch.setattr(stream_module.backoff, "pause", pause)
    monkeypatch.setattr(stream_module.backoff, "probe", listening)
    return delays


def probing(stream: Dials, listens: bool, word: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Port probes answer `listens`, each logged as `word` and the address."""

    async def probe(target: str) -> bool:
        stream.log.append(f"{word} {target}")
        return listens

    monkeypatch.setattr(stream_module.backoff, "probe", probe)


async def test_dials_are_left_out_while_the_port_refuses_but_not_forever(
    refusing: list[tuple[int, float, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = Dials(["a:1"], UNAVAILABLE)
    probing(stream, False, "left out", monkeypatch)
    turns = 2 * (MAX_SKIPPED_DIALS + 1) + 1
    skips = ["left out a:1"] * MAX_SKIPPED_DIALS
    assert await loop_until(stream, turns) == ["dial a:1", *skips, "dial a:1", *skips, "dial a:1"]
    # The backoff grows over every turn, dialled or left out, from the first.
    assert [a for a, _, _ in refusing[:4]] == [1, 2, 3, 4]
    assert refusing[0][1:] == (0.2, 1.0)


async def test_a_port_that_listens_again_is_dialled_at_once(
    refusing: list[tuple[int, float, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = Dials(["a:1"], UNAVAILABLE)
    probing(stream, True, "probed", monkeypatch)
    dial_probe = ["dial a:1", "probed a:1"]
    assert await loop_until(stream, 5) == [*dial_probe, *dial_probe, "dial a:1"]


async def test_a_failed_dial_drops_its_channel(refusing: list[tuple[int, float, float]]) -> None:
    stream = Dials(["a:1", "b:1"], UNAVAILABLE)
    assert await loop_until(stream, 2) == ["dial a:1", "dial b:1"]
    assert [c.closed for c in stream.made["a:1"]] == [True]
    assert "a:1" not in stream._channels


async def test_a_not_leader_answer_keeps_the_channel_and_is_followed_at_once(
    refusing: list[tuple[int, float, float]],
) -> None:
    # a answers that c leads: c next (b would be next down the list), the channel to a kept
    # for the next failover, no pause in between.
    stream = Dials(["a:1", "b:1", "c:1"], not_leader("c:1"))
    assert await loop_until(stream, 2) == ["dial a:1", "dial c:1"]
    assert [c.closed for c in stream.made["a:1"]] == [False]
    assert stream._channels["a:1"] is stream.made["a:1"][0]  # type: ignore[comparison-overlap]


async def test_a_dial_that_failed_is_named_unreachable_in_the_next_registration(
    refusing: list[tuple[int, float, float]],
) -> None:
    stream = Dials(["a:1", "b:1"], UNAVAILABLE)
    await loop_until(stream, 1)
    assert list(stream.register_message().register.unreachable) == ["a:1"]


# ---- one attempt ----


class Ends(BareStream):
    """Its session ends with `error` (None: cleanly), having registered if `registers`."""

    def __init__(self, error: BaseException | None, registers: bool = False) -> None:
        super().__init__(["a:1"])
        self.error = error
        self.registers = registers

    async def session(self, target: str) -> None:
        if self.registers:
            self.connected.set()
        if self.error is not None:
            raise self.error


async def test_a_clean_end_counts_as_registered() -> None:
    assert await Ends(None)._attempt("a:1") == (True, None)


async def test_a_stream_that_ended_with_an_error_is_logged_with_its_code() -> None:
    with structlog.testing.capture_logs() as logs:
        registered, err = await Ends(UNAVAILABLE, registers=True)._attempt("a:1")
    assert (registered, err) == (True, UNAVAILABLE)
    assert [(e["event"], e["log_level"], e["target"], e["code"]) for e in logs] == [
        ("scheduler stream ended", "warning", "a:1", "UNAVAILABLE")
    ]
    assert logs[0]["details"] == "Socket closed"


async def test_an_unexpected_failure_is_logged_and_carries_no_error() -> None:
    with structlog.testing.capture_logs() as logs:
        assert await Ends(RuntimeError("bug"))._attempt("a:1") == (False, None)
    assert [(e["event"], e["log_level"], e["target"]) for e in logs] == [
        ("scheduler stream failed", "error", "a:1")
    ]


# ---- one session ----


async def test_a_channel_waiting_out_grpcs_backoff_is_replaced_before_the_stream_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = Channels(["a:1"])
    stale = FakeChannel(FAILED)
    stream._channels["a:1"] = stale  # type: ignore[assignment]
    served: list[FakeCall] = []

    async def serve(target: str, call: FakeCall) -> None:
        served.append(call)

    monkeypatch.setattr(stream, "_serve", serve)
    await stream.session("a:1")
    assert stale.closed and stale.calls == []
    fresh = stream.made["a:1"]
    assert len(fresh) == 1 and fresh[0].calls == served
    assert served[0].cancelled  # the call ends with the session; the channel stays
    assert stream._channels["a:1"] is fresh[0]  # type: ignore[comparison-overlap]


def registered(node: str = "n1") -> apb.SchedulerMessage:
    return apb.SchedulerMessage(registered=apb.Registered(node=node))


@pytest.mark.parametrize(
    "answers",
    [
        pytest.param([], id="EOF"),
        pytest.param([apb.SchedulerMessage(pace=apb.Pace())], id="something else"),
    ],
)
async def test_a_registration_not_acknowledged_ends_the_session(
    answers: list[apb.SchedulerMessage],
) -> None:
    stream = BareStream(["a:1"])
    call = FakeCall(answers)
    with pytest.raises(Invalid) as info:
        await asyncio.wait_for(stream._serve("a:1", call), 10)  # type: ignore[arg-type]
    assert str(info.value) == "scheduler did not acknowledge the registration"
    assert not stream.connected.is_set()
    assert [m.WhichOneof("body") for m in call.written] == ["register"]


async def test_a_session_registers_logs_and_leaves_nothing_behind_when_it_ends() -> None:
    stream = BareStream(["a:1"])
    ended: list[bool] = []
    # Told once the session's heartbeats have ended too, not while they still run.
    stream.on_disconnect = lambda: ended.append(stream._asleep is None)  # type: ignore[method-assign]
    call = FakeCall([registered("n7")])
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(stream._serve("a:1", call), 10)  # type: ignore[arg-type]
    assert [
        (e["event"], e["scheduler"], e["node"]) for e in logs if e["event"] == "registered"
    ] == [("registered", "a:1", "n7")]
    assert ended == [True]
    assert stream.outbox is None
    stream.send(apb.AgentMessage(leave=apb.Leave()))  # after the end: dropped, no error
