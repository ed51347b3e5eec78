"""Live views on a real cluster (controller, scheduler, two agents running real processes):
`orka get instances -w` prints each change once, `orka describe instance` shows the placement
and a restart with its exit code, and `orka apply --wait` exits 0 ready, 1 failed, 2 timed out.
The CLI runs as a subprocess, so this loop keeps serving the cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster, eventually, process_spec


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        for name in ("node-1", "node-2"):
            await c.add_agent(name, runtimes=["process"], heartbeat_interval=0.2)
        yield c
    finally:
        await c.stop()


def cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ORKA_", "GRPC_"))}


def client_flags(cluster: Cluster) -> list[str]:
    assert cluster.controller is not None
    return ["--controller", f"127.0.0.1:{cluster.controller.port}", "--certs", str(cluster.certs)]


async def orka(cluster: Cluster, *args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        *args,
        *client_flags(cluster),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def history_rows(cluster: Cluster, workload: str, after: int) -> list[tuple[str, str]]:
    """(event type, phase) of every write of the workload's instances after `after`, as the
    controller made them: what a watcher must print, once each."""
    assert cluster.controller is not None
    names = {1: "ADDED", 2: "MODIFIED", 3: "DELETED"}
    rows = []
    for e in cluster.controller.events.history:
        v = e.value
        if e.revision > after and type(v).__name__ == "Instance" and v.workload == workload:  # type: ignore[attr-defined]
            rows.append((names[int(e.type)], v.phase.value))  # type: ignore[attr-defined]
    return rows


async def test_get_watch_describe_and_apply_wait(cluster: Cluster, tmp_path: Path) -> None:
    assert cluster.api is not None and cluster.controller is not None
    # node-2 takes nothing: the placement entry must say it was passed over, and why.
    await cluster.api.CordonNode(pb.CordonNodeRequest(name="node-2"))

    # 1. get instances -w sees an instance go PENDING -> RUNNING, then its deletion.
    watcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        "get",
        "instances",
        "-w",
        "--output-watch-events",
        "--workload",
        "web",
        *client_flags(cluster),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    assert watcher.stdout is not None and watcher.stderr is not None
    header = (await asyncio.wait_for(watcher.stdout.readline(), 30)).decode()
    assert header.split()[:5] == ["EVENT", "NAME", "WORKLOAD", "NODE", "PHASE"], header
    listed_at = cluster.controller.repo.revision
    await cluster.api.CreateWorkload(
        pb.CreateWorkloadRequest(spec=process_spec("web", 1, command=["sleep", "100"]))
    )
    (inst,) = await eventually(lambda: cluster.running("web"))
    await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))
    await eventually(lambda: _none(cluster, "web"))
    expected = history_rows(cluster, "web", listed_at)
    assert expected[-1][0] == "DELETED"
    rows: list[tuple[str, str]] = []
    while len(rows) < len(expected):
        line = (await asyncio.wait_for(watcher.stdout.readline(), 10)).decode()
        cells = line.split()
        assert cells[1] == inst.name, line
        rows.append((cells[0], cells[4]))
    assert rows == expected
    phases = [p for _, p in rows]
    assert phases.index("PENDING") < phases.index("RUNNING")
    # Nothing more: each change exactly once.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(watcher.stdout.readline(), 0.5)
    watcher.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(watcher.wait(), 10) == 130
    assert b"Traceback" not in await watcher.stderr.read()

    # 2. describe instance: the placement (chosen node, node-2 passed over) and a restart
    # with the exit code of a process that exits 3.
    await cluster.api.CreateWorkload(
        pb.CreateWorkloadRequest(
            spec=process_spec("crash", 1, command=["sh", "-c", "sleep 0.3; exit 3"])
        )
    )

    async def restarted() -> pb.Instance | None:
        insts = await cluster.instances("crash")
        return next((i for i in insts if i.restarts >= 1), None)

    crashing = await eventually(restarted)
    code, out, err = await orka(cluster, "describe", "instance", crashing.name)
    assert code == 0, err
    section = out[out.index("\nActivity:") :]
    assert "Scheduled" in section
    assert "placed on node-1; 1 node passed over: 1 node: cordoned" in section, section
    assert "Restarted" in section and "exited with code 3; restarted" in section, section
    code, out, err = await orka(cluster, "describe", "instance", crashing.name, "-o", "json")
    doc = json.loads(out)
    reasons = {a["reason"] for a in doc["activities"]}
    assert {"Scheduled", "Restarted"} <= reasons, doc["activities"]

    # 3. apply --wait: 0 when ready, 1 for a workload that cannot succeed, 2 on timeout.
    await cluster.api.UncordonNode(pb.UncordonNodeRequest(name="node-2"))
    ok = b"name: ok\nkind: process\ncommand: [sleep, '100']\nreplicas: 2\n"
    code, out, err = await orka(cluster, "apply", "-f", "-", "--wait", "--timeout", "30", stdin=ok)
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == "workload/ok created"
    assert "workload/ok: desired 2, placed 2, running 2, healthy 2: ready" in lines
    assert lines[-1] == "workload/ok ready: 2/2 running"
    assert "\x1b" not in out  # piped: plain lines

    # No node has the label: unschedulable for a reason waiting cannot fix.
    nowhere = b"name: nowhere\nkind: process\ncommand: [sleep, '100']\nreplicas: 1\n"
    nowhere += b"node_selector: {disk: ssd}\n"
    code, out, err = await orka(
        cluster, "apply", "-f", "-", "--wait", "--timeout", "30", stdin=nowhere
    )
    assert code == 1, (out, err)
    assert "no node can ever take a replica as specified" in err, err
    # A command that cannot start, restart policy NEVER: the replica FAILED for good.
    bad = b"name: bad\nkind: process\ncommand: [/nonexistent/bin]\nreplicas: 1\n"
    bad += b"restart_policy: never\n"
    code, out, err = await orka(cluster, "apply", "-f", "-", "--wait", "--timeout", "30", stdin=bad)
    assert code == 1, (out, err)
    assert "restart policy is NEVER" in err, err

    # Three replicas, at most one per node, two nodes: the third waits (for a node to come).
    slow = b"name: slow\nkind: process\ncommand: [sleep, '100']\nreplicas: 3\nmax_per_node: 1\n"
    code, out, err = await orka(cluster, "apply", "-f", "-", "--wait", "--timeout", "1", stdin=slow)
    assert code == 2, (out, err)
    assert "timed out after 1s" in err


async def _none(cluster: Cluster, workload: str) -> bool:
    return not await cluster.instances(workload)
