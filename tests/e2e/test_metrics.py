"""End to end: every service's Prometheus endpoint (`--metrics-listen`) reports what really
happened in a cluster of OS processes: placements, an unschedulable workload's reason code,
a node that left, instance phases and health, RPCs by method and code, store commits."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orka.api import controller_pb2 as pb
from tests.e2e.procs import ProcessCluster, free_port, nodes_ready, run_orka
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

NODES = ["node-1", "node-2"]
REPLICAS = 4

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(port: int) -> Samples:
    """Every sample of one endpoint, keyed by name and sorted labels."""

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    text = await asyncio.to_thread(get)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for (n, labels), v in samples.items():
        if n == name:
            out[dict(labels)[label]] += v
    return {k: v for k, v in out.items() if v}


async def test_scrapes_report_what_happened(certs_dir: Path, tmp_path: Path) -> None:
    c = ProcessCluster(certs_dir, tmp_path, runtime="fake")
    ports = {name: free_port() for name in ("controller", "scheduler", *NODES)}

    def flag(name: str) -> tuple[str, str]:
        return ("--metrics-listen", f"127.0.0.1:{ports[name]}")

    try:
        c.start_scheduler(*flag("scheduler"))
        c.start_controller("controller", None, *flag("controller"))
        for name in NODES:
            c.start_agent(name, "--leave-timeout", "30", *flag(name))
        api = await c.connect()
        await eventually(lambda: nodes_ready(c, NODES), timeout=30)

        web = pb.WorkloadSpec(
            name="web", kind=pb.WorkloadSpec.PROCESS, command=["sleep", "1000"], replicas=REPLICAS
        )
        nowhere = pb.WorkloadSpec(
            name="nowhere",
            kind=pb.WorkloadSpec.PROCESS,
            command=["sleep", "1000"],
            node_selector={"zone": "mars"},
            replicas=1,
        )
        for spec in (web, nowhere):
            await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api.GetWorkload(pb.GetWorkloadRequest(name="no-such"), timeout=5)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND

        async def all_running() -> bool:
            return len(await c.running("web")) == REPLICAS

        await eventually(all_running, timeout=30)
        # node-2 leaves: its instances are placed again on node-1, then it exits.
        c.services["node-2"].signal(signal.SIGTERM)
        assert c.services["node-2"].wait(timeout=40) == 0

        async def settled() -> bool:
            running = await c.running("web")
            nodes = await c.nodes()
            return (
                len(running) == REPLICAS
                and {i.node for i in running} == {"node-1"}
                and nodes["node-2"] == pb.Node.LEFT
            )

        await eventually(settled, timeout=40)

        # The controller's endpoint against what its API lists, until no change races it.
        async def controller_agrees() -> Samples | None:
            samples = await scrape(ports["controller"])
            nodes = await c.nodes()
            instances = [*await c.instances("web"), *await c.instances("nowhere")]
            placed = [i for i in instances if i.node]
            want_nodes = collections.Counter(pb.Node.State.Name(s) for s in nodes.values())
            want_phases = collections.Counter(pb.Instance.Phase.Name(i.phase) for i in instances)
            want_health = collections.Counter(
                pb.Instance.Health.Name(i.health or pb.Instance.UNKNOWN) for i in instances
            )
            ok = (
                value(samples, "orka_placements_total") == len(placed)
                and by_label(samples, "orka_nodes", "state") == want_nodes
                and by_label(samples, "orka_instances", "phase") == want_phases
                and by_label(samples, "orka_instances", "health") == want_health
            )
            return samples if ok else None

        samples = await eventually(controller_agrees, timeout=20)
        # Every instance of web was bound once: 4, plus one more per instance node-2 had.
        moved = value(samples, "orka_placements_total") - REPLICAS
        assert 1 <= moved <= REPLICAS - 1, samples
        assert value(samples, "orka_placement_latency_seconds_count") == REPLICAS + moved
        assert (
            value(samples, "orka_unschedulable_attempts_total", reason="NODE_SELECTOR_MISMATCH")
            >= 1
        )
        assert value(samples, "orka_unschedulable_attempts_total", reason="INSUFFICIENT_CPU") == 0
        rpc = "orka_rpc_requests_total"
        ctl = "orka.v1.Controller"
        assert value(samples, rpc, service=ctl, method="GetWorkload", code="NOT_FOUND") == 1
        assert value(samples, rpc, service=ctl, method="CreateWorkload", code="OK") == 2
        assert (
            value(samples, "orka_rpc_duration_seconds_count", service=ctl, method="CreateWorkload")
            == 2
        )
        assert value(samples, "orka_store_commit_duration_seconds_count", backend="sqlite") >= 4
        assert value(samples, "orka_controller_leader") == 1
        assert value(samples, "orka_placement_queue_depth", stage="waiting") == 1  # nowhere

        sched = await scrape(ports["scheduler"])
        assert by_label(sched, "orka_scheduler_nodes", "state") == {"READY": 1, "LEFT": 1}
        assert value(sched, "orka_node_heartbeat_age_seconds_count") == 1  # LEFT not counted
        assert value(sched, rpc, service="orka.v1.Scheduler", method="Place", code="OK") >= 1
        # Streams count when they end: node-2's agent stream has, node-1's is still open.
        connects = {
            dict(labels)["code"]: n
            for (name, labels), n in sched.items()
            if name == rpc and dict(labels)["method"] == "Connect"
        }
        assert sum(connects.values()) == 1, connects

        # `orka top nodes` against the same cluster: node-1 runs every instance of web (its
        # count comes with the scheduler's next usage report, so it may take a moment).
        async def top_nodes() -> dict[str, dict[str, object]] | None:
            out = await run_orka(c, "top", "nodes", "-o", "json")
            tops = {t["name"]: t for t in json.loads(out)}
            return tops if tops["node-1"]["instances"] == REPLICAS else None

        tops = await eventually(top_nodes, timeout=20, interval=0.5)
        assert set(tops) == set(NODES)
        assert tops["node-1"]["state"] == "READY" and tops["node-2"]["state"] == "LEFT"
        assert tops["node-1"]["cpu_allocatable_millis"] > 0

        agent = await scrape(ports["node-1"])
        assert value(agent, "orka_agent_instances", phase="RUNNING", health="HEALTHY") == REPLICAS
        assert value(agent, "process_resident_memory_bytes") > 0
    finally:
        await c.close()
