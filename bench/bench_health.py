"""What the health checks of 1,000 instances cost one agent, in CPU seconds per second.

The agent's own supervisors (`orka.agent.supervisor.Supervised`, on the fake driver, so no
process is started) each run a check with `interval: 1s` against real listeners on loopback:
a helper process serves `--ports` TCP ports (accepts; answers any request with 200), so its
work is not counted. The figure is this process's CPU time (`time.process_time`, user +
system, all threads) over a fixed window once every instance is HEALTHY, for:
- no check (the baseline: 1,000 supervised instances that only wait),
- tcp checks (connect, close),
- http checks (GET, read the status line).

    .venv/bin/python bench/bench_health.py [--instances 1000] [--window 10] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PYTHON, emit, table
from orka.agent import health
from orka.agent.supervisor import Supervised
from orka.models import HealthState, InstancePhase, RestartPolicy, WorkloadKind, WorkloadSpec
from orka.runtime.fake import FakeDriver

# The listeners: one asyncio server per port, each request answered 200 and closed.
SERVER = """
import asyncio, sys

async def answer(reader, writer):
    try:
        await reader.readuntil(b"\\r\\n\\r\\n")
        writer.write(b"HTTP/1.0 200 OK\\r\\nContent-Length: 0\\r\\n\\r\\n")
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()

async def main(count):
    servers = [
        await asyncio.start_server(answer, "127.0.0.1", 0, backlog=1024) for _ in range(count)
    ]
    print(" ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1])))
"""


def spec(mode: str, port: int, interval: float) -> WorkloadSpec:
    check: dict[str, Any] | None = None
    if mode == "tcp":
        check = {"tcp": {"port": port}}
    elif mode == "http":
        check = {"http": {"port": port, "path": "/healthz"}}
    if check is not None:
        check.update(interval=interval, timeout=min(1.0, interval))
    return WorkloadSpec(
        name=f"bench-{mode}",
        kind=WorkloadKind.PROCESS,
        command=["serve"],
        restart_policy=RestartPolicy.ALWAYS,
        health_check=check,
    )


async def measure(
    mode: str, ports: list[int], instances: int, interval: float, window: float
) -> dict[str, Any]:
    driver = FakeDriver()
    probes = 0
    tcp, http = health.tcp_probe, health.http_probe

    async def counted_tcp(*args: Any) -> str | None:
        nonlocal probes
        probes += 1
        return await tcp(*args)

    async def counted_http(*args: Any) -> str | None:
        nonlocal probes
        probes += 1
        return await http(*args)

    health.tcp_probe, health.http_probe = counted_tcp, counted_http  # type: ignore[assignment]
    specs = [spec(mode, ports[i % len(ports)], interval) for i in range(len(ports))]
    sups = [
        Supervised(f"{mode}-{i}", 1, specs[i % len(specs)], driver, lambda s: None)
        for i in range(instances)
    ]
    try:
        for s in sups:
            s.start()
        # Every instance RUNNING and HEALTHY (the first probes are jittered over an interval).
        deadline = time.monotonic() + 10 * interval + 30
        while not all(
            s.phase is InstancePhase.RUNNING and s.health is HealthState.HEALTHY for s in sups
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: not all instances HEALTHY in time")
            await asyncio.sleep(0.1)
        await asyncio.sleep(interval)  # past the first, jittered round
        probes = 0
        use0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        await asyncio.sleep(window)
        use, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall0
        user, system = use.ru_utime - use0.ru_utime, use.ru_stime - use0.ru_stime
        cpu = user + system
        done = probes
        unhealthy = sum(s.health is not HealthState.HEALTHY for s in sups)
        restarts = sum(s.restarts for s in sups)
    finally:
        await asyncio.gather(*(s.stop(remove=True) for s in sups))
        health.tcp_probe, health.http_probe = tcp, http  # type: ignore[assignment]
    return {
        "cpu_s_per_s": round(cpu / wall, 4),
        "user_s_per_s": round(user / wall, 4),
        "system_s_per_s": round(system / wall, 4),
        "probes_per_s": round(done / wall, 1),
        "cpu_us_per_probe": round(cpu / done * 1e6, 1) if done else None,
        "not_healthy_at_end": unhealthy,
        "restarts": restarts,
    }


async def run(ports: list[int], instances: int, interval: float, window: float) -> dict[str, Any]:
    return {
        mode: await measure(mode, ports, instances, interval, window)
        for mode in ("none", "tcp", "http")
    }


def listeners(count: int) -> tuple[subprocess.Popen[str], list[int]]:
    server = subprocess.Popen([PYTHON, "-c", SERVER, str(count)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    ports = [int(p) for p in line.split()]
    if len(ports) != count:
        server.kill()
        raise SystemExit(f"the listeners did not start: {line!r}")
    return server, ports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--ports", type=int, default=20, help="listener ports, shared")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--smoke", action="store_true", help="100 instances, a 2 s window")
    args = parser.parse_args()
    if args.smoke:
        args.instances, args.window = 100, 2.0
    server, ports = listeners(args.ports)
    try:
        results = asyncio.run(run(ports, args.instances, args.interval, args.window))
    finally:
        server.terminate()
        server.wait()
    table(
        f"{args.instances} instances, checks every {args.interval:g}s, {args.window:g}s window"
        " (CPU seconds per second of this process)",
        [(f"{mode}: CPU s/s, probes/s, CPU us/probe", _row(r)) for mode, r in results.items()],
    )
    emit(
        {
            "bench": "health",
            "instances": args.instances,
            "interval_s": args.interval,
            "window_s": args.window,
            **{mode: r for mode, r in results.items()},
            "tcp_cpu_s_per_s": results["tcp"]["cpu_s_per_s"],
            "http_cpu_s_per_s": results["http"]["cpu_s_per_s"],
        }
    )


def _row(r: dict[str, Any]) -> str:
    return (
        f"{r['cpu_s_per_s']:.3f} (user {r['user_s_per_s']:.3f}, system"
        f" {r['system_s_per_s']:.3f}), {r['probes_per_s']:.0f}, {r['cpu_us_per_probe']}"
    )


if __name__ == "__main__":
    main()
