"""Placement decisions per second: Pipeline.rank() over one large, varied snapshot.

    .venv/bin/python bench/bench_decisions.py [--nodes 5000] [--requests 300] [--policy all]
    .venv/bin/python bench/bench_decisions.py --smoke

Prints one line per policy and, last, one JSON line with every figure, for scripts to collect.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orka.models import NodeState, WorkloadKind
from orka.scheduler.pipeline import POLICIES, Pipeline, PipelineConfig
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot

GIB = 1 << 30
ZONES = ("eu-1", "eu-2", "us-1", "us-2", "ap-1")
WORKLOADS = tuple(f"wl-{i}" for i in range(200))


def build_snapshot(nodes: int, rng: random.Random) -> Snapshot:
    views: list[NodeView] = []
    for i in range(nodes):
        cpu = rng.choice((4000, 8000, 16000, 32000, 64000))
        mem = cpu // 1000 * 2 * GIB
        counts = {w: rng.randint(1, 3) for w in rng.sample(WORKLOADS, rng.randint(0, 8))}
        # Mostly healthy with some churn, like a real fleet: a few lost, cordoned, full nodes.
        roll = rng.random()
        state = NodeState.READY
        if roll < 0.02:
            state = NodeState.NOT_READY
        elif roll < 0.03:
            state = NodeState.LOST
        drivers = {"process"}
        if rng.random() < 0.7:
            drivers.add("containerd")
        if rng.random() < 0.2:
            drivers.add("libvirt")
        views.append(
            NodeView(
                name=f"node-{i:05d}",
                state=state,
                schedulable=rng.random() > 0.03,
                drivers=frozenset(drivers),
                labels={"zone": rng.choice(ZONES), "disk": rng.choice(("ssd", "hdd"))},
                cpu_allocatable=cpu,
                mem_allocatable=mem,
                cpu_used=int(cpu * rng.uniform(0.0, 1.0)),
                mem_used=int(mem * rng.uniform(0.0, 1.0)),
                workload_counts=counts,
                total_instances=sum(counts.values()),
            )
        )
    return Snapshot(tuple(views))


def build_requests(count: int, rng: random.Random) -> list[PlacementRequest]:
    requests: list[PlacementRequest] = []
    for i in range(count):
        selector: dict[str, str] = {}
        if rng.random() < 0.3:
            selector["zone"] = rng.choice(ZONES)
        if rng.random() < 0.1:
            selector["disk"] = "ssd"
        requests.append(
            PlacementRequest(
                instance=f"inst-{i}",
                workload=rng.choice(WORKLOADS),
                kind=rng.choices(list(WorkloadKind), weights=(6, 3, 1))[0],
                cpu_millis=rng.choice((100, 250, 500, 1000, 2000)),
                memory_bytes=rng.choice((128 << 20, 512 << 20, GIB, 4 * GIB)),
                node_selector=selector,
                max_per_node=rng.choice((0, 0, 1, 2)),
            )
        )
    return requests


def measure(
    policy: str, snapshot: Snapshot, requests: list[PlacementRequest], limit: int
) -> dict[str, float]:
    pipeline = Pipeline(PipelineConfig(policy=policy))
    feasible = 0
    start = time.perf_counter()
    for req in requests:
        ranking = pipeline.rank(req, snapshot, limit=limit)
        feasible += bool(ranking.candidates)
    elapsed = time.perf_counter() - start
    return {
        "decisions_per_s": round(len(requests) / elapsed, 1),
        "us_per_decision": round(elapsed / len(requests) * 1e6, 1),
        "placeable_fraction": round(feasible / len(requests), 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--policy", choices=[*sorted(POLICIES), "all"], default="all")
    parser.add_argument("--limit", type=int, default=5, help="candidates kept per decision")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="100 nodes, 100 requests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.nodes, args.requests = 100, 100

    rng = random.Random(args.seed)
    snapshot = build_snapshot(args.nodes, rng)
    requests = build_requests(args.requests, rng)
    policies = sorted(POLICIES) if args.policy == "all" else [args.policy]

    results: dict[str, dict[str, float]] = {}
    for policy in policies:
        measure(policy, snapshot, requests[: max(1, len(requests) // 10)], args.limit)  # warm-up
        results[policy] = figures = measure(policy, snapshot, requests, args.limit)
        print(
            f"{policy:8} {args.nodes} nodes, {args.requests} requests: "
            f"{figures['decisions_per_s']:>10,.1f} decisions/s "
            f"({figures['us_per_decision']:,.1f} us each, "
            f"{figures['placeable_fraction']:.0%} placeable)"
        )
    print(
        json.dumps(
            {
                "bench": "decisions",
                "nodes": args.nodes,
                "requests": args.requests,
                "limit": args.limit,
                "python": platform.python_version(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
