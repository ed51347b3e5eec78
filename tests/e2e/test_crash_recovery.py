"""Crash recovery end to end: services as OS processes, the truth in a real etcd.

* SIGKILL the leading controller while 100 instances are being placed: the standby takes over
  and every instance ends up bound exactly once.
* SIGKILL the scheduler under 10 agents and 50 running instances: after its restart every agent
  is back, nothing was restarted or duplicated, and a new workload places.

Figures (failover time, recovery time) are printed, never asserted on (run with -s).
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.rpc.pages import list_all
from orka.security.issue import issue_cert, pair_dir
from tests.e2e.procs import ProcessCluster, free_port, nodes_ready, run_orka, sleep_spec
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e


spec = sleep_spec


def agent_certs(certs: Path, names: list[str]) -> None:
    """The shared certs dir has node-1..6; bigger tests issue what they lack."""
    for name in names:
        if not (pair_dir(certs, "agent", name) / f"agent-{name}.crt").exists():
            issue_cert(certs, "agent", name)


async def answers(c: ProcessCluster) -> bool:
    await c.nodes()  # raises UNAVAILABLE unless the controller leads
    return True


async def all_instances(c: ProcessCluster) -> list[pb.Instance]:
    assert c.api is not None
    items, _ = await list_all(
        functools.partial(c.api.ListInstances, timeout=5), pb.ListInstancesRequest(), "instances"
    )
    return items


async def settled(
    c: ProcessCluster, workloads: dict[str, int]
) -> dict[str, list[pb.Instance]] | None:
    """Every workload has exactly `replicas` RUNNING and nothing else alive, else None."""
    by: dict[str, list[pb.Instance]] = {w: [] for w in workloads}
    for inst in await all_instances(c):
        if inst.phase in (pb.Instance.SUCCEEDED, pb.Instance.FAILED, pb.Instance.STOPPED):
            continue
        if inst.phase == pb.Instance.LOST:
            continue
        if inst.phase != pb.Instance.RUNNING:
            return None
        by.setdefault(inst.workload, []).append(inst)
    if any(len(by[w]) != n for w, n in workloads.items()):
        return None
    return by


def agent_states(c: ProcessCluster, names: list[str]) -> dict[str, dict[str, str]]:
    """Per agent, what its state file says it runs: instance -> phase."""
    out: dict[str, dict[str, str]] = {}
    for name in names:
        path = c.data / "agents" / name / "agent-state.json"
        data = json.loads(path.read_text()) if path.exists() else {"instances": {}}
        out[name] = {n: str(r.get("phase")) for n, r in data.get("instances", {}).items()}
    return out


def live_on_agents(states: dict[str, dict[str, str]]) -> Counter[str]:
    live = Counter[str]()
    for insts in states.values():
        for name, phase in insts.items():
            if phase.upper() in ("RUNNING", "STARTING", "SCHEDULED"):
                live[name] += 1
    return live


def check_bound_once(
    by: dict[str, list[pb.Instance]], states: dict[str, dict[str, str]], replicas: dict[str, int]
) -> None:
    names = [i.name for insts in by.values() for i in insts]
    assert len(names) == len(set(names)), "an instance name appears twice"
    for w, insts in by.items():
        assert len(insts) == replicas[w], f"{w}: {len(insts)} running, want {replicas[w]}"
    live = live_on_agents(states)
    twice = {n: k for n, k in live.items() if k > 1}
    assert not twice, f"instances live on more than one agent: {twice}"
    for insts in by.values():
        for i in insts:
            assert states[i.node].get(i.name, "").upper() == "RUNNING", (
                f"{i.name} is RUNNING on {i.node} per the controller, not per its agent"
            )
    # Nothing runs on an agent that the controller does not count as a live replica.
    bound = set(names)
    strays = [n for n in live if n not in bound]
    assert not strays, f"agents run instances the controller does not know: {strays}"


async def files_agree(
    c: ProcessCluster, nodes: list[str], workloads: dict[str, int], timeout: float = 10.0
) -> tuple[dict[str, list[pb.Instance]], dict[str, dict[str, str]]]:
    """Wait until the agents' state files (written coalesced, a moment after a change) say
    what the controller says: settled, each instance RUNNING on its node only. Fails with
    check_bound_once's complaint if they still disagree after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        by = await eventually(lambda: settled(c, workloads), timeout=timeout)
        states = agent_states(c, nodes)
        try:
            check_bound_once(by, states, workloads)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        else:
            return by, states
        await asyncio.sleep(0.05)


async def test_leader_sigkill_while_placing_100(fake_cluster: ProcessCluster) -> None:
    c = fake_cluster
    nodes = [f"node-{i}" for i in range(1, 6)]
    port_a, port_b = c.controller_port, free_port()
    c.start_scheduler()
    leader = c.start_controller("controller-a", port_a)
    await c.connect(port_a)
    await eventually(lambda: answers(c), timeout=30)  # it leads
    c.start_controller("controller-b", port_b)
    for n in nodes:
        c.start_agent(n)
    await eventually(lambda: nodes_ready(c, nodes), timeout=30)

    # The standby redirects clearly.
    await c.connect(port_b)

    async def redirect() -> str | None:
        try:
            await c.nodes()
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE and "leader is at" in (
                err.details() or ""
            ):
                return err.details()
        return None

    details = await eventually(redirect, timeout=20)
    assert f"the leader is at 127.0.0.1:{port_a}" in details
    # The orka command, given only the standby, follows its NOT_LEADER details to the leader.
    listed = json.loads(
        await run_orka(c, "get", "nodes", "-o", "json", controller=f"127.0.0.1:{port_b}")
    )
    assert sorted(n["name"] for n in listed) == nodes

    await c.connect(port_a)
    assert c.api is not None
    workloads = {f"w{i}": 10 for i in range(10)}
    for name, n in workloads.items():
        await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(name, n)), timeout=10)
    before = await all_instances(c)
    running_before = sum(1 for i in before if i.phase == pb.Instance.RUNNING)
    leader.signal(signal.SIGKILL)
    killed = time.monotonic()
    leader.wait(10)

    await c.connect(port_b)
    await eventually(lambda: answers(c), timeout=30, interval=0.05)
    failover = time.monotonic() - killed
    print(
        f"\ncontroller failover: {failover:.2f}s "
        f"(instances running at the kill: {running_before}/{sum(workloads.values())})"
    )

    await eventually(lambda: settled(c, workloads), timeout=60)
    await files_agree(c, nodes, workloads)


async def test_scheduler_sigkill_restart_50(fake_cluster: ProcessCluster) -> None:
    c = fake_cluster
    nodes = [f"node-{i:02d}" for i in range(1, 11)]
    agent_certs(c.certs, nodes)
    scheduler = c.start_scheduler()
    c.start_controller()
    for n in nodes:
        c.start_agent(n)
    await c.connect()
    await eventually(lambda: nodes_ready(c, nodes), timeout=40)
    assert c.api is not None
    workloads = {f"svc{i}": 10 for i in range(5)}
    for name, n in workloads.items():
        await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(name, n)), timeout=10)
    await eventually(lambda: settled(c, workloads), timeout=60)
    by, states = await files_agree(c, nodes, workloads)
    before = {i.name: (i.node, i.restarts, i.start_time) for v in by.values() for i in v}
    states_before = {a: set(s) for a, s in states.items()}
    assert len(before) == 50

    scheduler.signal(signal.SIGKILL)
    scheduler.wait(10)
    restarted_wall, restarted = time.time(), time.monotonic()
    c.start_scheduler()

    async def reregistered() -> bool:
        assert c.api is not None
        nodes, _ = await list_all(
            functools.partial(c.api.ListNodes, timeout=5), pb.ListNodesRequest(), "nodes"
        )
        fresh = [
            n
            for n in nodes
            if n.state == pb.Node.READY
            and n.last_heartbeat_time.ToNanoseconds() >= (restarted_wall - 0.5) * 1e9
        ]
        return len(fresh) == len(nodes)

    await eventually(reregistered, timeout=60)
    back = time.monotonic() - restarted
    await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("after", 5)), timeout=10)
    await eventually(lambda: settled(c, {**workloads, "after": 5}), timeout=60)
    placed = time.monotonic() - restarted
    print(f"\nscheduler restart: agents back {back:.2f}s, new workload running {placed:.2f}s")

    by, states_after = await files_agree(c, nodes, {**workloads, "after": 5})
    after = {i.name: (i.node, i.restarts, i.start_time) for v in by.values() for i in v}
    for name, was in before.items():
        assert after.get(name) == was, f"{name}: {was} before the crash, {after.get(name)} after"
    new = {i.name for i in by["after"]}
    for agent, names in states_before.items():
        assert set(states_after[agent]) - new == names, f"{agent}'s instances changed"
