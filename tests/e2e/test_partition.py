"""End to end, a real network partition: one agent runs in a network namespace of its own,
reaching the scheduler over a veth pair, and iptables inside that namespace drops all its
traffic for longer than `--node-lost-after`, then lets it through again. The services are OS
processes, the instances real `sleep` processes (the process driver), counted on the host.

Three workloads, one per way a lost node's instances are handled (WorkloadSpec.on_node_lost):
- `keep`  (wait, max_disconnect 120s): its instance on the partitioned node is DISCONNECTED,
  not replaced, and runs on as the same process when the node is back.
- `move`  (replace, room elsewhere): its instance there is replaced on another node; when the
  node is back, the old copy is stopped within about a heartbeat.
- `stay`  (replace, max_per_node 1 on 3 nodes): the replacement has nowhere to go and stays
  PENDING; when the node is back, the running original is kept and the replacement dropped
  (issue 18: it was killed and started again).
In every case at most `replicas` copies run on the hosts afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from orka.security.issue import init_certs
from tests.e2e.procs import ProcessCluster, Service, host_copies, nodes_ready
from tests.integration.cluster import eventually

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("iptables")),
        reason="a network namespace and iptables need root, ip and iptables",
    ),
]

NODES = ["node-1", "node-2", "node-3"]
CUT = "node-3"  # the agent in the namespace
REPLICAS = 3


@dataclass
class Netns:
    """A namespace joined to the host by a veth pair: the host end `host_ip`, the inside end
    `inside_ip`, a /30 of 10.251.0.0/16 of its own (picked free of the host's addresses)."""

    name: str
    veth: str
    host_ip: str
    inside_ip: str

    def run(self, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.name, *cmd], check=True, capture_output=True)

    def cut(self) -> None:
        """Drop every packet in and out of the namespace (its own tables: the host's are
        untouched)."""
        self.run("iptables", "-I", "INPUT", "-j", "DROP")
        self.run("iptables", "-I", "OUTPUT", "-j", "DROP")

    def heal(self) -> None:
        self.run("iptables", "-D", "INPUT", "-j", "DROP")
        self.run("iptables", "-D", "OUTPUT", "-j", "DROP")


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for _ in range(100):
        third = secrets.randbelow(250) + 1
        if f"10.251.{third}." not in used:
            return third
    raise RuntimeError("no free 10.251.x.0/30 on this host")


@contextlib.contextmanager
def netns() -> Iterator[Netns]:
    tag = secrets.token_hex(3)
    third = _free_subnet()
    ns = Netns(f"orka-pt-{tag}", f"opt{tag}h", f"10.251.{third}.1", f"10.251.{third}.2")
    inside = f"opt{tag}n"
    steps = [
        ["ip", "netns", "add", ns.name],
        ["ip", "link", "add", ns.veth, "type", "veth", "peer", "name", inside],
        ["ip", "link", "set", inside, "netns", ns.name],
        ["ip", "addr", "add", f"{ns.host_ip}/30", "dev", ns.veth],
        ["ip", "link", "set", ns.veth, "up"],
        ["ip", "-n", ns.name, "addr", "add", f"{ns.inside_ip}/30", "dev", inside],
        ["ip", "-n", ns.name, "link", "set", inside, "up"],
        ["ip", "-n", ns.name, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield ns
    finally:
        # The namespace's iptables rules go with it; the veth pair with either end.
        subprocess.run(["ip", "link", "del", ns.veth], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "delete", ns.name], capture_output=True, check=False)


class NetnsService(Service):
    """A service started inside a network namespace (`ip netns exec`)."""

    def __init__(self, name: str, args: list[str], log: Path, ns: str) -> None:
        super().__init__(name, args, log)
        self.ns = ns

    def start(self) -> None:
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-m", "orka.cli.main", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ORKA_LOG_LEVEL": "info"},
            start_new_session=True,
        )
        out.close()


class PartitionCluster(ProcessCluster):
    """The scheduler listens on the veth's host end, so that the agent inside the namespace
    reaches it; the other services reach that host address as well."""

    def __init__(self, certs: Path, data: Path, ns: Netns) -> None:
        super().__init__(certs, data)
        self.ns = ns

    @property
    def scheduler_addr(self) -> str:
        return f"{self.ns.host_ip}:{self.scheduler_port}"

    def start_agent_inside(self, name: str) -> None:
        self.start_agent(name)
        plain = self.services.pop(name)
        plain.kill()
        svc = NetnsService(name, plain.args, plain.log, self.ns.name)
        self.services[name] = svc
        svc.start()


def spec(name: str, wait: bool = False, max_per_node: int = 1) -> pb.WorkloadSpec:
    s = pb.WorkloadSpec(
        name=name,
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "1000"],
        replicas=REPLICAS,
        max_per_node=max_per_node,
        stop_grace_period={"seconds": 1},
    )
    if wait:
        s.on_node_lost = pb.WorkloadSpec.ON_NODE_LOST_WAIT
        s.max_disconnect.seconds = 120
    return s


async def test_partitioned_agent_wait_keeps_replace_moves_and_stops_old_copies(
    tmp_path: Path,
) -> None:
    with netns() as ns:
        certs = tmp_path / "certs"
        init_certs(certs, nodes=NODES, extra_hosts=[ns.host_ip])
        c = PartitionCluster(certs, tmp_path, ns)
        try:
            await _scenario(c, ns)
        except BaseException:
            print(c.logs())
            raise
        finally:
            await c.close()
            for w in ("keep", "move", "stay"):
                for pid in host_copies(w).values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(os.getpgid(pid), 9)


async def _scenario(c: PartitionCluster, ns: Netns) -> None:
    c.start_scheduler()
    c.start_controller()
    for name in NODES:
        if name == CUT:
            c.start_agent_inside(name)
        else:
            c.start_agent(name)
    api = await c.connect()
    await eventually(lambda: nodes_ready(c, NODES), timeout=30)
    for s in (spec("keep", wait=True), spec("move", max_per_node=2), spec("stay")):
        await api.CreateWorkload(pb.CreateWorkloadRequest(spec=s))

    async def placed() -> dict[str, dict[str, str]] | None:
        out: dict[str, dict[str, str]] = {}
        for w in ("keep", "move", "stay"):
            running = await c.running(w)
            if len(running) != REPLICAS or len(host_copies(w)) != REPLICAS:
                return None
            out[w] = {i.name: i.node for i in running}
        return out

    before = await eventually(placed, timeout=60)
    pids = {w: host_copies(w) for w in before}
    cut_copy = {
        w: next((n for n, node in m.items() if node == CUT), None) for w, m in before.items()
    }
    assert cut_copy["keep"] and cut_copy["stay"], before  # max_per_node 1 on 3 nodes
    assert cut_copy["move"], f"spread placement put no `move` replica on {CUT}: {before}"

    ns.cut()
    cut_at = time.monotonic()

    async def partitioned() -> bool:
        keep = {i.name: i for i in await c.instances("keep")}
        move = await c.running("move")
        stay = await c.instances("stay")
        return (
            (await c.nodes()).get(CUT) == pb.Node.LOST
            and keep[cut_copy["keep"]].phase == pb.Instance.DISCONNECTED
            and keep[cut_copy["keep"]].reason == "NodeDisconnected"
            and keep[cut_copy["keep"]].HasField("disconnect_time")
            and len(keep) == REPLICAS  # nothing placed in its stead
            and sum(i.node != CUT for i in move) == REPLICAS  # replaced elsewhere
            and any(i.phase == pb.Instance.PENDING for i in stay)  # nowhere to go
        )

    await eventually(partitioned, timeout=40, interval=0.2)
    # The partitioned node's copies still run: 4 of `move` while it is away (replace).
    assert set(host_copies("keep")) == set(pids["keep"])
    assert cut_copy["move"] in host_copies("move")
    print(
        f"partition: node LOST and replacements made {time.monotonic() - cut_at:.1f}s after the cut"
    )

    ns.heal()
    await eventually(lambda: nodes_ready(c, NODES), timeout=40, interval=0.1)
    back_at = time.monotonic()

    async def settled() -> bool:
        return all(len(host_copies(w)) <= REPLICAS for w in before)

    await eventually(settled, timeout=20, interval=0.1)
    overlap = time.monotonic() - back_at
    print(f"reconnect: at most {REPLICAS} copies of each {overlap:.2f}s after the node was READY")
    # One heartbeat (1 s), with room for a loaded 2-core machine.
    assert overlap < 3.0

    async def converged() -> dict[str, dict[str, str]] | None:
        got = await placed()
        # The dropped replacement of `stay` is removed (it was never placed).
        if got is None or any(i.phase == pb.Instance.PENDING for i in await c.instances("stay")):
            return None
        return got

    after = await eventually(converged, timeout=30, interval=0.2)
    # wait: the same instances, on the same nodes, the same processes: nothing restarted.
    assert after["keep"] == before["keep"]
    assert host_copies("keep") == pids["keep"]
    # replace with nowhere to go: the original kept, the same process; the replacement dropped.
    assert after["stay"] == before["stay"]
    assert host_copies("stay") == pids["stay"]
    # replace with room elsewhere: the old copy stopped on its node, the replacement kept.
    assert cut_copy["move"] not in after["move"]
    assert cut_copy["move"] not in host_copies("move")
    assert CUT not in after["move"].values()
    for w in ("keep", "stay"):
        for i in await c.running(w):
            assert i.restarts == 0, i
    # And it stays so: never more than `replicas` copies on the hosts, for a few heartbeats.
    end = time.monotonic() + 3
    while time.monotonic() < end:
        for w in before:
            assert len(host_copies(w)) == REPLICAS, (w, host_copies(w))
        await asyncio.sleep(0.2)
