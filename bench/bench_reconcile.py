"""The controller's reconcile passes alone, over a burst's sequence of writes.

The real Repo (on the in-memory store), Reconciler and PlacementQueue, in this process; the
scheduler and the nodes are stood in for by the writes they cause. W workloads of R replicas
are created at once; a pass plans them (their instances are created); then the instances are
bound B at a time, each batch of bindings followed by a pass (the placement queue's commits),
and reported RUNNING and HEALTHY F at a time, each report batch followed by a pass (the
scheduler's feed, ~20 reports per message in the placement benchmark). Measured: the CPU of
the passes (process time around `reconcile_once`), the passes, and the workload records they
wrote (status writes).

    .venv/bin/python bench/bench_reconcile.py [--workloads 100 --replicas 100]
    .venv/bin/python bench/bench_reconcile.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orka import log
from orka.controller import rollout
from orka.controller.commands import InstanceReported, NodeCommand
from orka.controller.link import CommandResult
from orka.controller.placement import PlacementQueue
from orka.controller.reconciler import History, Reconciler
from orka.controller.repo import Change, Repo
from orka.models import (
    HealthState,
    InstancePhase,
    InstanceReport,
    Node,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)
from orka.store.memory import MemoryStore


class AcceptingLink:
    """Every command is acknowledged; nothing is placed through it (the benchmark binds)."""

    async def command(self, cmds: Sequence[NodeCommand]) -> list[CommandResult]:
        return [CommandResult(ok=True) for _ in cmds]

    async def set_node(self, *args: object, **kwargs: object) -> None:
        return None


async def run(workloads: int, replicas: int, nodes: int, bind: int, feed: int) -> dict[str, object]:
    store = MemoryStore()
    await store.open()
    repo = Repo(store)
    link = AcceptingLink()
    queue = PlacementQueue(repo, link)  # type: ignore[arg-type]
    rec = Reconciler(repo, link, queue, History())  # type: ignore[arg-type]
    # What `run` does before its first pass: passes after the first are incremental.
    repo.listeners.append(rec._on_change)
    rec._listening = True
    status_writes = 0

    def count(change: Change, old: object) -> None:
        nonlocal status_writes
        status_writes += change.kind == "workloads" and old is not None

    names = [f"node-{i:05d}" for i in range(nodes)]
    await repo.mutate(lambda: [Change("nodes", n, Node(name=n), create=True) for n in names])
    now = time.time()
    specs = [
        WorkloadSpec(
            name=f"wl-{i:03d}",
            kind=WorkloadKind.PROCESS,
            command=["sleep", "infinity"],
            replicas=replicas,
        )
        for i in range(workloads)
    ]
    records = [rollout.first_revision(Workload(spec=s, created_at=now), "bench") for s in specs]
    await repo.mutate(lambda: [Change("workloads", w.name, w, create=True) for w in records])
    repo.listeners.append(count)
    cpu = 0.0
    passes = 0

    async def one_pass() -> None:
        nonlocal cpu, passes
        start = time.process_time()
        await rec.reconcile_once()
        cpu += time.process_time() - start
        passes += 1

    await one_pass()  # creates every instance
    rng = random.Random(1)
    instances = list(repo.instances)
    rng.shuffle(instances)
    for lo in range(0, len(instances), bind):
        chunk = instances[lo : lo + bind]

        def bound(chunk: list[str] = chunk) -> list[Change]:
            at = time.time()
            return [
                Change(
                    "instances",
                    n,
                    repo.instances[n].model_copy(
                        update={
                            "node": rng.choice(names),
                            "phase": InstancePhase.SCHEDULED,
                            "scheduled_at": at,
                        }
                    ),
                )
                for n in chunk
            ]

        await repo.mutate(bound)
        await one_pass()
    rng.shuffle(instances)
    for lo in range(0, len(instances), feed):
        reports = []
        for n in instances[lo : lo + feed]:
            inst = repo.instances[n]
            report = InstanceReport(
                name=n,
                workload=inst.workload,
                node=inst.node,
                phase=InstancePhase.RUNNING,
                started_at=time.time(),
                health=HealthState.HEALTHY,
            )
            reports.append(InstanceReported(report))
        await rec.on_updates(reports)
        await one_pass()
    running = sum(w.status.running for w in repo.workloads.values())
    total = workloads * replicas
    await store.close()
    return {
        "bench": "reconcile",
        "workloads": workloads,
        "replicas": replicas,
        "passes": passes,
        "reconcile_cpu_s": round(cpu, 3),
        "cpu_us_per_instance": round(cpu / total * 1e6, 1),
        "status_writes": status_writes,
        # Every instance RUNNING in its workload's status: the passes did their work.
        "complete": running == total,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", type=int, default=100)
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--bind-batch", type=int, default=100, help="bindings per commit")
    p.add_argument("--feed-batch", type=int, default=20, help="reports per feed message")
    p.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    args = p.parse_args(argv)
    log.configure(level="warning", service="bench-reconcile")  # no line per rollout step
    if args.smoke:
        args.workloads, args.replicas, args.nodes = 5, 20, 10
    shapes = [(args.workloads, args.replicas)]
    if not args.smoke and (args.workloads, args.replicas) == (100, 100):
        shapes.append((10, 1000))  # the same instances in larger workloads
    results = [
        asyncio.run(run(w, r, args.nodes, args.bind_batch, args.feed_batch)) for w, r in shapes
    ]
    for r in results:
        print(
            f"reconcile: {r['workloads']} x {r['replicas']}: {r['passes']} passes,"
            f" {r['reconcile_cpu_s']} CPU s ({r['cpu_us_per_instance']} us per instance),"
            f" {r['status_writes']} status writes, complete {r['complete']}"
        )
    print(json.dumps({"bench": "reconcile", "runs": results}))
    return 0 if all(r["complete"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
