"""Fenced controller writes, end to end: real processes, real signals, a real etcd.

* A leading controller is SIGSTOPped with creates queued at it; the standby takes over and
  writes; the first one, resumed, lands none of them (proved on etcd's revision history, not
  on the API) and steps down on its own.
* SQLite: a second controller on the same data dir is refused at start, naming the holder; a
  SIGKILLed holder does not block the restart.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.errors import NotLeader, from_rpc_error
from orka.store import EtcdStore, WatchEvent
from tests.e2e.procs import ProcessCluster, free_port, nodes_ready, sleep_spec
from tests.etcd import EtcdCluster
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

# Creates sent to the paused leader: several, so that an unfenced leader lands some before it
# notices its lease is gone (its keep-alive needs a round trip to etcd to find out).
QUEUED = 12


spec = sleep_spec


async def leads(c: ProcessCluster) -> bool:
    await c.nodes()  # UNAVAILABLE unless this controller leads
    return True


async def running(c: ProcessCluster, workload: str, n: int) -> bool:
    return len(await c.running(workload)) == n


async def history(store: EtcdStore, kind: str, since: int, until: int) -> list[WatchEvent]:
    """Every change to keys of `kind` at revisions since..until, from etcd's own history."""
    events: list[WatchEvent] = []
    if since > until:
        return events
    # A marker write at `until` or later ends the replay: watches see every kind's revision.
    it = store.watch(kind, start_revision=since)
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(it), 2.0)
            except TimeoutError:
                return events  # nothing more up to now
            if event.revision > until:
                return events
            events.append(event)
    finally:
        await it.aclose()  # type: ignore[attr-defined]


async def test_a_resumed_sigstopped_leader_lands_nothing_and_steps_down(
    fake_cluster: ProcessCluster, etcd: EtcdCluster, etcd_prefix: str
) -> None:
    c = fake_cluster
    nodes = ["node-1", "node-2"]
    port_a, port_b = c.controller_port, free_port()
    c.start_scheduler()
    leader = c.start_controller("controller-a", port_a)
    await c.connect(port_a)
    await eventually(lambda: leads(c), timeout=30)
    c.start_controller("controller-b", port_b)
    for n in nodes:
        c.start_agent(n)
    await eventually(lambda: nodes_ready(c, nodes), timeout=30)
    assert c.api is not None
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("before", 2)), timeout=10)
    await eventually(lambda: running(c, "before", 2), timeout=30)

    async with EtcdStore(etcd.endpoints, etcd_prefix) as store:
        held = await store.get("leader", "controller")
        assert held is not None and held.value["id"] == f"127.0.0.1:{port_a}"
        leader.signal(signal.SIGSTOP)
        stopped_at = await store.revision()

        # Writes queued at the paused leader: its connection is up, the requests wait in its
        # socket until it runs again, past its lease, with a successor in charge.
        api_a = c.api
        queued = [
            asyncio.ensure_future(
                api_a.CreateWorkload(
                    pb.CreateWorkloadRequest(spec=spec(f"stale-{i}", 1)), timeout=90
                )
            )
            for i in range(QUEUED)
        ]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in queued)

        # The standby takes over once A's lease expires, and writes.
        c_b = ProcessCluster(c.certs, c.data)
        await c_b.connect(port_b)
        try:
            await eventually(lambda: leads(c_b), timeout=30, interval=0.1)
            successor = await store.get("leader", "controller")
            assert successor is not None and successor.value["id"] == f"127.0.0.1:{port_b}"
            assert c_b.api is not None
            await c_b.api.CreateWorkload(
                pb.CreateWorkloadRequest(spec=spec("fresh", 1)), timeout=10
            )
            await eventually(lambda: running(c_b, "fresh", 1), timeout=30)

            leader.signal(signal.SIGCONT)
            results = await asyncio.gather(*queued, return_exceptions=True)
            # Every queued write was refused as "not the leader" (by the gate if A already knew,
            # by its fence if not); none was acknowledged.
            for result in results:
                assert isinstance(result, grpc.aio.AioRpcError), f"a stale create landed: {result}"
                assert isinstance(from_rpc_error(result), NotLeader), result

            # A stepped down on its own and names B as the leader.
            async def follows_b() -> bool:
                try:
                    await c.nodes()
                except grpc.aio.AioRpcError as err:
                    error = from_rpc_error(err)
                    return isinstance(error, NotLeader) and error.leader == f"127.0.0.1:{port_b}"
                return False

            await eventually(follows_b, timeout=20)
            # B still leads, with its own write and A's earlier one intact.
            assert len(await c_b.running("fresh")) == 1
            assert len(await c_b.running("before")) == 2
            ended_at = await store.revision()
        finally:
            await c_b.close()

        # The store's own record: from the stop on, nothing of the queued writes at any revision,
        # and B's key was never removed or replaced after it won.
        events = {
            kind: await history(store, kind, stopped_at + 1, ended_at)
            for kind in ("workloads", "instances", "leader")
        }
    stale = [
        (e.kind, e.name, e.revision)
        for kind in ("workloads", "instances")
        for e in events[kind]
        if e.name.startswith("stale-")
    ]
    assert not stale, f"writes of the fenced leader reached the store: {stale}"
    assert any(e.name == "fresh" for e in events["workloads"]), "history read nothing"
    leader_events = [(e.revision, e.value and e.value["id"]) for e in events["leader"]]
    assert leader_events[-1] == (successor.revision, f"127.0.0.1:{port_b}"), leader_events
    log_a = (c.data / "controller-a.log").read_text(errors="replace")
    assert "write fenced" in log_a or "lease lost" in log_a


async def test_a_second_controller_on_one_sqlite_data_dir_is_refused(
    certs_dir: Path, tmp_path: Path
) -> None:
    c = ProcessCluster(certs_dir, tmp_path)
    shared = ["--data-dir", str(tmp_path / "shared")]
    try:
        first = c.start_controller("controller-1", c.controller_port, *shared)
        await c.connect()
        await eventually(lambda: leads(c), timeout=30)
        await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("kept", 1)), timeout=10)  # type: ignore[union-attr]

        second = c.start_controller("controller-2", free_port(), *shared)
        assert await asyncio.to_thread(second.wait, 30) == 1
        out = (tmp_path / "controller-2.log").read_text()
        db = tmp_path / "shared" / "orka.db"
        assert f"error: store {db} is in use by another controller (pid {first.pid}," in out
        # The holder was not disturbed.
        assert await leads(c)

        # A SIGKILLed holder leaves no lock behind: the restart opens the same store.
        first.signal(signal.SIGKILL)
        first.wait(10)
        c.start_controller("controller-3", c.controller_port, *shared)
        await c.connect()
        await eventually(lambda: leads(c), timeout=30)
        got = await c.api.GetWorkload(pb.GetWorkloadRequest(name="kept"), timeout=10)  # type: ignore[union-attr]
        assert got.spec.replicas == 1
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
