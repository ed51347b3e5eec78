"""The benchmarks at tiny sizes, so the scripts cannot rot. The counts are asserted (what was
asked for happened, nothing was falsely marked NOT_READY or LOST); speeds are not, beyond the
wide bounds of the healing state machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.bench
@pytest.mark.timeout(180)
def test_run_all_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run_all.py"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    summary = json.loads(last)
    assert summary["bench"] == "all" and summary["failed"] == []
    assert summary["smoke"] is True and summary["machine"]["nproc"] >= 1
    # The one target that is a count, not a speed.
    assert summary["targets"]["heartbeat_false_not_ready==0"] is True
    results = summary["results"]
    assert set(results) == {
        "echo",
        "decisions",
        "reconcile",
        "placement",
        "heartbeat",
        "healing",
        "paging",
        "network",
        "health",
        "logs",
        "volumes",
        "agents",
    }
    # 100 instances checked each second: every check probed about once a second and passing
    # (none restarted); without checks, no probes.
    health = results["health"]
    assert health["instances"] == 100
    assert health["none"]["probes_per_s"] == 0
    for kind in ("tcp", "http"):
        figures = health[kind]
        assert (figures["not_healthy_at_end"], figures["restarts"]) == (0, 0), kind
        assert 0.5 * 100 <= figures["probes_per_s"] <= 1.5 * 100, kind
    # 50 lines followed through `orka logs -f`: each one seen, delays ordered.
    logs = results["logs"]
    assert logs["lines"] == 50
    assert 0 < logs["median_ms"] <= logs["p99_ms"] <= logs["max_ms"]
    # The instance network: every attachment given back (or, on a host without the plugins
    # or root, why it was not measured).
    network = results["network"]
    assert network.get("skipped") or (network["repeat"], network["leaked_attachments"]) == (3, 0)
    # 1,000 instances listed whole at every page size: the default size takes two pages.
    paging = results["paging"]["listings"]
    assert {k: v["objects"] for k, v in paging.items()} == {
        "default size (500)": 1000,
        "page size 1000": 1000,
        "page size 7": 1000,
        "one workload of 100, size 7": 100,
    }
    assert paging["default size (500)"]["pages"] == 2

    echo = results["echo"]
    assert echo["streams"] == 8
    assert echo["messages_per_s"] > 0 and echo["payload_bytes"] > 0

    # Smoke sizes: 100 nodes, 100 requests; every request fits somewhere.
    # Every instance of the 5 x 20 reached its workload's status, through passes that each
    # wrote some (one creates, one per binding batch, one per report batch).
    (reconcile,) = results["reconcile"]["runs"]
    assert (reconcile["workloads"], reconcile["replicas"], reconcile["complete"]) == (5, 20, True)
    assert reconcile["passes"] == 1 + 1 + 5 and reconcile["status_writes"] > 0
    decisions = results["decisions"]
    assert (decisions["nodes"], decisions["requests"]) == (100, 100)
    assert set(decisions["results"]) == {"spread", "binpack"}
    for policy, figures in decisions["results"].items():
        assert figures["placeable_fraction"] == 1.0, policy
        assert figures["decisions_per_s"] > 0, policy

    # 10 workloads x 20 replicas on 20 nodes, all RUNNING, no node ever seen NOT_READY; the
    # paced phase (20/s for 2 s) places all it asked for. etcd is skipped at smoke size.
    placement = results["placement"]
    assert (placement["nodes"], placement["workloads"], placement["replicas"]) == (20, 10, 20)
    sqlite = placement["sqlite"]
    assert (sqlite["instances"], sqlite["running_reached"], sqlite["complete"]) == (200, 200, True)
    assert sqlite["nodes_not_ready_seen"] == 0
    assert sqlite["paced_instances"] == sqlite["paced_running_reached"] == 40
    assert 0 < sqlite["p50_create_to_running_s"] <= sqlite["p99_create_to_running_s"]
    assert placement["etcd"] is None

    # 200 nodes heartbeating each second for 10 s: all connected and READY at the end, none
    # ever marked NOT_READY or LOST, and about one heartbeat per node per second arrived
    # (a wide band: this is a count, not a speed).
    heartbeat = results["heartbeat"]
    assert heartbeat["nodes"] == 200
    assert (
        heartbeat["agents_connected_at_end"],
        heartbeat["ready_at_end"],
        heartbeat["false_not_ready"],
        heartbeat["false_lost"],
    ) == (200, 200, 0, 0)
    assert 0.5 * 200 <= heartbeat["heartbeats_per_s"] <= 1.5 * 200

    # A node holding 10 instances is killed: it is LOST no sooner than node_lost_after less
    # one heartbeat interval (its last heartbeat came before the kill) and not much later,
    # and the replacements run only after that.
    healing = results["healing"]
    lost_after = healing["node_lost_after_s"]
    assert (healing["replicas"], healing["other_nodes"], lost_after) == (10, 3, 5.0)
    assert lost_after - 1.5 <= healing["kill_to_lost_s"] <= lost_after + 5.0
    assert healing["kill_to_lost_s"] <= healing["kill_to_all_running_elsewhere_s"]
    assert healing["kill_to_all_running_elsewhere_s"] <= lost_after + 10.0
    # Real agents: 4 `orka agent` processes run 4 x 25 instances, all RUNNING, every node
    # READY throughout, and the agents' CPU for it measured.
    agents = results["agents"]
    assert (agents["agents"], agents["instances"]) == (4, 100)
    assert (agents["running_reached"], agents["complete"]) == (100, True)
    assert agents["nodes_not_ready_seen"] == 0
    assert 0 < agents["p50_create_to_running_s"] <= agents["p99_create_to_running_s"]
    assert agents["agents_cpu_s"] > 0
    # Volumes: each backend this host can use provisioned, deleted and re-adopted every one.
    volumes = results["volumes"]
    assert volumes["repeat"] == 2
    for backend in ("ext4", "qcow2"):
        figures = volumes[backend]
        assert figures.get("skipped") or figures["adopted"] == 2, backend
        assert figures.get("skipped") or 0 < figures["provision_1Gi_ms"], backend
