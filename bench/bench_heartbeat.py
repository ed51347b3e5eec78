"""Heartbeat scale: N connected nodes at 1 s heartbeats; the scheduler's CPU and memory.

A real scheduler and controller (own OS processes) and N simulated agents over a few OS
processes. Once every node is READY at the controller, the benchmark watches the controller's
node events for D seconds while sampling the scheduler process with psutil: CPU share of one
core, peak RSS, heartbeats/s (counted where the agents hand them to their streams; a node
whose heartbeats the scheduler failed to process in time would turn NOT_READY), and how many
healthy nodes were wrongly marked NOT_READY (must be 0).

    .venv/bin/python bench/bench_heartbeat.py [--nodes 5000 --seconds 60]
    .venv/bin/python bench/bench_heartbeat.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    CpuSampler,
    Services,
    admin_channel,
    certs_dir,
    emit,
    start_agents,
    table,
    wait_nodes_ready,
    workdir,
)
from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.rpc.pages import list_all


def run(nodes: int, seconds: float, processes: int, max_rate: float = 0) -> dict[str, float]:
    certs = certs_dir(nodes)
    with workdir("heartbeat") as work:
        # No pacing by default: what N nodes beating every second cost the scheduler.
        pacing = ["--max-heartbeats-per-second", f"{max_rate:g}"]
        services = Services(certs, work, scheduler_args=pacing).start()
        hosts = []
        try:
            t0 = time.perf_counter()
            hosts = start_agents(certs, services.scheduler, nodes, work, processes)
            connect_s = time.perf_counter() - t0

            async def go() -> dict[str, float]:
                channel = admin_channel(certs, services.controller)
                stub = pb_grpc.ControllerStub(channel)
                await wait_nodes_ready(stub, nodes, timeout=300)
                # Let the connection storm settle before measuring the steady state.
                await asyncio.sleep(min(5.0, seconds / 4))
                not_ready: set[str] = set()
                lost: set[str] = set()

                async def watch() -> None:
                    async for ev in stub.WatchEvents(pb.WatchEventsRequest()):
                        if ev.HasField("node"):
                            if ev.node.state == pb.Node.NOT_READY:
                                not_ready.add(ev.node.name)
                            elif ev.node.state == pb.Node.LOST:
                                lost.add(ev.node.name)

                watcher = asyncio.create_task(watch())
                before = sum(h.ask("stats")["heartbeats"] for h in hosts)
                with CpuSampler(services.pid("scheduler")) as cpu:
                    await asyncio.sleep(seconds)
                after = [h.ask("stats") for h in hosts]
                watcher.cancel()
                sent = sum(s["heartbeats"] for s in after) - before
                connected = sum(s["connected"] for s in after)
                final, _ = await list_all(stub.ListNodes, pb.ListNodesRequest(), "nodes")
                ready = sum(1 for n in final if n.state == pb.Node.READY)
                await channel.close()
                return {
                    "nodes": nodes,
                    "seconds": round(cpu.seconds, 1),
                    "connect_all_s": round(connect_s, 1),
                    "scheduler_cpu_share": round(cpu.cpu_share, 3),
                    "scheduler_peak_rss_mib": round(cpu.peak_rss / (1 << 20), 1),
                    "heartbeats_per_s": round(sent / cpu.seconds, 1),
                    "agents_connected_at_end": connected,
                    "ready_at_end": ready,
                    "false_not_ready": len(not_ready),
                    "false_lost": len(lost),
                }

            return asyncio.run(go())
        finally:
            for h in hosts:
                h.stop()
            services.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--processes", type=int, default=6, help="OS processes for the agents")
    p.add_argument(
        "--max-heartbeats-per-second",
        type=float,
        default=0.0,
        help="the scheduler's heartbeat budget (0: every node at 1 s, the default here)",
    )
    p.add_argument("--smoke", action="store_true", help="200 nodes for 10 s")
    args = p.parse_args(argv)
    if args.smoke:
        args.nodes, args.seconds, args.processes = 200, 10.0, 2
    figures = run(args.nodes, args.seconds, args.processes, args.max_heartbeats_per_second)
    table(
        f"heartbeat scale: {args.nodes} nodes at 1 s heartbeats for {args.seconds:g} s",
        list(figures.items()),
    )
    emit({"bench": "heartbeat", **figures})


if __name__ == "__main__":
    main()
