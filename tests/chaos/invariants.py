"""What must hold however the soak's faults fall, read from the API and from the hosts' processes.

While faults run (sampled every `interval`):
* one instance never runs on two nodes at once, past `bound` seconds after the nodes involved
  are whole again (running, resumed, reachable);
* a workload never runs more copies than it may (its replicas, or what it had within `grace`
  seconds), past `bound`, once no fault is on or recent enough to explain it.
After the faults stop:
* every workload converges within `converge` seconds: the state of its last acknowledged
  request (or of a later one whose outcome is unknown) is stored, it has that many instances
  RUNNING, and the hosts run exactly those processes, each on the node the API names;
* no acknowledged write is lost; no process runs that no instance owns.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import psutil

from orka.api import controller_pb2 as pb
from orka.rpc.pages import list_all
from tests.chaos.cluster import ChaosCluster
from tests.chaos.faults import Faults
from tests.chaos.load import ABSENT, Client, History

DELETING = -2  # stored, marked for deletion


@dataclass(frozen=True)
class Copy:
    instance: str
    workload: str
    node: str | None
    pid: int


def host_copies(cluster: ChaosCluster, workloads: set[str]) -> list[Copy]:
    """Every live workload process of this soak on this host, with the node whose instance
    cgroups hold it."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["name"] != "sleep":
                continue
            env = proc.environ()
            if env.get("ORKA_WORKLOAD") not in workloads:
                continue
            with open(f"/proc/{proc.info['pid']}/cgroup") as f:
                node = cluster.agent_of_cgroup(f.read())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        found.append(Copy(env.get("ORKA_INSTANCE", "?"), env["ORKA_WORKLOAD"], node, proc.pid))
    return found


@dataclass
class Violation:
    rule: str
    detail: str
    at: float = field(default_factory=time.monotonic)


@dataclass
class Checker:
    cluster: ChaosCluster
    faults: Faults
    history: History
    names: set[str]
    bound: float = 3.0
    grace: float = 15.0
    interval: float = 0.5
    violations: list[Violation] = field(default_factory=list)
    samples: int = 0
    most_copies: int = 0  # the most workload processes seen at once
    lost_instances: int = 0  # instances the cluster replaced after losing their node
    # Since when each suspect condition has held without an excuse.
    _since: dict[tuple[str, str], float] = field(default_factory=dict)

    def _flag(self, key: tuple[str, str], now: float, detail: str) -> None:
        since = self._since.setdefault(key, now)
        if now - since > self.bound and not any(
            v.rule == key[0] and v.detail.startswith(key[1] + ":") for v in self.violations
        ):
            self.violations.append(Violation(key[0], f"{key[1]}: {detail}"))

    def sample(self) -> None:
        now = time.monotonic()
        copies = host_copies(self.cluster, self.names)
        self.samples += 1
        self.most_copies = max(self.most_copies, len(copies))
        seen: set[tuple[str, str]] = set()
        by_instance: dict[str, set[str]] = defaultdict(set)
        by_workload: dict[str, list[Copy]] = defaultdict(list)
        for c in copies:
            by_instance[c.instance].add(str(c.node))
            by_workload[c.workload].append(c)
        for instance, nodes in by_instance.items():
            if len(nodes) > 1 and not self.faults.excused(nodes, now, self.bound):
                key = ("twice", instance)
                seen.add(key)
                self._flag(key, now, f"runs on {sorted(nodes)} at once")
        quiet = not self.faults.excused(set(), now, self.grace)
        for workload, found in by_workload.items():
            allowed = self.history.allowed(workload, now, self.grace)
            if quiet and len(found) > allowed:
                key = ("over", workload)
                seen.add(key)
                where = sorted(f"{c.instance}@{c.node}" for c in found)
                self._flag(key, now, f"{len(found)} copies, at most {allowed}: {where}")
        for key in list(self._since):
            if key not in seen:
                del self._since[key]

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await asyncio.to_thread(self.sample)
            try:
                await asyncio.wait_for(stopping.wait(), self.interval)
            except TimeoutError:
                pass

    # ---- after the faults ----

    async def _stored(self, client: Client) -> dict[str, int]:
        out = {}
        for name in sorted(self.names):
            try:
                w = await client.stub().GetWorkload(pb.GetWorkloadRequest(name=name), timeout=5)
                # A workload being deleted is gone as far as its users are concerned; it must
                # still disappear (converge waits for that).
                out[name] = DELETING if w.deleting else w.spec.replicas
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                out[name] = ABSENT
        return out

    async def _converged(self, client: Client, stored: dict[str, int]) -> tuple[bool, str]:
        items, _ = await list_all(
            functools.partial(client.stub().ListInstances, timeout=5),
            pb.ListInstancesRequest(),
            "instances",
        )
        running: dict[str, str] = {}
        per: dict[str, int] = defaultdict(int)
        self.lost_instances = sum(1 for i in items if i.phase == pb.Instance.LOST)
        for inst in items:
            if inst.workload not in self.names:
                continue
            if inst.phase == pb.Instance.RUNNING:
                running[inst.name] = inst.node
                per[inst.workload] += 1
            elif inst.phase not in (
                pb.Instance.SUCCEEDED,
                pb.Instance.FAILED,
                pb.Instance.STOPPED,
                pb.Instance.LOST,
            ):
                return False, f"{inst.name} is {pb.Instance.Phase.Name(inst.phase)}"
        for name, replicas in stored.items():
            if per[name] != max(replicas, 0):
                return False, f"{name}: {per[name]} RUNNING, want {max(replicas, 0)}"
            if replicas == DELETING:
                return False, f"{name}: still being deleted"
        copies = await asyncio.to_thread(host_copies, self.cluster, self.names)
        on_hosts = {(c.instance, c.node) for c in copies}
        if len(on_hosts) != len(copies):
            return False, "an instance runs twice on one node"
        if on_hosts != set(running.items()):
            extra = sorted(on_hosts - set(running.items()))
            missing = sorted(set(running.items()) - on_hosts)
            return False, f"hosts differ from the API: not owned {extra}, not running {missing}"
        return True, ""

    async def converge(self, client: Client, timeout: float) -> float | None:
        """Seconds until the API and the hosts agree with what is stored (None: not within
        `timeout`; the last reason is recorded as a violation). What is stored is checked
        against what was acknowledged once, as soon as the API answers."""
        start = time.monotonic()
        why = "the API never answered"
        checked = False
        while time.monotonic() - start < timeout:
            try:
                stored = await self._stored(client)
                if not checked:
                    self.lost_writes(stored)
                    checked = True
                ok, why = await self._converged(client, stored)
            except grpc.aio.AioRpcError as err:
                ok, why = False, f"API: {err.code().name} {err.details()}"
                client.follow(err)
            if ok:
                return time.monotonic() - start
            await asyncio.sleep(0.5)
        self.violations.append(Violation("converge", f"not within {timeout:g}s: {why}"))
        return None

    def lost_writes(self, stored: dict[str, int]) -> None:
        for name, replicas in stored.items():
            allowed = self.history.candidates(name)
            if (ABSENT if replicas == DELETING else replicas) not in allowed:
                self.violations.append(
                    Violation("lost-write", f"{name}: stored {replicas}, acknowledged {allowed}")
                )
