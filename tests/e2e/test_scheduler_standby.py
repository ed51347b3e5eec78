"""A standby scheduler end to end: real etcd, two `orka scheduler --store` processes, one
controller and three `--runtime fake` agents given both addresses, as separate OS processes.

One scenario walks the steps: the standby answers NOT_LEADER naming the active one (and its
health says NOT_SERVING); then, with a loop creating workloads, the active scheduler is
SIGKILLed. Placement resumes through the standby, no instance is restarted or moved, and no
node passes through NOT_READY or LOST: the controller's event stream, watched from before the
kill to the end, carries no such node state and no LOST instance.

The failover time (kill -> every agent registered at the standby, and a new workload RUNNING)
is printed, never asserted (run with -s).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.errors import NotLeader, from_rpc_error
from orka.rpc.client import secure_channel
from orka.security.tls import TlsFiles
from tests.e2e.procs import ProcessCluster, free_port, nodes_ready
from tests.e2e.test_crash_recovery import files_agree, settled, spec
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

SCHEDULER = "orka.v1.Scheduler"


def controller_tls(certs: Path) -> TlsFiles:
    return TlsFiles.for_service(certs, "controller", "controller")


async def health(certs: Path, address: str) -> int:
    async with secure_channel(address, controller_tls(certs), "scheduler") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SCHEDULER), timeout=5)
        return int(reply.status)


async def serving(certs: Path, address: str) -> bool:
    return await health(certs, address) == health_pb2.HealthCheckResponse.SERVING


async def place_refusal(certs: Path, address: str) -> NotLeader:
    """What the scheduler at `address` answers a controller's Place: it must refuse."""
    async with secure_channel(address, controller_tls(certs), "scheduler") as channel:
        stub = apb_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Place(apb.PlaceRequest(), timeout=5)
    err = from_rpc_error(caught.value)
    assert isinstance(err, NotLeader), f"{caught.value.code()}: {caught.value.details()}"
    return err


async def connect_refusal(certs: Path, address: str, node: str) -> NotLeader:
    """What the scheduler at `address` answers an agent's stream: it must refuse before it
    registers the node."""
    tls = TlsFiles.for_service(certs, "agent", node)
    async with secure_channel(address, tls, "scheduler") as channel:
        call = apb_grpc.SchedulerStub(channel).Connect(timeout=5)
        await call.write(apb.AgentMessage(register=apb.Register(node=apb.NodeInfo())))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    err = from_rpc_error(caught.value)
    assert isinstance(err, NotLeader), f"{caught.value.code()}: {caught.value.details()}"
    return err


class EventLog:
    """Every node and instance event of the controller's WatchEvents stream, kept in order."""

    def __init__(self, c: ProcessCluster) -> None:
        self.c = c
        self.events: list[pb.Event] = []
        self.connected = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        assert self.c.api is not None
        # Set at the first event: the stream is open from then on (the loader's creates).
        async for event in self.c.api.WatchEvents(pb.WatchEventsRequest()):
            self.events.append(event)
            self.connected.set()

    def bad_nodes(self) -> list[tuple[str, str]]:
        return [
            (e.node.name, pb.Node.State.Name(e.node.state))
            for e in self.events
            if e.WhichOneof("object") == "node" and e.node.state != pb.Node.READY
        ]

    def lost_instances(self) -> list[str]:
        """Instances marked LOST, or DISCONNECTED (a `wait` workload's node lost)."""
        gone = (pb.Instance.LOST, pb.Instance.DISCONNECTED)
        return [
            e.instance.name
            for e in self.events
            if e.WhichOneof("object") == "instance" and e.instance.phase in gone
        ]

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        if self.task.done() and not self.task.cancelled() and self.task.exception():
            raise self.task.exception()  # type: ignore[misc]


async def test_active_scheduler_sigkill_under_load_fails_over_to_the_standby(
    fake_cluster: ProcessCluster,
) -> None:
    c = fake_cluster
    nodes = ["node-1", "node-2", "node-3"]
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    c.scheduler_addrs = [a, b]
    store = ["--store", c.store_url]
    active = c.start_scheduler(*store, "--advertise", a, name="scheduler-a", address=a)
    await eventually(lambda: serving(c.certs, a), timeout=30)
    c.start_scheduler(*store, "--advertise", b, name="scheduler-b", address=b)
    # The standby is up (it answers health) but does not serve, and says who does.
    await eventually(lambda: health(c.certs, b), timeout=30)  # type: ignore[arg-type]
    assert await health(c.certs, b) == health_pb2.HealthCheckResponse.NOT_SERVING
    refusal = await place_refusal(c.certs, b)
    assert refusal.leader == a
    assert (await connect_refusal(c.certs, b, "node-1")).leader == a

    c.start_controller()
    for n in nodes:
        c.start_agent(n)
    await c.connect()
    await eventually(lambda: nodes_ready(c, nodes), timeout=40)
    assert c.api is not None
    api = c.api

    workloads = {f"svc{i}": 4 for i in range(3)}
    for name, n in workloads.items():
        await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(name, n)), timeout=10)
    before_by, _ = await files_agree(c, nodes, workloads, timeout=30)
    before = {i.name: (i.node, i.restarts, i.start_time) for v in before_by.values() for i in v}
    assert len(before) == 12 and all(r == 0 for _, r, _ in before.values())

    events = EventLog(c)
    await asyncio.sleep(0.5)  # the stream opens before the first create

    # Placement load: a workload created every 0.2 s, before, across and after the kill.
    created: dict[str, int] = {}
    # Stopped between creates, never during one: a create cancelled after the controller took
    # it would leave a workload running that `created` does not list.
    stop_loading = asyncio.Event()

    async def load() -> None:
        i = 0
        while not stop_loading.is_set():
            name = f"load{i}"
            try:
                await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(name, 2)), timeout=10)
            except grpc.aio.AioRpcError as err:  # the API stays up: nothing should fail
                raise AssertionError(f"create {name}: {err.code()} {err.details()}") from None
            created[name] = 2
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_loading.wait(), 0.2)

    loader = asyncio.create_task(load())
    await asyncio.wait_for(events.connected.wait(), 10)
    await eventually(lambda: settled(c, {**workloads, "load0": 2, "load1": 2}), timeout=30)

    active.signal(signal.SIGKILL)
    killed_wall, killed = time.time(), time.monotonic()
    active.wait(10)
    await asyncio.sleep(0)
    at_kill = len(created)

    async def reregistered() -> bool:
        if not await serving(c.certs, b):
            return False
        listed = {n.name: n for n in (await api.ListNodes(pb.ListNodesRequest(), timeout=5)).nodes}
        return all(
            listed[n].state == pb.Node.READY
            and listed[n].last_heartbeat_time.ToNanoseconds() >= killed_wall * 1e9
            for n in nodes
        )

    await eventually(reregistered, timeout=60)
    back = time.monotonic() - killed
    # Placement resumes through the standby: a workload created after the kill runs.
    await eventually(lambda: _created_after(created, at_kill), timeout=30)
    first_after = f"load{at_kill}"
    await eventually(lambda: settled(c, {**workloads, first_after: 2}), timeout=60)
    placed = time.monotonic() - killed
    stop_loading.set()
    await asyncio.wait_for(loader, 15)
    print(
        f"\nstandby failover: agents at the standby {back:.2f}s, "
        f"a workload created after the kill running {placed:.2f}s"
    )

    everything = {**workloads, **created}
    by, _ = await files_agree(c, nodes, everything, timeout=60)
    after = {i.name: (i.node, i.restarts, i.start_time) for v in by.values() for i in v}
    for name, was in before.items():
        assert after.get(name) == was, f"{name}: {was} before the kill, {after.get(name)} after"
    assert all(i.restarts == 0 for v in by.values() for i in v)
    await asyncio.sleep(1.0)  # the last events reach the watcher
    await events.close()
    assert not events.bad_nodes(), f"nodes left READY across the failover: {events.bad_nodes()}"
    assert not events.lost_instances(), f"instances LOST: {events.lost_instances()}"
    assert len(created) > at_kill


async def _created_after(created: dict[str, int], at_kill: int) -> bool:
    return len(created) > at_kill
