"""Bad input on the scheduler's APIs: a clear error, the right code, and no state touched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.rpc.client import secure_channel
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.identity import Identity
from orka.security.tls import TlsFiles


@pytest.fixture
async def scheduler(certs_dir: Path) -> AsyncIterator[Scheduler]:
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0", register_timeout=2.0),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    await s.start()
    yield s
    await s.stop()


def stub(
    s: Scheduler, certs: Path, role: str, name: str
) -> tuple[grpc.aio.Channel, apb_grpc.SchedulerStub]:
    channel = secure_channel(
        f"127.0.0.1:{s.port}", TlsFiles.for_service(certs, role, name), "scheduler"
    )
    return channel, apb_grpc.SchedulerStub(channel)


def register(cpu: int = 1000) -> apb.AgentMessage:
    return apb.AgentMessage(
        register=apb.Register(
            node=apb.NodeInfo(
                capacity=pb.Resources(cpu_millis=cpu, memory_bytes=1 << 30),
                allocatable=pb.Resources(cpu_millis=cpu, memory_bytes=1 << 30),
                drivers=["fake"],
            )
        )
    )


def heartbeat() -> apb.AgentMessage:
    return apb.AgentMessage(heartbeat=apb.Heartbeat())


def batch(*messages: apb.AgentMessage) -> apb.AgentMessage:
    return apb.AgentMessage(batch=apb.AgentBatch(messages=messages))


async def stream_error(
    s: Scheduler, certs: Path, *messages: apb.AgentMessage
) -> grpc.aio.AioRpcError:
    channel, api = stub(s, certs, "agent", "node-1")
    async with channel:
        call = api.Connect()
        for m in messages:
            await call.write(m)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    await call.code()
                    break
        return info.value


def register_with_volume(status: apb.VolumeStatus) -> apb.AgentMessage:
    msg = register()
    msg.register.volumes.append(status)
    return msg


# Needles of the cases whose register message itself is refused.
REFUSED_REGISTRATIONS = (
    "node.capacity must not be negative",
    "volume status 'd': backend: at most 32 characters",
)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        (
            [apb.AgentMessage(heartbeat=apb.Heartbeat())],
            "first message on the agent stream must be register",
        ),
        ([register(cpu=-5)], "node.capacity must not be negative"),
        (
            [register(), apb.AgentMessage(instance_status=apb.InstanceStatus(name="x"))],
            "instance status x: phase: is required",
        ),
        (
            [
                register(),
                apb.AgentMessage(instance_status=apb.InstanceStatus(phase=pb.Instance.RUNNING)),
            ],
            "name is required",
        ),
        (
            [
                register(),
                apb.AgentMessage(
                    instance_status=apb.InstanceStatus(
                        name="z", phase=pb.Instance.RUNNING, started_at=float("nan")
                    )
                ),
            ],
            "instance status z: started_at: must be a time in seconds since 1970, got nan",
        ),
        (
            [
                register(),
                apb.AgentMessage(
                    heartbeat=apb.Heartbeat(
                        instances=[
                            apb.InstanceStatus(name="z", phase=pb.Instance.FAILED, finished_at=-1)
                        ]
                    )
                ),
            ],
            "instance status z: finished_at: must be a time in seconds since 1970, got -1.0",
        ),
        (
            [register(), apb.AgentMessage(volume_status=apb.VolumeStatus(name="Data 1"))],
            "volume status: name 'Data 1' must be",
        ),
        (
            [register(), apb.AgentMessage(volume_status=apb.VolumeStatus(name="d", state=99))],
            "volume status 'd': state 99 is not a volume state",
        ),
        (
            [
                register(),
                apb.AgentMessage(
                    volume_status=apb.VolumeStatus(
                        name="d", state=pb.Volume.ATTACHED, attached_to=["x"] * 300
                    )
                ),
            ],
            "volume status 'd': attached_to: at most 256 instances",
        ),
        (
            [
                register_with_volume(apb.VolumeStatus(name="d", state=1, backend="z" * 33)),
            ],
            "volume status 'd': backend: at most 32 characters",
        ),
        ([register(), register()], "register may only be sent once"),
        ([register(), apb.AgentMessage()], "empty agent message"),
        ([register(), batch(batch(heartbeat()))], "a batch must not hold another batch"),
        (
            [
                register(),
                batch(heartbeat(), apb.AgentMessage(instance_status=apb.InstanceStatus(name="y"))),
            ],
            "instance status y: phase: is required",
        ),
    ],
)
async def test_bad_agent_messages_are_refused(
    scheduler: Scheduler, certs_dir: Path, messages: list[apb.AgentMessage], needle: str
) -> None:
    err = await stream_error(scheduler, certs_dir, *messages)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (err.details() or "")
    node = scheduler.registry.get("node-1")
    if messages[0].WhichOneof("body") == "register" and needle not in REFUSED_REGISTRATIONS:
        # Registered before the bad message: nothing that came with or after it was recorded.
        assert node is not None
        assert node.reports == {} and node.holds == {} and node.volumes == {}
    else:
        assert node is None  # never registered


async def test_agent_stream_needs_an_agent_certificate(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    channel, api = stub(scheduler, certs_dir, "admin", "admin")
    async with channel:
        call = api.Connect()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            # The write itself may fail: the scheduler can refuse before it is sent.
            await call.write(register())
            await call.read()
            await call.code()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert scheduler.registry.get("admin") is None


async def test_controller_apis_refuse_agents(scheduler: Scheduler, certs_dir: Path) -> None:
    channel, api = stub(scheduler, certs_dir, "agent", "node-1")
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await api.Place(apb.PlaceRequest())
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role agent may not call this API" in (info.value.details() or "")


async def test_node_name_comes_from_the_certificate(scheduler: Scheduler, certs_dir: Path) -> None:
    channel, api = stub(scheduler, certs_dir, "agent", "node-2")
    async with channel:
        call = api.Connect()
        await call.write(register())
        reply = await call.read()
        assert reply.registered.node == "node-2"
        assert scheduler.registry.get("node-2") is not None
        call.cancel()


async def test_a_batch_is_applied_message_by_message(scheduler: Scheduler, certs_dir: Path) -> None:
    channel, api = stub(scheduler, certs_dir, "agent", "node-3")
    async with channel:
        call = api.Connect()
        await call.write(register())
        await call.read()
        running = apb.InstanceStatus(name="web-1", workload="web", phase=pb.Instance.RUNNING)
        await call.write(batch(heartbeat(), apb.AgentMessage(instance_status=running)))
        node = scheduler.registry.get("node-3")
        assert node is not None
        for _ in range(200):
            if "web-1" in node.reports:
                break
            await asyncio.sleep(0.01)
        assert node.reports["web-1"].phase.value == "RUNNING"
        call.cancel()


def registering(**node: object) -> apb.AgentMessage:
    """register() with fields of its NodeInfo replaced."""
    msg = register()
    info = msg.register.node
    for field, value in node.items():
        if field == "drivers":
            del info.drivers[:]
            info.drivers.extend(value)  # type: ignore[arg-type]
        elif field == "labels":
            info.labels.update(value)  # type: ignore[arg-type]
        else:
            getattr(info, field).CopyFrom(value)
    return msg


@pytest.mark.parametrize(
    ("node", "code", "message"),
    [
        (
            {"capacity": pb.Resources(cpu_millis=-1, memory_bytes=1)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.capacity must not be negative",
        ),
        (
            {"capacity": pb.Resources(cpu_millis=1, memory_bytes=-1)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.capacity must not be negative",
        ),
        (
            {"allocatable": pb.Resources(cpu_millis=-1, memory_bytes=1)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.allocatable must not be negative",
        ),
        (
            {"allocatable": pb.Resources(cpu_millis=1, memory_bytes=-1)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.allocatable must not be negative",
        ),
        (
            {"drivers": [f"d{i}" for i in range(17)]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.drivers: at most 16, got 17",
        ),
        (
            {"drivers": ["fake", "x" * 65]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.drivers[1]: is 65 characters long, over the limit of 64",
        ),
        (
            {"labels": {f"orka.io/k{i}": "v" for i in range(7)}},
            grpc.StatusCode.PERMISSION_DENIED,
            # The first five keys only.
            "register: node.labels 'orka.io/k0', 'orka.io/k1', 'orka.io/k2', 'orka.io/k3',"
            " 'orka.io/k4': the orka.io/ prefix is set by the scheduler only",
        ),
        (
            {"labels": {f"k{i}": "v" for i in range(65)}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.labels: at most 64, got 65",
        ),
        (
            {"labels": {"zone": "a\0"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "register: node.labels['zone']: contains a NUL byte",
        ),
    ],
)
async def test_a_refused_registration_says_exactly_why(
    scheduler: Scheduler,
    certs_dir: Path,
    node: dict[str, object],
    code: grpc.StatusCode,
    message: str,
) -> None:
    err = await stream_error(scheduler, certs_dir, registering(**node))
    assert (err.code(), err.details()) == (code, message)
    assert scheduler.registry.get("node-1") is None


@pytest.mark.parametrize(
    ("seconds", "nanos", "message"),
    [
        (-1, 0, "register: heartbeat_interval must not be negative, got -1s"),
        (0, -5, "register: heartbeat_interval must not be negative, got -5e-09s"),
        (
            1,
            -1,
            "register: heartbeat_interval: not a valid Duration (seconds 1, nanos -1: nanos must"
            " be within ±999,999,999 and have the sign of seconds)",
        ),
    ],
)
async def test_a_registration_with_a_bad_heartbeat_interval_is_refused(
    scheduler: Scheduler, certs_dir: Path, seconds: int, nanos: int, message: str
) -> None:
    msg = register()
    msg.register.heartbeat_interval.seconds = seconds
    msg.register.heartbeat_interval.nanos = nanos
    err = await stream_error(scheduler, certs_dir, msg)
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert scheduler.registry.get("node-1") is None


async def test_a_registration_at_every_limit_is_accepted(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    """64 labels, 16 drivers of 64 characters, zero resources: each limit itself is allowed."""
    zero = pb.Resources(cpu_millis=0, memory_bytes=0)
    labels = {f"k{i}": "v" for i in range(64)}
    drivers = [f"{i:02d}" + "d" * 62 for i in range(16)]
    msg = registering(capacity=zero, allocatable=zero, labels=labels, drivers=drivers)
    channel, api = stub(scheduler, certs_dir, "agent", "node-1")
    async with channel:
        call = api.Connect()
        await call.write(msg)
        reply = await call.read()
        assert reply.WhichOneof("body") == "registered"
        node = scheduler.registry.get("node-1")
        assert node is not None
        assert node.labels == {**labels, "orka.io/node": "node-1"}
        assert node.drivers == frozenset(drivers)
        call.cancel()


async def test_an_error_right_after_registering_still_ends_the_stream_with_it(
    scheduler: Scheduler,
) -> None:
    """The agent's bad message is read before the stream sends the Registered reply: the
    reply and the end of the stream leave in one drain of the outbox, and the stream still
    ends with the error. Driven below gRPC (the handler itself, fed from a generator that
    never waits), since over the wire which comes first is up to the scheduling."""

    async def agent() -> AsyncIterator[apb.AgentMessage]:
        yield register()
        yield apb.AgentMessage()

    handler = Scheduler.Connect.__wrapped__  # type: ignore[attr-defined]
    got: list[str] = []
    with pytest.raises(Invalid) as info:
        async for msg in handler(scheduler, agent(), Identity("agent", "node-1")):
            got.append(msg.WhichOneof("body"))
    assert info.value.message == "empty agent message"
    assert got == ["registered"]
    node = scheduler.registry.get("node-1")
    assert node is not None and node.session is None
