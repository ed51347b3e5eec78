"""One chaos soak: a cluster of real processes, users changing workloads, faults, a checker.

    report = await soak(certs, data, SoakConfig(seconds=90, seed=1))

`tests/e2e/test_chaos.py` runs a short one in CI; `bench/bench_chaos.py` a long one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from orka.api import controller_pb2 as pb
from orka.rpc.pages import list_all
from tests.chaos.cluster import ChaosCluster
from tests.chaos.faults import Faults
from tests.chaos.invariants import Checker, Violation
from tests.chaos.load import Client, Load


@dataclass
class SoakConfig:
    seconds: float = 90.0
    seed: int = 1
    workloads: int = 6
    agents: int = 5
    controllers: int = 2
    schedulers: int = 2
    converge: float = 90.0
    bound: float = 3.0
    grace: float = 15.0
    concurrent: int = 2


@dataclass
class Report:
    config: SoakConfig
    faults: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    samples: int = 0
    most_copies: int = 0
    lost_instances: int = 0
    converged_after: float | None = None
    seconds: float = 0.0
    # The requests for each workload a violation names, to read what happened.
    histories: dict[str, list[str]] = field(default_factory=dict)
    fault_log: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"soak: {self.seconds:.0f}s of faults, seed {self.config.seed}, "
            f"{self.config.agents} agents, {self.config.controllers} controllers, "
            f"{self.config.schedulers} schedulers",
            "faults: " + ", ".join(f"{k} x{v}" for k, v in self.faults.items()),
            "requests: " + ", ".join(f"{k} {v}" for k, v in sorted(self.requests.items())),
            f"checker samples: {self.samples}, most workload processes at once: "
            f"{self.most_copies}, instances replaced after their node was lost: "
            f"{self.lost_instances}",
            "converged after the faults: "
            + ("no" if self.converged_after is None else f"{self.converged_after:.1f}s"),
            f"violations: {len(self.violations)}",
        ]
        out += [f"  {v.rule}: {v.detail}" for v in self.violations]
        if self.violations:
            out.append("faults (seconds from the start):")
            out += [f"  {line}" for line in self.fault_log]
        for name, ops in self.histories.items():
            out.append(f"requests for {name} (seconds from the start):")
            out += [f"  {op}" for op in ops]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "seed": self.config.seed,
            "faults": self.faults,
            "requests": self.requests,
            "samples": self.samples,
            "most_copies": self.most_copies,
            "lost_instances": self.lost_instances,
            "converged_after": self.converged_after,
            "violations": [f"{v.rule}: {v.detail}" for v in self.violations],
        }


async def _ready(client: Client, nodes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            items, _ = await list_all(
                functools.partial(client.stub().ListNodes, timeout=5),
                pb.ListNodesRequest(),
                "nodes",
            )
            if sum(1 for n in items if n.state == pb.Node.READY) >= nodes:
                return
        except grpc.aio.AioRpcError as err:
            client.follow(err)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{nodes} nodes not READY within {timeout:g}s")
        await asyncio.sleep(0.3)


async def soak(certs: Path, data: Path, config: SoakConfig) -> Report:
    cluster = ChaosCluster(
        certs,
        data,
        controllers=config.controllers,
        schedulers=config.schedulers,
        agents=config.agents,
    )
    report = Report(config)
    client = Client(certs, cluster.controller_addrs)
    try:
        await asyncio.to_thread(cluster.start)
        await _ready(client, config.agents, 90)
        names = [f"chaos-{i}" for i in range(config.workloads)]
        load = Load(client, names, config.seed)
        faults = Faults(cluster, config.seed, concurrent=config.concurrent)
        checker = Checker(
            cluster, faults, load.history, set(names), bound=config.bound, grace=config.grace
        )
        checking = asyncio.Event()
        jobs = [
            asyncio.create_task(load.run()),
            asyncio.create_task(faults.run()),
            asyncio.create_task(checker.run(checking)),
        ]
        start = time.monotonic()
        try:
            done, _ = await asyncio.wait(jobs, timeout=config.seconds)
            for job in done:
                job.result()  # a part that failed is the harness's bug: say so
            report.seconds = time.monotonic() - start
            await faults.stop()
            load.stopping.set()
            await jobs[0]
            report.converged_after = await checker.converge(client, config.converge)
            if report.converged_after is None:
                # What the services wait on, in their logs (kept with bench_chaos --keep).
                for m in cluster.members.values():
                    if m.role in ("controller", "scheduler") and m.alive:
                        assert m.proc is not None
                        m.proc.send_signal(signal.SIGUSR1)
                await asyncio.sleep(1.0)
        finally:
            checking.set()
            load.stopping.set()
            faults.stopping.set()
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        report.faults = faults.summary()
        report.requests = load.history.counts()
        report.violations = checker.violations
        report.fault_log = [
            f"{f.started - start:7.1f} "
            + ("    ..." if f.ended is None else f"{f.ended - start:7.1f}")
            + f" {f.kind} {f.target}"
            for f in faults.log
        ]
        for v in checker.violations:
            for name in names:
                if f"{name}:" in v.detail or f"{name}-" in v.detail:
                    report.histories[name] = [
                        f"{op.started - start:7.1f} {op.ended - start:7.1f} {op.kind} "
                        f"{op.replicas} {op.outcome} {op.error}"
                        for op in load.history.of(name)
                    ]
        report.samples = checker.samples
        report.most_copies = checker.most_copies
        report.lost_instances = checker.lost_instances
        return report
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        await asyncio.to_thread(cluster.close)
