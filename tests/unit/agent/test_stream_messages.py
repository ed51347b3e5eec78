"""What the agent's stream says to its scheduler, field by field: the registration, the
heartbeat (usage, allocation, its send time, every instance's status once in
FULL_STATUS_EVERY beats), the leave, and which heartbeat intervals it takes from a scheduler."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import structlog.testing
from google.protobuf.duration_pb2 import Duration

from orka.agent import stream as stream_module
from orka.agent.stream import FULL_STATUS_EVERY, MAX_INTERVAL, MIN_INTERVAL, Stream
from orka.agent.supervisor import Supervised
from orka.api import agent_pb2 as apb
from orka.models import InstancePhase, Resources, WorkloadKind, WorkloadSpec
from orka.runtime.fake import FakeDriver
from orka.security.tls import TlsFiles
from tests.unit.agent.streams import BareStream

CAPACITY = Resources(cpu_millis=4000, memory_bytes=8 << 30)
ALLOCATED = Resources(cpu_millis=750, memory_bytes=3 << 20)
USAGE = Resources(cpu_millis=120, memory_bytes=5 << 20)


def instance(tmp_path: Path, name: str, generation: int) -> Supervised:
    spec = WorkloadSpec(
        name="web",
        kind=WorkloadKind.PROCESS,
        command=["x"],
        resources=Resources(cpu_millis=250, memory_bytes=64 << 20),
    )
    inst = Supervised(name, generation, spec, FakeDriver(tmp_path / "fake"), lambda i: None)
    inst.phase = InstancePhase.RUNNING
    return inst


class Usage:
    """The drivers' usage, counting the reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def __call__(self) -> Resources:
        self.reads += 1
        return USAGE


def make_stream(tmp_path: Path, volumes: object = None, **instances: int) -> tuple[Stream, Usage]:
    usage = Usage()
    stream = Stream(
        ["127.0.0.1:1", "127.0.0.1:2"],
        TlsFiles(tmp_path / "ca.crt", tmp_path / "n1.crt", tmp_path / "n1.key"),  # never dialled
        CAPACITY,
        {"zone": "a", "disk": "ssd"},
        {"fake": FakeDriver(tmp_path / "fake"), "container": FakeDriver(tmp_path / "fake2")},
        {name: instance(tmp_path, name, gen) for name, gen in instances.items()},
        1.5,
        5.0,
        lambda m: None,
        lambda: ALLOCATED,
        usage,
        lambda: False,
        pool="gpu",
        volumes=volumes,  # type: ignore[arg-type]
    )
    stream.outbox = asyncio.Queue()
    return stream, usage


def test_the_registration_describes_the_node(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path, **{"web-1": 3, "web-2": 7})
    reg = stream.register_message().register
    node = reg.node
    assert (node.capacity.cpu_millis, node.capacity.memory_bytes) == (4000, 8 << 30)
    assert (node.allocatable.cpu_millis, node.allocatable.memory_bytes) == (4000, 8 << 30)
    assert dict(node.labels) == {"zone": "a", "disk": "ssd"}
    assert list(node.drivers) == ["container", "fake"]
    assert node.version == stream_module.VERSION
    assert node.pool == "gpu"
    # What it holds, each with its resources and generation: the scheduler rebuilds its
    # picture of this node from them.
    assert [(s.name, s.generation, s.resources.cpu_millis) for s in reg.instances] == [
        ("web-1", 3, 250),
        ("web-2", 7, 250),
    ]
    assert reg.instances[0].resources.memory_bytes == 64 << 20
    assert reg.registers_again is True
    assert list(reg.unreachable) == []


def test_a_node_in_no_pool_registers_the_default_pool(tmp_path: Path) -> None:
    assert BareStream(["a:1"]).register_message().register.node.pool == ""


class Volumes:
    """What the registration reads of the node's volumes (orka/agent/volumes.py)."""

    def backend_names(self) -> list[str]:
        return ["ext4", "qcow2"]

    def capacity_bytes(self) -> int:
        return 50 << 30

    def statuses(self) -> list[apb.VolumeStatus]:
        return [apb.VolumeStatus(name="db-data", size_bytes=1 << 30, backend="ext4")]


def test_the_registration_offers_the_volume_backends_and_what_it_holds(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path, volumes=Volumes())
    reg = stream.register_message().register
    assert list(reg.node.volume_backends) == ["ext4", "qcow2"]
    assert reg.node.volume_capacity_bytes == 50 << 30
    assert [(v.name, v.size_bytes, v.backend) for v in reg.volumes] == [
        ("db-data", 1 << 30, "ext4")
    ]


def test_the_registration_names_the_schedulers_it_could_not_reach(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path)
    stream.targets.failed(ConnectionRefusedError("refused"), 0.1)
    assert list(stream.register_message().register.unreachable) == ["127.0.0.1:1"]


def test_a_heartbeat_carries_usage_allocation_and_its_send_time(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path, **{"web-1": 1})
    stream._usage_now = USAGE
    before = time.time()
    hb = stream.heartbeat_message().heartbeat
    after = time.time()
    assert (hb.usage.cpu_millis, hb.usage.memory_bytes) == (120, 5 << 20)
    assert (hb.allocated.cpu_millis, hb.allocated.memory_bytes) == (750, 3 << 20)
    assert before <= hb.sent_at <= after


def test_every_status_rides_in_one_heartbeat_of_each_full_round(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path, **{"web-1": 2, "web-2": 4})
    rounds = 3 * FULL_STATUS_EVERY
    carrying = [beat for beat in range(rounds) if stream.heartbeat_message().heartbeat.instances]
    # The last beat of each round, counted from the stream's first.
    assert carrying == [FULL_STATUS_EVERY - 1, 2 * FULL_STATUS_EVERY - 1, rounds - 1]
    stream._beat = FULL_STATUS_EVERY - 1
    full = stream.heartbeat_message().heartbeat.instances
    assert [(s.name, s.generation, s.resources.cpu_millis) for s in full] == [
        ("web-1", 2, 250),
        ("web-2", 4, 250),
    ]
    assert stream._beat == FULL_STATUS_EVERY


def test_leaving_says_why(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path)
    stream.leave()
    assert stream.outbox is not None
    msg = stream.outbox.get_nowait()
    assert msg is not None and msg.WhichOneof("body") == "leave"
    assert msg.leave.reason == "agent shutting down"


def pace(seconds: float) -> apb.Pace:
    duration = Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return apb.Pace(heartbeat_interval=duration)


@pytest.mark.parametrize("seconds", [MIN_INTERVAL, 0.5, MAX_INTERVAL])
def test_a_pace_within_the_bounds_is_taken(tmp_path: Path, seconds: float) -> None:
    stream, _ = make_stream(tmp_path)
    stream.repace(pace(seconds))
    assert stream.interval == seconds


@pytest.mark.parametrize("seconds", [0.0, MIN_INTERVAL - 0.001, MAX_INTERVAL + 0.001, 86400.0])
def test_a_pace_out_of_bounds_is_ignored_and_logged(tmp_path: Path, seconds: float) -> None:
    stream, _ = make_stream(tmp_path)
    with structlog.testing.capture_logs() as logs:
        stream.repace(pace(seconds))
    assert stream.interval == 1.5
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("heartbeat interval out of range; ignored", "warning")
    ]
    assert logs[0]["seconds"] == pytest.approx(seconds)


async def test_a_shorter_pace_wakes_the_sleeping_heartbeat_and_an_equal_or_longer_does_not(
    tmp_path: Path,
) -> None:
    stream, _ = make_stream(tmp_path)
    loop = asyncio.get_running_loop()
    for seconds, wakes in ((1.5, False), (3.0, False), (0.5, True)):
        asleep = stream._asleep = loop.create_future()
        stream._next_beat = loop.time() + 100.0
        stream.repace(pace(seconds))
        assert asleep.done() is wakes, seconds
        if wakes:
            assert stream._next_beat <= loop.time()
        else:
            assert stream._next_beat > loop.time() + 99.0
    stream._asleep = None
    stream.repace(pace(0.1))  # between two sleeps: nothing to wake
    assert stream.interval == 0.1


def test_a_shorter_pace_before_any_heartbeat_is_just_taken(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path)
    stream.repace(pace(0.5))
    assert stream.interval == 0.5


async def test_a_shorter_pace_after_the_heartbeats_stopped_is_just_taken(tmp_path: Path) -> None:
    stream, _ = make_stream(tmp_path)
    stream.interval = 0.05
    beats = asyncio.create_task(stream._heartbeats())
    assert stream.outbox is not None
    await asyncio.wait_for(stream.outbox.get(), 10)
    beats.cancel()
    await asyncio.gather(beats, return_exceptions=True)
    assert stream._asleep is None
    stream.repace(pace(MIN_INTERVAL))
    assert stream.interval == MIN_INTERVAL


async def heartbeats_until(stream: Stream, count: int) -> list[apb.Heartbeat]:
    """Run the heartbeat loop until it has queued `count` heartbeats."""
    beats = asyncio.create_task(stream._heartbeats())
    sent: list[apb.Heartbeat] = []
    assert stream.outbox is not None
    try:
        while len(sent) < count:
            msg = await asyncio.wait_for(stream.outbox.get(), 10)
            assert msg is not None and msg.WhichOneof("body") == "heartbeat"
            sent.append(msg.heartbeat)
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
    return sent


async def test_usage_is_read_for_the_first_beat_and_then_once_in_several(tmp_path: Path) -> None:
    stream, usage = make_stream(tmp_path)
    stream.interval = 0.02
    loop = asyncio.get_running_loop()
    began = loop.time()
    sent = await heartbeats_until(stream, 12)
    took = loop.time() - began
    assert (sent[0].usage.cpu_millis, sent[0].usage.memory_bytes) == (120, 5 << 20)
    # Read again once USAGE_EVERY intervals have passed since the last read: twelve beats on
    # their schedule span eleven intervals after the first, so at least once more; never
    # twice within USAGE_EVERY intervals, however late the beats came.
    every = stream_module.USAGE_EVERY * stream.interval
    assert 2 <= usage.reads <= 1 + took / every


async def test_heartbeats_keep_their_schedule_without_bursts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, _ = make_stream(tmp_path)
    stream.interval = 0.05
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    call_later = loop.call_later

    def recording(delay: float, callback, *args):  # type: ignore[no-untyped-def]
        if callback is stream_module._wake:
            waits.append(delay)
        return call_later(delay, callback, *args)

    monkeypatch.setattr(loop, "call_later", recording)
    began = loop.time()
    await heartbeats_until(stream, 6)
    # Six beats, the first an interval in: at least six intervals (a late beat never pulls
    # the next ones closer than the schedule)...
    assert loop.time() - began >= 6 * 0.05 - 0.01
    # ...and each sleep lasts until the next beat is due, no longer.
    assert len(waits) >= 6
    assert all(0.0 <= w <= 0.05 + 1e-9 for w in waits), waits  # float sums of loop times


async def test_a_beat_far_behind_goes_at_once_alone_and_the_schedule_resumes(
    tmp_path: Path,
) -> None:
    stream, _ = make_stream(tmp_path)
    stream.interval = 0.05
    beats = asyncio.create_task(stream._heartbeats())
    assert stream.outbox is not None
    try:
        await asyncio.wait_for(stream.outbox.get(), 10)
        # The event loop held up for ten intervals (a busy agent): blocking is the point.
        time.sleep(0.5)  # noqa: ASYNC251
        for _ in range(1000):
            if stream.outbox.qsize() >= 2:
                break
            await asyncio.sleep(0)
        # The late beat and the next at once (a third if the schedule's next came due
        # meanwhile), not the ten missed in a burst...
        assert 2 <= len(drained(stream)) <= 3
        # ...and the beats go on from there.
        assert not beats.done()
        for _ in range(2):
            await asyncio.wait_for(stream.outbox.get(), 10)
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)


def drained(stream: Stream) -> list[apb.AgentMessage]:
    assert stream.outbox is not None
    out = []
    while not stream.outbox.empty():
        msg = stream.outbox.get_nowait()
        assert msg is not None
        out.append(msg)
    return out
