"""Healing: SIGKILL the OS process of an agent holding R instances; time until all run elsewhere.

A real scheduler and controller (own OS processes, default timings: 1 s heartbeats, node lost
after 5 s). The victim agent runs alone in its own OS process and is the only node when the
workload is created, so it holds every replica; then N other agents join (another process),
and the victim's process is killed with SIGKILL. The figure is the time from the kill until
the controller's WatchEvents show R instances of the workload RUNNING on other nodes; the
target is node_lost_after + 1 s.

    .venv/bin/python bench/bench_healing.py [--replicas 100 --others 20]
    .venv/bin/python bench/bench_healing.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Services,
    admin_channel,
    certs_dir,
    emit,
    node_name,
    start_agents,
    table,
    wait_nodes_ready,
    workdir,
)
from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc

NODE_LOST_AFTER = 5.0


def run(replicas: int, others: int) -> dict[str, float]:
    certs = certs_dir(others + 1)
    victim = node_name(0)
    with workdir("healing") as work:
        services = Services(certs, work).start()
        hosts = []
        try:
            # The victim alone first, with room for every replica.
            hosts = start_agents(
                certs, services.scheduler, 1, work, 1, cpu_millis=replicas * 100 + 1000
            )

            async def go() -> dict[str, float]:
                channel = admin_channel(certs, services.controller)
                stub = pb_grpc.ControllerStub(channel)
                await wait_nodes_ready(stub, 1)
                running_on: dict[str, str] = {}
                all_on_victim = asyncio.Event()
                healed = asyncio.Event()
                killed_at = 0.0
                healed_at = 0.0
                lost_at = 0.0

                async def watch() -> None:
                    nonlocal healed_at, lost_at
                    stream = stub.WatchEvents(pb.WatchEventsRequest())
                    async for ev in stream:
                        if ev.HasField("node") and ev.node.name == victim:
                            if ev.node.state == pb.Node.LOST and not lost_at:
                                lost_at = time.perf_counter()
                        if not ev.HasField("instance") or ev.instance.workload != "heal":
                            continue
                        inst = ev.instance
                        if inst.phase == pb.Instance.RUNNING:
                            running_on[inst.name] = inst.node
                        else:
                            running_on.pop(inst.name, None)
                        on_victim = sum(1 for n in running_on.values() if n == victim)
                        if on_victim >= replicas:
                            all_on_victim.set()
                        elsewhere = sum(1 for n in running_on.values() if n != victim)
                        if killed_at and elsewhere >= replicas and not healed.is_set():
                            healed_at = time.perf_counter()
                            healed.set()

                watcher = asyncio.create_task(watch())
                await asyncio.sleep(0.3)
                await stub.CreateWorkload(
                    pb.CreateWorkloadRequest(
                        spec=pb.WorkloadSpec(
                            name="heal",
                            kind=pb.WorkloadSpec.PROCESS,
                            command=["sleep", "infinity"],
                            replicas=replicas,
                            resources=pb.Resources(cpu_millis=100, memory_bytes=64 << 20),
                        )
                    )
                )
                await asyncio.wait_for(all_on_victim.wait(), 60)
                # Then the rest of the cluster, in its own process.
                hosts.extend(
                    await asyncio.to_thread(
                        start_agents, certs, services.scheduler, others, work, 1, first=1
                    )
                )
                await wait_nodes_ready(stub, others + 1)
                killed_at = time.perf_counter()
                hosts[0].kill()
                await asyncio.wait_for(healed.wait(), 60)
                watcher.cancel()
                await channel.close()
                return {
                    "replicas": replicas,
                    "other_nodes": others,
                    "node_lost_after_s": NODE_LOST_AFTER,
                    "kill_to_lost_s": round(lost_at - killed_at, 2),
                    "kill_to_all_running_elsewhere_s": round(healed_at - killed_at, 2),
                    "target_s": NODE_LOST_AFTER + 1.0,
                }

            return asyncio.run(go())
        finally:
            for h in hosts:
                h.stop()
            services.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--others", type=int, default=20, help="nodes that take the replacements")
    p.add_argument("--smoke", action="store_true", help="10 instances, 3 other nodes")
    args = p.parse_args(argv)
    if args.smoke:
        args.replicas, args.others = 10, 3
    figures = run(args.replicas, args.others)
    table(f"healing: SIGKILL a node holding {args.replicas} instances", list(figures.items()))
    emit({"bench": "healing", **figures})


if __name__ == "__main__":
    main()
