"""Placement: N nodes, W workloads x R replicas; placements/s to SCHEDULED and RUNNING.

A real controller and scheduler (each its own OS process) and N simulated agents (the real
Agent with the fake driver, spread over a few OS processes). The benchmark subscribes to the
controller's events (WatchEventBatches; `--watch events` for WatchEvents, one event per
message), creates every workload at once, and times each instance from the
CreateWorkload call of its workload to when the controller recorded it SCHEDULED and RUNNING
(the `time` of those events, stamped when the change is stored). Also given: when the RUNNING
event reached this subscriber, which adds the event stream's own backlog under load.

    .venv/bin/python bench/bench_placement.py [--nodes 1000 --workloads 100 --replicas 100]
    .venv/bin/python bench/bench_placement.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.common import (
    CpuSampler,
    Services,
    admin_channel,
    certs_dir,
    emit,
    free_port,
    percentile,
    start_agents,
    table,
    wait_nodes_ready,
    wait_port,
    workdir,
)
from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.store.factory import open_store


def etcd_available() -> str | None:
    """None when this build's store factory accepts etcd:// and an etcd binary exists."""
    try:
        open_store("etcd://127.0.0.1:2379", Path("/nonexistent"))
    except Exception as err:  # Invalid in builds without the backend
        return str(err)
    if shutil.which("etcd") is None:
        return "no etcd binary on PATH"
    return None


@contextlib.contextmanager
def etcd_server(work: Path) -> Iterator[str]:
    """A throwaway single-member etcd on free ports; yields its store URL."""
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            "etcd",
            "--data-dir",
            str(work / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "etcd.log", "wb"),
    )
    try:
        wait_port(client, proc)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(10)


class Tracker:
    """Follows the controller's events: when each instance was first seen bound and RUNNING.

    `batched`: through WatchEventBatches (several events per message when they pile up)
    rather than WatchEvents (one per message). The events are the same; this process runs on
    the same 2 cores as the cluster, and one message per event cost it about 0.25 of a core
    through the burst."""

    def __init__(self, stub: pb_grpc.ControllerStub, batched: bool = True) -> None:
        self.stub = stub
        self.batched = batched
        self.created: dict[str, float] = {}  # workload -> when CreateWorkload was called
        # When the controller recorded each instance bound and RUNNING (the events' time) ...
        self.scheduled: dict[str, float] = {}
        self.running: dict[str, float] = {}
        # ... and when the RUNNING event reached this subscriber.
        self.delivered: dict[str, float] = {}
        self.expected = 0
        # Nodes the controller saw leave READY while the benchmark ran: a scheduler too busy
        # placing to read heartbeats would show here (the heartbeat benchmark's figure, under
        # placement load).
        self.not_ready: set[str] = set()
        self.done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._watch(ready))
        await ready.wait()
        await asyncio.sleep(0.3)  # let the subscription land before the first event

    async def _watch(self, ready: asyncio.Event) -> None:
        if self.batched:
            batches = self.stub.WatchEventBatches(pb.WatchEventsRequest())
            ready.set()
            async for batch in batches:
                for ev in batch.events:
                    self._seen(ev)
        else:
            stream = self.stub.WatchEvents(pb.WatchEventsRequest())
            ready.set()
            async for ev in stream:
                self._seen(ev)
        # The controller cuts off a subscriber that falls too far behind.
        raise RuntimeError("the event stream ended before every instance ran")

    def _seen(self, ev: pb.Event) -> None:
        if ev.HasField("node"):
            if ev.node.state != pb.Node.READY:
                self.not_ready.add(ev.node.name)
            return
        if not ev.HasField("instance"):
            return
        inst = ev.instance
        seen = ev.event_time.seconds + ev.event_time.nanos / 1e9
        if inst.node and inst.name not in self.scheduled:
            self.scheduled[inst.name] = seen
        if inst.phase == pb.Instance.RUNNING and inst.name not in self.running:
            self.running[inst.name] = seen
            self.delivered[inst.name] = time.time()
            if len(self.running) >= self.expected:
                self.done.set()

    async def create(self, name: str, replicas: int) -> None:
        self.expected += replicas
        self.done.clear()
        self.created[name] = time.time()  # wall clock, like the events' time
        await self.stub.CreateWorkload(
            pb.CreateWorkloadRequest(
                spec=pb.WorkloadSpec(
                    name=name,
                    kind=pb.WorkloadSpec.PROCESS,
                    command=["sleep", "infinity"],
                    replicas=replicas,
                    resources=pb.Resources(cpu_millis=SPEC_CPU, memory_bytes=SPEC_MEMORY),
                )
            )
        )

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.done.wait()
        if self._task is not None and self._task.done() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]

    def latencies(self, prefix: str, delivered: bool = False) -> list[float]:
        times = self.delivered if delivered else self.running
        return [
            t - self.created[name.rsplit("-", 1)[0]]
            for name, t in times.items()
            if name.startswith(prefix)
        ]

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


SPEC_CPU, SPEC_MEMORY = 100, 64 << 20


async def run_once(
    certs: Path,
    services: Services,
    workloads: int,
    replicas: int,
    timeout: float,
    paced_rate: float,
    paced_seconds: float,
    agent_pids: list[int],
    batched: bool,
) -> dict[str, float]:
    total = workloads * replicas
    channel = admin_channel(certs, services.controller)
    tracker = Tracker(pb_grpc.ControllerStub(channel), batched)
    await tracker.start()
    try:
        with (
            CpuSampler(services.pid("scheduler")) as sched_cpu,
            CpuSampler(services.pid("controller")) as ctl_cpu,
            contextlib.ExitStack() as stack,
        ):
            # The rest of the machine: simulated agents and this process (the subscriber).
            agents_cpu = [stack.enter_context(CpuSampler(pid)) for pid in agent_pids]
            own_cpu = stack.enter_context(CpuSampler(os.getpid()))
            start = time.time()
            await asyncio.gather(
                *(tracker.create(f"wl-{i:03d}", replicas) for i in range(workloads))
            )
            await tracker.wait(timeout)
        running = dict(tracker.running)
        if not running:
            raise RuntimeError(f"no instance RUNNING after {timeout}s")
        lat = tracker.latencies("wl-")
        seen = tracker.latencies("wl-", delivered=True)
        sched_end = max(tracker.scheduled.values()) - start
        run_end = max(running.values()) - start
        complete = len(running) >= total
        # A run that timed out still reports its rates, over what it got done.
        result: dict[str, float] = {
            "instances": total,
            "running_reached": len(running),
            "complete": complete,
            "scheduled_per_s": round(len(tracker.scheduled) / sched_end, 1),
            "running_per_s": round(len(running) / run_end, 1),
            "seconds_to_all_running": round(run_end, 2) if complete else None,
            "p50_create_to_running_s": round(percentile(lat, 50), 3),
            "p99_create_to_running_s": round(percentile(lat, 99), 3),
            "p50_create_to_running_delivered_s": round(percentile(seen, 50), 3),
            "p99_create_to_running_delivered_s": round(percentile(seen, 99), 3),
            "scheduler_cpu_share": round(sched_cpu.cpu_share, 3),
            "controller_cpu_share": round(ctl_cpu.cpu_share, 3),
            "agents_cpu_share": round(sum(c.cpu_share for c in agents_cpu), 3),
            "bench_process_cpu_share": round(own_cpu.cpu_share, 3),
            "nodes_not_ready_seen": len(tracker.not_ready),
        }
        if complete and paced_rate > 0:
            result.update(await paced(tracker, paced_rate, paced_seconds, timeout))
        return result
    finally:
        tracker.stop()
        await channel.close()


async def paced(tracker: Tracker, rate: float, seconds: float, timeout: float) -> dict[str, float]:
    """Latency when instances arrive steadily instead of all at once: small workloads
    created at `rate` instances/s for `seconds`, on the cluster the burst filled."""
    per_workload = max(1, round(rate / 10))
    count = max(1, round(rate * seconds / per_workload))
    gap = per_workload / rate
    loop = asyncio.get_running_loop()
    first = loop.time()
    creates = []
    for i in range(count):
        await asyncio.sleep(max(0.0, first + i * gap - loop.time()))
        creates.append(asyncio.create_task(tracker.create(f"paced-{i:04d}", per_workload)))
    await asyncio.gather(*creates)
    await tracker.wait(timeout)
    lat = tracker.latencies("paced-")
    seen = tracker.latencies("paced-", delivered=True)
    return {
        "paced_rate_per_s": rate,
        "paced_instances": count * per_workload,
        "paced_running_reached": len(lat),
        "paced_p50_create_to_running_s": round(percentile(lat, 50), 3),
        "paced_p99_create_to_running_s": round(percentile(lat, 99), 3),
        "paced_p99_create_to_running_delivered_s": round(percentile(seen, 99), 3),
    }


def run(
    nodes: int,
    workloads: int,
    replicas: int,
    processes: int,
    store: str = "",
    timeout: float = 100.0,
    paced_rate: float = 0.0,
    paced_seconds: float = 10.0,
    batched: bool = True,
) -> dict[str, float]:
    certs = certs_dir(nodes)
    with workdir("placement") as work:
        services = Services(certs, work, store=store).start()
        hosts = []
        try:
            # Each node offers room for 2.5x its share (of the burst and the paced phase), so
            # placement is never capacity-bound.
            per_node = -(-(workloads * replicas + int(paced_rate * paced_seconds)) // nodes)
            hosts = start_agents(
                certs,
                services.scheduler,
                nodes,
                work,
                processes,
                cpu_millis=max(1000, per_node * 250),
                memory_bytes=max(1 << 30, per_node * (160 << 20)),
            )

            async def go() -> dict[str, float]:
                channel = admin_channel(certs, services.controller)
                await wait_nodes_ready(pb_grpc.ControllerStub(channel), nodes)
                await channel.close()
                return await run_once(
                    certs,
                    services,
                    workloads,
                    replicas,
                    timeout,
                    paced_rate,
                    paced_seconds,
                    [h.proc.pid for h in hosts],
                    batched,
                )

            return asyncio.run(go())
        except grpc.aio.AioRpcError as err:
            raise RuntimeError(f"{err.code().name}: {err.details()}") from None
        finally:
            for h in hosts:
                h.stop()
            services.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--workloads", type=int, default=100)
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--processes", type=int, default=4, help="OS processes for the agents")
    p.add_argument("--no-etcd", action="store_true", help="skip the etcd variant")
    p.add_argument(
        "--paced-rate",
        type=float,
        default=1000.0,
        help="after the burst: instances/s created steadily, for latency at that rate (0: off);"
        " the default is the placement target's rate",
    )
    p.add_argument("--paced-seconds", type=float, default=10.0)
    p.add_argument(
        "--watch",
        choices=("batches", "events"),
        default="batches",
        help="how this process follows the controller: WatchEventBatches or WatchEvents",
    )
    p.add_argument("--smoke", action="store_true", help="20 nodes, 10 x 20 instances")
    args = p.parse_args(argv)
    if args.smoke:
        args.nodes, args.workloads, args.replicas, args.processes = 20, 10, 20, 2
        args.paced_rate, args.paced_seconds = 20.0, 2.0

    result: dict[str, object] = {
        "bench": "placement",
        "nodes": args.nodes,
        "workloads": args.workloads,
        "replicas": args.replicas,
        "watch": args.watch,
    }
    batched = args.watch == "batches"
    sqlite = run(
        args.nodes,
        args.workloads,
        args.replicas,
        args.processes,
        paced_rate=args.paced_rate,
        paced_seconds=args.paced_seconds,
        batched=batched,
    )
    result["sqlite"] = sqlite
    table(
        f"placement, SQLite store: {args.nodes} nodes, "
        f"{args.workloads} workloads x {args.replicas} replicas",
        list(sqlite.items()),
    )
    why = etcd_available()
    if args.no_etcd or args.smoke:
        why = "skipped (--no-etcd or --smoke)"
    if why is None:
        try:
            with workdir("etcd") as work, etcd_server(work) as url:
                etcd = run(
                    args.nodes,
                    args.workloads,
                    args.replicas,
                    args.processes,
                    url,
                    timeout=90,
                    batched=batched,
                )
        except Exception as err:
            # The etcd backend is new; its failure is a figure to report, not a crash.
            result["etcd"] = {"error": str(err)}
            print(f"\netcd: failed: {err}")
        else:
            result["etcd"] = etcd
            table("placement, etcd store (a local single-member etcd)", list(etcd.items()))
    else:
        result["etcd"] = None
        print(f"\netcd: not available in this build ({why})")
    emit(result)


if __name__ == "__main__":
    main()
