"""Recovery: scheduler SIGKILL + restart, controller failover, etcd writes per placement.

A real etcd, a scheduler and two controllers (own OS processes; the controllers share the
etcd store and elect a leader), and N simulated agents with the fake driver in a few OS
processes (`agent_host.py`). Per size N:

* etcd writes per placement: etcd's revision (bumped once per write transaction) before and
  after placing N/2 instances until all RUNNING, divided by the instances;
* scheduler recovery: SIGKILL the scheduler, start it again on the same port; time until every
  agent has re-registered (READY with a heartbeat after the restart, as the controller sees it),
  and until a new one-replica workload runs (placement resumed);
* controller failover: SIGKILL the leading controller; time until the standby answers
  ListInstances (bounded below by the election lease, 5 s).

With `--standby`, each size is also run on a second cluster with two schedulers sharing the
etcd store (`orka scheduler --store`, agents and controller given both addresses): SIGKILL the
active one, no restart; time until every agent has registered at the standby, and until a new
workload runs. Reported beside the restart figures, with how many nodes the controller ever
saw leave READY meanwhile (its WatchEvents stream; 0 is the goal).

    .venv/bin/python bench/bench_recovery.py [--sizes 100,1000] [--standby]
    .venv/bin/python bench/bench_recovery.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.bench_placement import Tracker, etcd_server
from bench.common import (
    AgentHost,
    Services,
    admin_channel,
    certs_dir,
    cpu_totals,
    emit,
    free_port,
    start_agents,
    table,
    wait_nodes_ready,
    wait_port,
    workdir,
)
from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.rpc import backoff
from orka.rpc.pages import list_all
from orka.store.etcd import EtcdStore

AGENTS_PER_PROCESS = 250
MAX_REPLICAS = 1000  # the API's bound on one workload's replicas


def spec(name: str, replicas: int) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "infinity"],
        replicas=replicas,
        resources=pb.Resources(cpu_millis=100, memory_bytes=64 << 20),
    )


async def poll(check: Any, timeout: float, interval: float = 0.05) -> float:
    """Seconds until `check()` is truthy (RPC errors count as not yet)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if await check():
                return time.monotonic() - start
        except Exception:
            pass
        await asyncio.sleep(interval)
    raise RuntimeError(f"not within {timeout}s")


async def create_base(stub: Any, instances: int) -> None:
    """`instances` running instances to begin with, in workloads of at most MAX_REPLICAS."""
    for i, start in enumerate(range(0, instances, MAX_REPLICAS)):
        replicas = min(MAX_REPLICAS, instances - start)
        await stub.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(f"base-{i}", replicas)))


async def running(stub: Any, workload: str, count: int) -> bool:
    """Whether `count` instances of `workload` (of every workload: "") are RUNNING."""
    items, _ = await list_all(
        functools.partial(stub.ListInstances, timeout=10),
        pb.ListInstancesRequest(workload=workload),
        "instances",
    )
    return sum(1 for i in items if i.phase == pb.Instance.RUNNING) >= count


async def registrations(hosts: list[AgentHost]) -> tuple[int, int]:
    """(registrations so far, agents registered now), as the agent hosts count them."""
    answers = await asyncio.gather(*(asyncio.to_thread(h.ask, "stats") for h in hosts))
    return sum(int(a["registrations"]) for a in answers), sum(int(a["connected"]) for a in answers)


async def _registered_again(hosts: list[AgentHost], nodes: int, before: int) -> bool:
    """Whether every agent has registered again since `before` registrations (counted before
    the kill) and all are registered now: the scheduler's share of a recovery, before the
    controller's. Polled 20 times a second (the hosts answer from two counters), and from the
    kill on: a wait for every stream to be seen lost first polled faster, for seconds when some
    agents registered again before others had noticed, loading the hosts it measures."""
    done, now = await registrations(hosts)
    return done >= before + nodes and now >= nodes


def restart_scheduler(services: Services) -> None:
    proc = services.procs["scheduler"]
    args = list(proc.args)[3:]  # [python, -m, orka.cli.main, *args]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    services._spawn("scheduler", args)


async def measure(
    services: Services,
    certs: Path,
    store_url: str,
    nodes: int,
    standby: int,
    hosts: list[AgentHost],
) -> dict[str, Any]:
    channel = admin_channel(certs, services.controller)
    stub = pb_grpc.ControllerStub(channel)
    await wait_nodes_ready(stub, nodes, timeout=600)
    endpoints = store_url.removeprefix("etcd://").split(",")
    replicas = max(1, nodes // 2)
    async with EtcdStore(endpoints, "/orka") as etcd:
        rev0 = await etcd.revision()
        await create_base(stub, replicas)
        place_s = await poll(lambda: running(stub, "", replicas), 600, 0.2)
        writes = await etcd.revision() - rev0

    # Scheduler SIGKILL and restart, with every node event watched from before the kill.
    tracker = Tracker(stub)
    await tracker.start()
    before, _ = await registrations(hosts)
    restart_scheduler(services)
    restarted_wall, restarted = time.time(), time.monotonic()

    async def back() -> bool:
        listed, _ = await list_all(
            functools.partial(stub.ListNodes, timeout=10), pb.ListNodesRequest(), "nodes"
        )
        fresh = [
            n
            for n in listed
            if n.state == pb.Node.READY
            and n.last_heartbeat_time.ToNanoseconds() >= (restarted_wall - 0.2) * 1e9
        ]
        return len(fresh) >= nodes

    scheduler = psutil.Process(services.pid("scheduler"))
    cpu: dict[str, float] = {}

    async def since_restart(check: Any, interval: float, name: str) -> float:
        await poll(check, 600, interval)
        used = scheduler.cpu_times()
        cpu[name] = used.user + used.system
        return time.monotonic() - restarted

    listening = asyncio.create_task(
        since_restart(lambda: backoff.reachable(services.scheduler), 0.02, "listening")
    )

    async def registered_again() -> float:
        return await since_restart(
            lambda: _registered_again(hosts, nodes, before), 0.05, "registered"
        )

    # The controller's view is asked only once every agent has registered again, as the agent
    # hosts count them (it cannot be back before): listing thousands of nodes ten times a
    # second through the registrations loaded the controller beside what it measures.
    agents_registered = await registered_again()
    await poll(back, 600, 0.1)
    agents_back = time.monotonic() - restarted
    scheduler_listening = await listening
    await stub.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("probe", 1)))
    await poll(lambda: running(stub, "probe", 1), 120)
    placement_resumed = time.monotonic() - restarted
    await asyncio.sleep(1.0)  # events of the last moments still on their way
    tracker.stop()

    # Controller failover: SIGKILL the leader, time until the standby answers.
    services.procs["controller"].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    services.procs["controller"].wait(10)
    await channel.close()
    channel = admin_channel(certs, f"127.0.0.1:{standby}")
    stub = pb_grpc.ControllerStub(channel)
    await poll(lambda: stub.ListInstances(pb.ListInstancesRequest(workload="probe"), timeout=5), 60)
    failover = time.monotonic() - killed
    await channel.close()
    return {
        "agents": nodes,
        "instances_placed": replicas,
        "place_all_running_s": round(place_s, 2),
        "etcd_txns_per_placement": round(writes / replicas, 2),
        "scheduler_restart_to_listening_s": round(scheduler_listening, 2),
        "scheduler_restart_to_agents_registered_s": round(agents_registered, 2),
        "scheduler_restart_to_agents_back_s": round(agents_back, 2),
        # CPU seconds the new scheduler used to start, and then to take every agent back.
        "scheduler_cpu_start_s": round(cpu["listening"], 2),
        "scheduler_cpu_registrations_s": round(cpu["registered"] - cpu["listening"], 2),
        "scheduler_restart_to_placement_resumed_s": round(placement_resumed, 2),
        "scheduler_restart_nodes_not_ready_seen": len(tracker.not_ready),
        "controller_failover_s": round(failover, 2),
    }


async def agents_back(stub: Any, nodes: int, since_wall: float) -> bool:
    """Every node READY with a heartbeat after `since_wall`, as the controller sees it."""
    listed, _ = await list_all(
        functools.partial(stub.ListNodes, timeout=10), pb.ListNodesRequest(), "nodes"
    )
    fresh = [
        n
        for n in listed
        if n.state == pb.Node.READY and n.last_heartbeat_time.ToNanoseconds() >= since_wall * 1e9
    ]
    return len(fresh) >= nodes


async def measure_standby(
    services: Services, certs: Path, nodes: int, hosts: list[AgentHost]
) -> dict[str, Any]:
    channel = admin_channel(certs, services.controller)
    stub = pb_grpc.ControllerStub(channel)
    await wait_nodes_ready(stub, nodes, timeout=600)
    replicas = max(1, nodes // 2)
    await create_base(stub, replicas)
    await poll(lambda: running(stub, "", replicas), 600, 0.2)

    # Node state changes the controller writes, watched from before the kill.
    left_ready: set[str] = set()

    async def watch() -> None:
        async for event in stub.WatchEvents(pb.WatchEventsRequest()):
            if event.WhichOneof("object") == "node" and event.node.state != pb.Node.READY:
                left_ready.add(event.node.name)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.5)
    before, _ = await registrations(hosts)
    # CPU seconds each side spends from the kill until every agent has registered again: on
    # a shared host they spread less than the seconds on the clock.
    procs = {
        "scheduler": [psutil.Process(services.pid("scheduler-standby"))],
        "controller": [psutil.Process(services.pid("controller"))],
        "agents": [psutil.Process(h.proc.pid) for h in hosts],
    }
    cpu0 = cpu_totals(procs)
    active = services.procs["scheduler"]
    active.send_signal(signal.SIGKILL)
    killed_wall, killed = time.time(), time.monotonic()
    active.wait(10)

    async def registered_again() -> float:
        await poll(lambda: _registered_again(hosts, nodes, before), 600, 0.05)
        return time.monotonic() - killed

    # As in `measure`: the controller's view only once every agent has registered again.
    agents_registered = await registered_again()
    cpu = {k: v - cpu0[k] for k, v in cpu_totals(procs).items()}
    await poll(lambda: agents_back(stub, nodes, killed_wall), 600, 0.1)
    back = time.monotonic() - killed
    await stub.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("probe", 1)))
    await poll(lambda: running(stub, "probe", 1), 120)
    resumed = time.monotonic() - killed
    await asyncio.sleep(1.0)  # the last node events reach the watcher
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    await channel.close()
    return {
        "standby_failover_to_agents_registered_s": round(agents_registered, 2),
        "standby_failover_to_agents_back_s": round(back, 2),
        "standby_failover_to_placement_resumed_s": round(resumed, 2),
        "standby_failover_cpu_scheduler_s": round(cpu["scheduler"], 2),
        "standby_failover_cpu_controller_s": round(cpu["controller"], 2),
        "standby_failover_cpu_agents_s": round(cpu["agents"], 2),
        "standby_failover_nodes_left_ready": len(left_ready),
    }


def run_standby(nodes: int, election_ttl: int | None = None) -> dict[str, Any]:
    """The failover figures: two schedulers on the etcd store, the active one SIGKILLed."""
    certs = certs_dir(nodes)
    with workdir(f"standby-{nodes}") as work, etcd_server(work) as store_url:
        standby = f"127.0.0.1:{free_port()}"
        elect = ["--store", store_url]
        if election_ttl is not None:
            elect += ["--election-ttl", str(election_ttl)]
        services = Services(
            certs, work, scheduler_args=elect, store=store_url, more_schedulers=[standby]
        ).start()
        hosts = []
        try:
            port = int(standby.rsplit(":", 1)[1])
            services._spawn(
                "scheduler-standby",
                [
                    "scheduler",
                    "--listen",
                    standby,
                    "--data-dir",
                    str(work / "scheduler-standby"),
                    "--certs",
                    str(certs),
                    "--log-level",
                    os.environ.get("ORKA_BENCH_LOG_LEVEL", "warning"),
                    *elect,
                ],
            )
            wait_port(port, services.procs["scheduler-standby"])
            processes = max(1, -(-nodes // AGENTS_PER_PROCESS))
            both = f"{services.scheduler},{standby}"
            hosts = start_agents(certs, both, nodes, work, processes)
            return asyncio.run(measure_standby(services, certs, nodes, hosts))
        finally:
            for h in hosts:
                h.stop()
            services.stop()


def run(nodes: int) -> dict[str, Any]:
    certs = certs_dir(nodes)
    with workdir(f"recovery-{nodes}") as work, etcd_server(work) as store_url:
        services = Services(certs, work, store=store_url).start()
        hosts = []
        standby = free_port()
        try:
            services._spawn(
                "standby",
                [
                    "controller",
                    "--listen",
                    f"127.0.0.1:{standby}",
                    "--scheduler",
                    services.scheduler,
                    "--data-dir",
                    str(work / "standby"),
                    "--store",
                    store_url,
                    "--certs",
                    str(certs),
                    "--log-level",
                    "warning",
                ],
            )
            wait_port(standby, services.procs["standby"])
            processes = max(1, -(-nodes // AGENTS_PER_PROCESS))
            hosts = start_agents(certs, services.scheduler, nodes, work, processes)
            return asyncio.run(measure(services, certs, store_url, nodes, standby, hosts))
        finally:
            for h in hosts:
                h.stop()
            services.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000", help="agent counts, comma-separated")
    p.add_argument("--smoke", action="store_true", help="10 agents only")
    p.add_argument(
        "--standby",
        action="store_true",
        help="also measure failover to a standby scheduler (a second cluster per size)",
    )
    p.add_argument(
        "--standby-only", action="store_true", help="only the standby failover (no restart run)"
    )
    p.add_argument(
        "--election-ttl", type=int, default=None, help="the schedulers' --election-ttl (standby)"
    )
    args = p.parse_args(argv)
    sizes = [10] if args.smoke else [int(s) for s in args.sizes.split(",") if s.strip()]
    results = []
    for n in sizes:
        result = {"agents": n} if args.standby_only else run(n)
        if args.standby or args.standby_only:
            result.update(run_standby(n, args.election_ttl))
        results.append(result)
    for r in results:
        table(f"recovery with {r['agents']} agents", list(r.items()))
    emit({"bench": "recovery", "runs": results})


if __name__ == "__main__":
    main()
