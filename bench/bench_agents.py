"""Real agents: N `orka agent --runtime fake` OS processes, create -> all RUNNING.

Unlike the other benchmarks (many simulated agents in a few processes), each agent here is
its own OS process started through the real command line, as users run it, with the
certificates `orka certs init` writes. One scheduler and one controller (SQLite), each its
own process. The benchmark creates W workloads x R replicas at once through the API and times
each instance from its workload's CreateWorkload to when the controller recorded it RUNNING
(bench_placement's Tracker), and reports the CPU seconds the agents, the scheduler and the
controller spent on it.

    .venv/bin/python bench/bench_agents.py [--agents 50 --workloads 200 --replicas 50]
    .venv/bin/python bench/bench_agents.py --profile-agent DIR   # cProfile of agent 0
    .venv/bin/python bench/bench_agents.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.bench_placement import SPEC_CPU, SPEC_MEMORY, Tracker
from bench.common import (
    CACHE,
    PYTHON,
    ROOT,
    Services,
    admin_channel,
    cpu_seconds,
    cpu_totals,
    emit,
    node_name,
    percentile,
    table,
    wait_nodes_ready,
    workdir,
)
from orka.api import controller_pb2_grpc as pb_grpc

IDLE_SECONDS = 3.0


def cli_certs(agents: int) -> Path:
    """A certs dir written by `orka certs init` itself (one agent cert per node), cached."""
    path = CACHE / f"certs-cli-{agents}"
    if (path / "done").is_file():
        return path
    nodes = [arg for i in range(agents) for arg in ("--node", node_name(i))]
    start = time.perf_counter()
    subprocess.run(
        [PYTHON, "-m", "orka.cli.main", "certs", "init", "--dir", str(path), *nodes],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (path / "done").write_text(str(agents))
    print(f"# orka certs init: {agents} agents in {time.perf_counter() - start:.1f}s ({path})")
    return path


def start_agent(
    certs: Path,
    scheduler: str,
    i: int,
    work: Path,
    cpu_millis: int,
    memory_bytes: int,
    profile: Path | None,
) -> subprocess.Popen[bytes]:
    name = node_name(i)
    entry = ["-m", "orka.cli.main"]
    if profile is not None:
        # cProfile writes its file when the agent exits (SIGINT: a plain stop).
        entry = ["-m", "cProfile", "-o", str(profile / f"{name}.prof"), *entry]
    return subprocess.Popen(
        [
            PYTHON,
            *entry,
            "agent",
            "--name",
            name,
            "--scheduler",
            scheduler,
            "--runtime",
            "fake",
            "--certs",
            str(certs),
            "--data-dir",
            str(work / name),
            "--cpu-millis",
            str(cpu_millis),
            "--memory-bytes",
            str(memory_bytes),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(work / f"{name}.log", "wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def stop_agents(agents: list[subprocess.Popen[bytes]], profiled: bool) -> None:
    # SIGINT: each stops its instances and exits (the profiled one then writes its profile).
    for proc in agents:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc in agents:
        try:
            proc.wait(60 if profiled else 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def measure(
    certs: Path,
    services: Services,
    agents: list[subprocess.Popen[bytes]],
    workloads: int,
    replicas: int,
    timeout: float,
) -> dict[str, object]:
    total = workloads * replicas
    channel = admin_channel(certs, services.controller)
    tracker = Tracker(pb_grpc.ControllerStub(channel))
    await tracker.start()
    procs = {
        "agents": [psutil.Process(p.pid) for p in agents],
        "scheduler": [psutil.Process(services.pid("scheduler"))],
        "controller": [psutil.Process(services.pid("controller"))],
        "bench": [psutil.Process(os.getpid())],
    }
    before = cpu_totals(procs)
    try:
        start = time.time()
        await asyncio.gather(*(tracker.create(f"wl-{i:03d}", replicas) for i in range(workloads)))
        await tracker.wait(timeout)
        after = cpu_totals(procs)
        running = dict(tracker.running)
        if not running:
            raise RuntimeError(f"no instance RUNNING after {timeout}s")
        lat = tracker.latencies("wl-")
        bound = [t - tracker.created[n.rsplit("-", 1)[0]] for n, t in tracker.scheduled.items()]
        run_end = max(running.values()) - start
        complete = len(running) >= total
        result: dict[str, object] = {
            "instances": total,
            "running_reached": len(running),
            "complete": complete,
            "running_per_s": round(len(running) / run_end, 1),
            "seconds_to_all_running": round(run_end, 2) if complete else None,
            "p50_create_to_running_s": round(percentile(lat, 50), 3),
            "p99_create_to_running_s": round(percentile(lat, 99), 3),
            # Bound to a node (the controller stored the binding): the rest is the agents'
            # start and their report's way back.
            "p50_create_to_scheduled_s": round(percentile(bound, 50), 3),
            "p99_create_to_scheduled_s": round(percentile(bound, 99), 3),
            "nodes_not_ready_seen": len(tracker.not_ready),
        }
        for key in procs:
            result[f"{key}_cpu_s"] = round(after[key] - before[key], 2)
        result["agent_cpu_ms_per_instance"] = round(
            1000 * (after["agents"] - before["agents"]) / max(1, len(running)), 3
        )
        return result
    finally:
        tracker.stop()
        await channel.close()


def run(
    agents: int,
    workloads: int,
    replicas: int,
    timeout: float,
    profile: Path | None,
) -> dict[str, object]:
    certs = cli_certs(agents)
    per_node = -(-(workloads * replicas) // agents)
    # Room for 2.5x each node's share, so placement is never capacity-bound.
    cpu_millis = max(1000, per_node * SPEC_CPU * 5 // 2)
    memory_bytes = max(1 << 30, per_node * SPEC_MEMORY * 5 // 2)
    with workdir("agents") as work:
        services = Services(certs, work).start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            (work / "agents").mkdir()
            if profile is not None:
                profile.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            for i in range(agents):
                procs.append(
                    start_agent(
                        certs,
                        services.scheduler,
                        i,
                        work / "agents",
                        cpu_millis,
                        memory_bytes,
                        profile if i == 0 else None,
                    )
                )

            async def go() -> dict[str, object]:
                channel = admin_channel(certs, services.controller)
                await wait_nodes_ready(pb_grpc.ControllerStub(channel), agents, timeout=300)
                await channel.close()
                started = time.perf_counter() - t0
                ps = [psutil.Process(p.pid) for p in procs]
                startup_cpu = [cpu_seconds(p) for p in ps]
                rss = [p.memory_info().rss for p in ps]
                # What being alive costs: the agents' CPU over a few idle seconds.
                idle0 = sum(cpu_seconds(p) for p in ps)
                await asyncio.sleep(IDLE_SECONDS)
                idle = (sum(cpu_seconds(p) for p in ps) - idle0) / IDLE_SECONDS
                result = await measure(certs, services, procs, workloads, replicas, timeout)
                result["agents_start_to_all_ready_s"] = round(started, 2)
                result["agent_startup_cpu_s_mean"] = round(sum(startup_cpu) / len(ps), 3)
                result["agents_idle_cpu_share"] = round(idle, 3)
                result["agent_rss_mib_after_start_mean"] = round(sum(rss) / len(ps) / 2**20, 1)
                result["agent_rss_mib_at_end_max"] = round(
                    max(p.memory_info().rss for p in ps) / 2**20, 1
                )
                return result

            return asyncio.run(go())
        finally:
            stop_agents(procs, profile is not None)
            services.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=50)
    p.add_argument("--workloads", type=int, default=200)
    p.add_argument("--replicas", type=int, default=50)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument(
        "--profile-agent",
        type=Path,
        default=None,
        metavar="DIR",
        help="run agent 0 under cProfile, writing DIR/node-00000.prof",
    )
    p.add_argument("--smoke", action="store_true", help="4 agents, 4 x 25 instances")
    args = p.parse_args(argv)
    if args.smoke:
        args.agents, args.workloads, args.replicas = 4, 4, 25
    result = run(args.agents, args.workloads, args.replicas, args.timeout, args.profile_agent)
    table(
        f"real agents: {args.agents} `orka agent --runtime fake` processes, "
        f"{args.workloads} workloads x {args.replicas} replicas (SQLite)",
        list(result.items()),
    )
    emit(
        {
            "bench": "agents",
            "agents": args.agents,
            "workloads": args.workloads,
            "replicas": args.replicas,
            **result,
        }
    )


if __name__ == "__main__":
    main()
