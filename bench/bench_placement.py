"""Placement: N nodes, W workloads x R replicas; placements/s to SCHEDULED and RUNNING.

A real controller and scheduler (each its own OS process) and N simulated agents (the real
Agent with the fake driver, spread over a few OS processes). The benchmark subscribes to the
controller's WatchEvents, creates every workload at once, and times each instance from the
CreateWorkload call of its workload to the events that show it SCHEDULED and RUNNING.

    .venv/bin/python bench/bench_placement.py [--nodes 1000 --workloads 100 --replicas 100]
    .venv/bin/python bench/bench_placement.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


async def run_once(
    certs: Path, services: Services, workloads: int, replicas: int, timeout: float
) -> dict[str, float]:
    total = workloads * replicas
    channel = admin_channel(certs, services.controller)
    stub = pb_grpc.ControllerStub(channel)
    created: dict[str, float] = {}
    scheduled: dict[str, float] = {}
    running: dict[str, float] = {}
    done = asyncio.Event()
    watch_ok = asyncio.Event()

    async def watch() -> None:
        stream = stub.WatchEvents(pb.WatchEventsRequest())
        watch_ok.set()
        async for ev in stream:
            if not ev.HasField("instance"):
                continue
            inst = ev.instance
            now = time.perf_counter()
            if inst.node and inst.name not in scheduled:
                scheduled[inst.name] = now
            if inst.phase == pb.Instance.RUNNING and inst.name not in running:
                running[inst.name] = now
                if len(running) >= total:
                    done.set()
                    return
        # The controller cuts off a subscriber that falls too far behind.
        raise RuntimeError("WatchEvents stream ended before every instance ran")

    watcher = asyncio.create_task(watch())
    await watch_ok.wait()
    await asyncio.sleep(0.3)  # let the subscription land before the first event
    spec_cpu, spec_mem = 100, 64 << 20

    async def create(i: int) -> None:
        name = f"wl-{i:03d}"
        created[name] = time.perf_counter()
        await stub.CreateWorkload(
            pb.CreateWorkloadRequest(
                spec=pb.WorkloadSpec(
                    name=name,
                    kind=pb.WorkloadSpec.PROCESS,
                    command=["sleep", "infinity"],
                    replicas=replicas,
                    resources=pb.Resources(cpu_millis=spec_cpu, memory_bytes=spec_mem),
                )
            )
        )

    with (
        CpuSampler(services.pid("scheduler")) as sched_cpu,
        CpuSampler(services.pid("controller")) as ctl_cpu,
    ):
        start = time.perf_counter()
        await asyncio.gather(*(create(i) for i in range(workloads)))
        try:
            await asyncio.wait_for(asyncio.shield(done.wait()), timeout)
        except TimeoutError:
            pass
        if watcher.done() and watcher.exception() is not None:
            raise watcher.exception()  # type: ignore[misc]
        watcher.cancel()
    await channel.close()
    if not running:
        raise RuntimeError(f"no instance RUNNING after {timeout}s")

    def rel(name: str, t: float) -> float:
        return t - created[name.rsplit("-", 1)[0]]

    lat = [rel(n, t) for n, t in running.items()]
    sched_end = max(scheduled.values()) - start
    run_end = max(running.values()) - start
    complete = len(running) >= total
    # A run that timed out still reports its rates, over what it got done.
    return {
        "instances": total,
        "running_reached": len(running),
        "complete": complete,
        "scheduled_per_s": round(len(scheduled) / sched_end, 1),
        "running_per_s": round(len(running) / run_end, 1),
        "seconds_to_all_running": round(run_end, 2) if complete else None,
        "p50_create_to_running_s": round(percentile(lat, 50), 3),
        "p99_create_to_running_s": round(percentile(lat, 99), 3),
        "scheduler_cpu_share": round(sched_cpu.cpu_share, 3),
        "controller_cpu_share": round(ctl_cpu.cpu_share, 3),
    }


def run(
    nodes: int,
    workloads: int,
    replicas: int,
    processes: int,
    store: str = "",
    timeout: float = 100.0,
) -> dict[str, float]:
    certs = certs_dir(nodes)
    with workdir("placement") as work:
        services = Services(certs, work, store=store).start()
        hosts = []
        try:
            # Each node offers room for 2.5x its share, so placement is never capacity-bound.
            per_node = -(-workloads * replicas // nodes)
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
                return await run_once(certs, services, workloads, replicas, timeout)

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
    p.add_argument("--smoke", action="store_true", help="20 nodes, 10 x 20 instances")
    args = p.parse_args(argv)
    if args.smoke:
        args.nodes, args.workloads, args.replicas, args.processes = 20, 10, 20, 2

    result: dict[str, object] = {
        "bench": "placement",
        "nodes": args.nodes,
        "workloads": args.workloads,
        "replicas": args.replicas,
    }
    sqlite = run(args.nodes, args.workloads, args.replicas, args.processes)
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
                    args.nodes, args.workloads, args.replicas, args.processes, url, timeout=90
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
