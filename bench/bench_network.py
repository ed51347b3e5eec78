"""What the instance network costs an instance start, on this host's real CNI plugins.

Two figures, each the median of `--repeat` runs on a bridge and subnet of the benchmark's own
(removed afterwards), no traffic anywhere:
- CNI ADD and DEL of one instance (namespace, loopback, bridge + host-local, portmap of one
  host port), as `CniNetwork.attach_netns` / `detach` pay them;
- a process instance's start (`ProcessDriver.start` of `sleep`) on the host's network (the
  in-run baseline) and with `network: bridge`, and their ratio.

    .venv/bin/python bench/bench_network.py [--repeat 20] [--smoke]

Needs root and Debian's containernetworking-plugins; elsewhere it says why and measures
nothing (`"skipped"`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, table, workdir
from orka.models import NetworkMode, PortSpec, RestartPolicy, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec
from orka.runtime.host_ports import HostPorts
from orka.runtime.network import CniNetwork, default_subnet, host_routes, host_unavailable
from orka.runtime.process import ProcessDriver

PORTS = [PortSpec(name="http", port=8080)]
# Far from the agents' default range, so a running cluster on this host is not in the way.
PORT_RANGE = (47000, 47999)


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def spec(mode: NetworkMode) -> WorkloadSpec:
    return WorkloadSpec(
        name="bench",
        kind=WorkloadKind.PROCESS,
        command=["sleep", "600"],
        network=mode,
        ports=PORTS if mode is NetworkMode.BRIDGE else [],
        restart_policy=RestartPolicy.NEVER,
        stop_grace_seconds=0,
    )


async def starts(driver: ProcessDriver, mode: NetworkMode, repeat: int) -> list[float]:
    times = []
    for i in range(repeat):
        name = f"{mode.value}-{i}"
        t0 = time.perf_counter()
        await driver.start(RunSpec(instance=name, workload="bench", spec=spec(mode)))
        times.append(time.perf_counter() - t0)
        await driver.remove(name)
    return times


async def measure(root: Path, repeat: int) -> dict[str, Any]:
    bridge = f"ob{uuid.uuid4().hex[:10]}"
    subnet = str(default_subnet(bridge, host_routes(), bridge))
    ports = HostPorts(*PORT_RANGE)
    network = CniNetwork(
        root / "network", node="bench", host_ports=ports, bridge=bridge, subnet=subnet
    )
    driver = ProcessDriver(root / "process", host_ports=ports, network=network)
    try:
        adds, dels = [], []
        for i in range(repeat):
            t0 = time.perf_counter()
            await network.attach_netns(f"cni-{i}", PORTS)
            adds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await network.detach(f"cni-{i}")
            dels.append(time.perf_counter() - t0)
        host = await starts(driver, NetworkMode.HOST, repeat)
        bridged = await starts(driver, NetworkMode.BRIDGE, repeat)
        leaked = network.instances()
    finally:
        await driver.close()
        # With nothing left on it, the bridge and its localhost guard go (as an agent's do).
        await network.close()
        ports.close()
        await asyncio.to_thread(
            subprocess.run, ["ip", "link", "del", bridge], capture_output=True, check=False
        )
    return {
        "repeat": repeat,
        "cni_add_ms": ms(adds),
        "cni_del_ms": ms(dels),
        "process_start_host_ms": ms(host),
        "process_start_bridge_ms": ms(bridged),
        "bridge_over_host": round(statistics.median(bridged) / statistics.median(host), 2),
        "leaked_attachments": len(leaked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="3 runs of each")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 3
    why = host_unavailable()
    if why is not None:
        print(f"# skipped: {why}")
        emit({"bench": "network", "skipped": why})
        return
    with workdir("network") as root:
        result = asyncio.run(measure(root, args.repeat))
    table(
        f"instance network, median of {result['repeat']}",
        [
            ("CNI ADD ms", result["cni_add_ms"]),
            ("CNI DEL ms", result["cni_del_ms"]),
            ("process start, host network ms", result["process_start_host_ms"]),
            ("process start, network: bridge ms", result["process_start_bridge_ms"]),
            ("bridge / host", result["bridge_over_host"]),
        ],
    )
    emit({"bench": "network", **result})


if __name__ == "__main__":
    main()
