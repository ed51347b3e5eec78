"""The reconciler's planning pass and its handling of what the scheduler reports."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import code_pb2

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.controller import reconciler as reconciler_module
from orka.controller.commands import NodeCommand, NodeSynced, stop_command
from orka.controller.link import (
    CommandResult,
    command_result_from_pb,
    command_to_pb,
    updates_from_pb,
)
from orka.controller.placement import PlacementQueue, _Backoff
from orka.controller.reconciler import (
    CRASH_HEALTHY_RUN,
    FULL_PASS_EVERY,
    KEEP_FINISHED,
    RESEND_AFTER,
    START_GRACE,
    CrashBackoff,
    History,
    Reconciler,
    _node_changed,
    new_instance,
)
from orka.controller.repo import Change, Repo
from orka.controller.tally import Tally
from orka.errors import AlreadyExists, Unavailable
from orka.models import (
    HealthState,
    Instance,
    InstancePhase,
    InstanceReport,
    Node,
    NodeState,
    Resources,
    RestartPolicy,
    Rollout,
    RolloutState,
    UpdateStrategy,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert
from orka.store.base import Create
from orka.store.memory import MemoryStore

P = InstancePhase


@dataclass
class DummyLink:
    """Records what the reconciler asks of the scheduler; every command succeeds."""

    # As sent on the wire: each test also checks the one converter of each command.
    commands: list[apb.NodeCommand] = field(default_factory=list)
    set_nodes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def command(self, cmds: Sequence[NodeCommand]) -> list[CommandResult]:
        self.commands.extend(command_to_pb(c) for c in cmds)
        return [command_result_from_pb(apb.CommandResult(status=convert.ok_status())) for _ in cmds]

    async def set_node(self, name: str, **kw: Any) -> None:
        self.set_nodes.append((name, kw))

    async def place(self, items: list[apb.Assignment]) -> apb.PlaceResponse:
        raise AssertionError("unit tests never place")


@dataclass
class Env:
    repo: Repo
    link: DummyLink
    queue: PlacementQueue
    rec: Reconciler

    async def put(self, *objs: Workload | Instance | Node) -> None:
        def plan() -> list[Change]:
            changes = []
            for o in objs:
                kind = (
                    "workloads"
                    if isinstance(o, Workload)
                    else "instances"
                    if isinstance(o, Instance)
                    else "nodes"
                )
                changes.append(Change(kind, o.name, o))  # type: ignore[arg-type]
            return changes

        await self.repo.mutate(plan)

    async def plan(self) -> list[Change]:
        return await self.repo.mutate(self.rec.plan)

    def of(self, workload: str = "web") -> list[Instance]:
        return sorted(self.repo.instances_of(workload), key=lambda i: (i.created_at, i.name))

    def inst(self, name: str) -> Instance:
        return self.repo.instances[name]

    async def set_inst(self, name: str, **update: Any) -> None:
        await self.put(self.inst(name).model_copy(update=update))


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    store = MemoryStore()
    await store.open()
    repo = Repo(store)
    link = DummyLink()
    queue = PlacementQueue(repo, link)  # type: ignore[arg-type]
    # The builders' times are small numbers (1.0, 2.0, ...): an age bound would remove every
    # finished instance, so the fixture keeps them for ever; the age bound is tested apart.
    history = History(retention=1e15)
    yield Env(repo, link, queue, Reconciler(repo, link, queue, history))  # type: ignore[arg-type]
    await store.close()


def workload(
    name: str = "web",
    replicas: int = 3,
    policy: RestartPolicy = RestartPolicy.ALWAYS,
    **kw: Any,
) -> Workload:
    spec = WorkloadSpec(
        name=name,
        kind=WorkloadKind.PROCESS,
        command=["sleep", "100"],
        replicas=replicas,
        restart_policy=policy,
    )
    return Workload(spec=spec, **kw)


_seq = iter(range(1, 1_000_000))


def inst(
    name: str, phase: InstancePhase = P.RUNNING, node: str | None = None, **kw: Any
) -> Instance:
    if node is None:
        node = "" if phase is P.PENDING else "n1"
    kw.setdefault("workload", "web")
    kw.setdefault("created_at", float(next(_seq)))
    if phase in (P.SUCCEEDED, P.FAILED, P.STOPPED, P.LOST):
        kw.setdefault("finished_at", kw["created_at"])
    if phase is P.RUNNING:
        kw.setdefault("health", HealthState.HEALTHY)  # as an agent reports one without a check
    return Instance(name=name, phase=phase, node=node, **kw)


def node(name: str = "n1", **kw: Any) -> Node:
    return Node(name=name, **kw)


def active(insts: Iterable[Instance]) -> list[Instance]:
    return [i for i in insts if not i.terminal and not i.desired_stop and not i.replaced_by]


# ---- planning: replicas ----


async def test_new_workload_gets_one_pending_instance_per_replica(env: Env) -> None:
    await env.put(workload(replicas=3, generation=4))
    await env.plan()
    insts = env.of()
    assert len(insts) == 3
    assert {i.phase for i in insts} == {P.PENDING}
    assert {i.generation for i in insts} == {4}
    assert all(i.name.startswith("web-") and i.node == "" for i in insts)
    assert env.repo.workloads["web"].status.desired == 3
    # A second pass has nothing left to do.
    assert await env.plan() == []


def names(monkeypatch: pytest.MonkeyPatch, *suffixes: str) -> None:
    """The random suffixes new instances draw, in this order."""
    draws = iter(suffixes)
    monkeypatch.setattr(reconciler_module.secrets, "token_hex", lambda n: next(draws))


async def test_a_new_instance_never_takes_a_name_in_use(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six hex digits repeat among a few thousand replicas; a repeat must draw again, or the
    new instance is written over the running one that has the name."""
    running = inst("web-aaaaaa", P.RUNNING, "n1")
    await env.put(node("n1"), workload(replicas=3), running)
    # The first draw is the running instance's, the third the second's own.
    names(monkeypatch, "aaaaaa", "bbbbbb", "bbbbbb", "cccccc")
    await env.plan()
    assert env.inst("web-aaaaaa") == running
    assert {i.name for i in env.of()} == {"web-aaaaaa", "web-bbbbbb", "web-cccccc"}
    # A draining node's successor draws the same way (a rolling update's: the next test).
    names(monkeypatch, "aaaaaa", "cccccc", "dddddd")
    await env.put(node("n1", draining=True), node("n2"))
    await env.plan()
    assert env.inst("web-aaaaaa").replaced_by == "web-dddddd"
    assert env.inst("web-dddddd").created_at > running.created_at


async def test_a_rolling_update_draws_distinct_names_in_one_pass(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    olds = [inst(f"web-{i}", P.RUNNING, "n1", generation=1) for i in range(2)]
    w = workload(replicas=2, generation=2)
    w = w.model_copy(
        update={"spec": w.spec.model_copy(update={"update": UpdateStrategy(max_surge=2)})}
    )
    await env.put(node("n1"), w, *olds)
    # Both successors are drawn before either is written: the second must not repeat the first.
    names(monkeypatch, "eeeeee", "eeeeee", "ffffff")
    await env.plan()
    assert {i.name for i in env.of()} == {"web-0", "web-1", "web-eeeeee", "web-ffffff"}


async def test_a_new_instance_the_cache_does_not_know_is_refused_not_written_over(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name the cache has no instance of is written as a create: taken in the store behind
    the cache's back, the commit fails and the repo reloads; the stored instance stays."""
    await env.put(node("n1"), workload(replicas=1))
    theirs = inst("web-aaaaaa", P.RUNNING, "n1")
    await env.repo.store.commit([Create("instances", theirs.name, theirs.model_dump(mode="json"))])
    names(monkeypatch, "aaaaaa", "bbbbbb")
    with pytest.raises(AlreadyExists):
        await env.plan()
    assert env.repo.reloads == 1
    assert env.inst("web-aaaaaa") == theirs
    # The next pass plans on the truth: the replica is there, nothing is added.
    assert [c for c in await env.plan() if c.kind == "instances"] == []


async def test_reconcile_once_queues_pending_instances(env: Env) -> None:
    await env.put(node("n1"), workload(replicas=3), inst("web-r", P.RUNNING, "n1"))
    await env.rec.reconcile_once()
    assert set(env.queue.pending) == {i.name for i in env.of() if i.phase is P.PENDING}
    assert len(env.queue.pending) == 2
    assert env.link.commands == []


@pytest.mark.parametrize(
    ("phases", "replicas", "kept"),
    [
        # Newest first among equals; PENDING before anything bound.
        ([P.RUNNING, P.RUNNING, P.RUNNING], 1, [0]),
        ([P.RUNNING, P.RUNNING, P.PENDING], 1, [0]),
        ([P.PENDING, P.RUNNING, P.RUNNING], 1, [1]),
        ([P.RUNNING, P.STARTING, P.SCHEDULED], 1, [0]),
        ([P.SCHEDULED, P.RUNNING, P.STARTING], 2, [1, 2]),
        ([P.PENDING, P.PENDING, P.RUNNING], 2, [0, 2]),
        ([P.RUNNING, P.RUNNING, P.RUNNING], 0, []),
        # The order by phase decides before age does.
        ([P.PENDING, P.SCHEDULED], 1, [1]),
        ([P.STARTING, P.RUNNING], 1, [1]),
        ([P.STOPPING, P.STARTING], 1, [1]),  # any other phase ranks with SCHEDULED
        ([P.SCHEDULED, P.STOPPING], 1, [0]),
    ],
)
async def test_scale_down_stops_extras_preferring_pending(
    env: Env, phases: list[InstancePhase], replicas: int, kept: list[int]
) -> None:
    insts = [inst(f"web-{i}", ph) for i, ph in enumerate(phases)]
    await env.put(workload(replicas=replicas), *insts)
    await env.plan()
    survivors = active(env.of())
    assert sorted(i.name for i in survivors) == [f"web-{k}" for k in kept]
    for i, original in enumerate(insts):
        if i in kept:
            continue
        if original.phase is P.PENDING:
            # Never placed: removed outright.
            assert original.name not in env.repo.instances
        else:
            stopped = env.inst(original.name)
            assert stopped.desired_stop
            assert stopped.message == "scaled down"
            assert stopped.phase is original.phase  # only reported phases change it


async def test_scale_down_sends_stop_once(env: Env) -> None:
    await env.put(node("n1"), workload(replicas=0), inst("web-0"))
    await env.rec.reconcile_once()
    await env.rec.reconcile_once()
    stops = [c for c in env.link.commands if c.WhichOneof("command") == "stop"]
    assert len(stops) == 1
    assert (stops[0].node, stops[0].stop.instance, stops[0].stop.remove) == ("n1", "web-0", True)
    assert stops[0].stop.reason == "scaled down"


async def test_pending_stop_in_flight_is_not_deleted(env: Env) -> None:
    await env.put(workload(replicas=0), inst("web-0", P.PENDING))
    env.queue.inflight.add("web-0")
    await env.plan()
    assert env.inst("web-0").desired_stop
    env.queue.inflight.discard("web-0")
    await env.plan()
    assert "web-0" not in env.repo.instances


# ---- planning: node loss ----


@pytest.mark.parametrize("state", [NodeState.LOST, NodeState.LEFT])
async def test_instances_on_gone_node_become_lost_and_are_replaced(
    env: Env, state: NodeState
) -> None:
    await env.put(
        node("n1", state=state),
        node("n2"),
        workload(replicas=2),
        inst("web-a", P.RUNNING, "n1"),
        inst("web-b", P.SCHEDULED, "n1"),
        inst("web-c", P.RUNNING, "n2"),
    )
    await env.plan()
    for name in ("web-a", "web-b"):
        lost = env.inst(name)
        assert lost.phase is P.LOST
        assert lost.reason == "NodeLost"
        assert state.value in lost.message
        assert lost.finished_at is not None
    assert env.inst("web-c").phase is P.RUNNING
    new = [i for i in env.of() if i.name not in {"web-a", "web-b", "web-c"}]
    assert [i.phase for i in new] == [P.PENDING]  # 2 replicas: web-c plus one new


async def test_not_ready_node_keeps_its_instances(env: Env) -> None:
    await env.put(node("n1", state=NodeState.NOT_READY), workload(replicas=1), inst("web-a"))
    assert [c.name for c in await env.plan() if c.kind == "instances"] == []
    assert env.inst("web-a").phase is P.RUNNING


# ---- planning: drain ----


async def test_draining_node_instance_replaced_before_it_stops(env: Env) -> None:
    await env.put(node("n1", draining=True), node("n2"), workload(replicas=1), inst("web-a"))
    await env.plan()
    old = env.inst("web-a")
    assert old.replaced_by
    assert not old.desired_stop
    succ = env.inst(old.replaced_by)
    assert succ.phase is P.PENDING
    # Still no second replacement, and the old one keeps running while the new one starts.
    await env.plan()
    await env.set_inst(succ.name, phase=P.STARTING, node="n2")
    await env.plan()
    assert len(env.of()) == 2
    assert not env.inst("web-a").desired_stop
    await env.set_inst(succ.name, phase=P.RUNNING)
    await env.plan()
    old = env.inst("web-a")
    assert old.desired_stop
    assert old.message == f"replaced by {succ.name}"
    assert len(env.of()) == 2


async def test_failed_replacement_lets_predecessor_be_replaced_again(env: Env) -> None:
    await env.put(node("n1", draining=True), workload(replicas=1), inst("web-a"))
    await env.plan()
    first = env.inst("web-a").replaced_by
    # Failed long enough ago that the crash backoff (1 s after a first failure) has passed.
    await env.set_inst(first, phase=P.FAILED, node="n2", finished_at=time.time() - 5)
    await env.plan()  # clears replaced_by
    await env.plan()  # and surges a new successor
    second = env.inst("web-a").replaced_by
    assert second and second != first
    assert not env.inst("web-a").desired_stop


# ---- planning: rolling update ----


async def test_generation_bump_replaces_one_instance_at_a_time(env: Env) -> None:
    olds = [inst(f"web-{i}", P.RUNNING, "n1", generation=1) for i in range(3)]
    await env.put(node("n1"), workload(replicas=3, generation=2), *olds)
    for _ in range(20):
        changes = await env.plan()
        insts = env.of()
        # Surge 1, unavailable 0 (the defaults): at most four instances, three ready ones.
        assert len(active(insts)) <= 4
        ready = [i for i in insts if i.phase is P.RUNNING and not i.desired_stop]
        assert len(ready) >= 3
        # Play the cluster: new ones start, stopped ones stop.
        played = False
        for i in insts:
            if i.phase is P.PENDING:
                await env.set_inst(i.name, phase=P.RUNNING, node="n1", health=HealthState.HEALTHY)
                played = True
            elif i.desired_stop and not i.terminal:
                await env.set_inst(i.name, phase=P.STOPPED, finished_at=time.time())
                played = True
        if not changes and not played:
            break
    else:
        pytest.fail("rolling update never settled")
    final = active(env.of())
    assert len(final) == 3
    assert {i.generation for i in final} == {2}
    assert not {i.name for i in final} & {o.name for o in olds}
    assert all(env.inst(o.name).phase is P.STOPPED for o in olds)


async def test_generation_bump_on_pending_instance_updates_in_place(env: Env) -> None:
    await env.put(workload(replicas=1, generation=3), inst("web-a", P.PENDING, generation=1))
    await env.plan()
    assert [(i.name, i.generation, i.replaced_by) for i in env.of()] == [("web-a", 3, "")]


async def test_first_rolling_step_stops_the_oldest_once_its_successor_is_ready(env: Env) -> None:
    olds = [inst(f"web-{i}", P.RUNNING, "n1", generation=1) for i in range(3)]
    await env.put(node("n1"), workload(replicas=3, generation=2), *olds)
    await env.plan()
    (new,) = [i for i in env.of() if i.generation == 2]
    assert not [i.name for i in env.of() if i.desired_stop]
    await env.set_inst(new.name, phase=P.RUNNING, node="n1", health=HealthState.HEALTHY)
    await env.plan()
    assert [i.name for i in env.of() if i.desired_stop] == ["web-0"]


# ---- planning: delete ----


async def test_delete_removes_unbound_and_stops_bound(env: Env) -> None:
    await env.put(
        node("n1"),
        node("gone", state=NodeState.LOST),
        workload(replicas=4, deleting=True),
        inst("web-pending", P.PENDING),
        inst("web-failed", P.FAILED),
        inst("web-running", P.RUNNING, "n1"),
        inst("web-orphan", P.RUNNING, "gone"),
    )
    await env.plan()
    assert set(env.repo.instances) == {"web-running"}
    running = env.inst("web-running")
    assert running.desired_stop
    assert running.message == "workload deleted"
    assert "web" in env.repo.workloads
    # Nothing more happens until the node reports it stopped.
    assert await env.plan() == []
    await env.set_inst("web-running", phase=P.STOPPED)
    await env.plan()
    assert env.repo.instances == {}
    assert "web" not in env.repo.workloads


async def test_delete_with_only_unbound_instances_finishes_in_one_pass(env: Env) -> None:
    await env.put(workload(deleting=True), inst("web-a", P.PENDING), inst("web-b", P.SUCCEEDED))
    await env.plan()
    assert env.repo.instances == {}
    assert env.repo.workloads == {}


async def test_delete_keeps_pending_instance_in_flight(env: Env) -> None:
    await env.put(workload(deleting=True), inst("web-a", P.PENDING))
    env.queue.inflight.add("web-a")
    await env.plan()
    assert env.inst("web-a").desired_stop
    assert "web" in env.repo.workloads


async def test_orphan_instances_are_healed(env: Env) -> None:
    await env.put(
        node("n1"),
        inst("x-a", P.RUNNING, "n1", workload="x"),
        inst("x-b", P.PENDING, workload="x"),
        inst("x-c", P.FAILED, "n1", workload="x"),
    )
    await env.plan()
    assert set(env.repo.instances) == {"x-a"}
    assert (env.inst("x-a").desired_stop, env.inst("x-a").message) == (True, "workload deleted")


# ---- planning: restart policy ----


@pytest.mark.parametrize(
    ("policy", "phase", "replaced"),
    [
        (RestartPolicy.NEVER, P.FAILED, False),
        (RestartPolicy.NEVER, P.SUCCEEDED, False),
        (RestartPolicy.NEVER, P.LOST, True),
        (RestartPolicy.NEVER, P.STOPPED, True),
        (RestartPolicy.ON_FAILURE, P.SUCCEEDED, False),
        (RestartPolicy.ON_FAILURE, P.FAILED, True),
        # A SUCCEEDED instance counts as done whatever the policy (ALWAYS restarts in place).
        (RestartPolicy.ALWAYS, P.SUCCEEDED, False),
        (RestartPolicy.ALWAYS, P.FAILED, True),
        (RestartPolicy.ALWAYS, P.LOST, True),
    ],
)
async def test_restart_policy_decides_replacement(
    env: Env, policy: RestartPolicy, phase: InstancePhase, replaced: bool
) -> None:
    await env.put(node("n1"), workload(replicas=1, policy=policy), inst("web-a", phase))
    await env.plan()
    new = [i for i in env.of() if i.name != "web-a"]
    assert len(new) == (1 if replaced else 0)
    assert env.inst("web-a").phase is phase


async def test_desired_stop_succeeded_is_not_done(env: Env) -> None:
    await env.put(workload(replicas=1), inst("web-a", P.SUCCEEDED, desired_stop=True))
    await env.plan()
    assert len([i for i in env.of() if i.phase is P.PENDING]) == 1


# ---- planning: history ----


async def test_finished_history_is_trimmed_oldest_first(env: Env) -> None:
    failed = [
        inst(f"web-f{i}", P.FAILED, finished_at=float(i + 1)) for i in range(KEEP_FINISHED + 3)
    ]
    await env.put(node("n1"), workload(replicas=1), inst("web-run"), *failed)
    await env.plan()
    kept = {i.name for i in env.of() if i.terminal}
    assert kept == {f"web-f{i}" for i in range(3, KEEP_FINISHED + 3)}
    assert "web-run" in env.repo.instances


async def test_lost_instance_on_ready_node_is_not_trimmed(env: Env) -> None:
    lost = inst("web-lost", P.LOST, "n1", finished_at=0.5)
    gone = inst("web-gone", P.LOST, "n9", finished_at=0.6)  # node record gone for good
    failed = [
        inst(f"web-f{i}", P.FAILED, finished_at=float(i)) for i in range(1, KEEP_FINISHED + 1)
    ]
    await env.put(node("n1"), workload(replicas=1), inst("web-run"), lost, gone, *failed)
    await env.plan()
    assert "web-lost" in env.repo.instances
    assert "web-gone" not in env.repo.instances


async def test_history_keeps_the_configured_count_and_age(env: Env) -> None:
    """--keep-finished N: the newest N finished; --finished-retention S: none that ended
    more than S ago, even within the count, and even a LOST one whose node is READY and has
    not confirmed it gone. Completed replicas and live instances stay whatever their age."""
    clock = Clock(1000.0)
    env.rec.clock = clock
    env.rec.history = History(keep=2, retention=100.0)
    failed = [inst(f"web-f{i}", P.FAILED, finished_at=950.0 + i) for i in range(4)]
    old = inst("web-old", P.STOPPED, finished_at=899.0)
    lost = inst("web-lost", P.LOST, "n1", finished_at=899.5)
    done = inst("web-done", P.SUCCEEDED, finished_at=1.0)
    live = inst("web-run", created_at=1.0, updated_at=1.0)
    await env.put(node("n1"), workload(replicas=2), live, done, old, lost, *failed)
    await env.plan()
    assert {i.name for i in env.of()} == {"web-run", "web-done", "web-f2", "web-f3"}


async def test_lost_instance_goes_once_its_node_re_registers_without_it(env: Env) -> None:
    """Kept while its node may still run it; history like any other once the node's sync
    (it registered again) does not mention it."""
    lost = inst("web-lost", P.LOST, "n1", finished_at=0.5)
    env.rec.history = History(keep=0, retention=1e15)
    await env.put(node("n1"), workload(replicas=1), inst("web-run"), lost)
    await env.plan()
    assert "web-lost" in env.repo.instances
    running = InstanceReport(name="web-run", workload="web", node="n1", phase=P.RUNNING)
    await env.rec.on_updates([NodeSynced(node="n1", reports=[running])])
    await env.plan()
    assert "web-lost" not in env.repo.instances


async def test_completed_replicas_are_not_recreated_after_trim(env: Env) -> None:
    done = [inst(f"web-{i}", P.SUCCEEDED, finished_at=float(i)) for i in range(KEEP_FINISHED + 1)]
    await env.put(node("n1"), workload(replicas=KEEP_FINISHED + 1), *done)
    await env.plan()
    await env.plan()
    assert [i for i in env.of() if i.phase is P.PENDING] == []


# ---- status ----


@pytest.mark.parametrize(
    ("insts", "expected"),
    [
        ([], (3, 0, 0, [], "")),
        (
            [inst("a", P.RUNNING), inst("b", P.STARTING), inst("c", P.PENDING, message="no fit")],
            (3, 2, 1, ["no fit"], "1 replica(s) not placed"),
        ),
        (
            [
                inst("a", P.PENDING, message="3 nodes: insufficient cpu"),
                inst("b", P.PENDING, message="3 nodes: insufficient cpu"),
                inst("c", P.PENDING, message="1 node: cordoned"),
            ],
            (3, 0, 0, ["3 nodes: insufficient cpu", "1 node: cordoned"], "3 replica(s) not placed"),
        ),
        (
            [inst("a"), inst("b"), inst("c"), inst("d", P.RUNNING, desired_stop=True)],
            (3, 3, 3, [], ""),
        ),
        (
            [inst("a"), inst("b"), inst("c", P.SCHEDULED), inst("e", P.FAILED)],
            (3, 3, 2, [], ""),
        ),
    ],
)
async def test_workload_status_counts(
    env: Env, insts: list[Instance], expected: tuple[int, int, int, list[str], str]
) -> None:
    await env.put(node("n1"), workload(replicas=3), *insts)
    await env.plan()
    s = env.repo.workloads["web"].status
    desired, placed, running, reasons, message = expected
    assert (s.desired, s.placed, s.running, s.message) == (desired, placed, running, message)
    # Deduplicated; the order follows the repo's per-workload set, so it is not pinned.
    assert sorted(s.unschedulable_reasons) == sorted(reasons)


async def test_workload_status_says_when_a_replica_waits_for_what_waiting_cannot_bring(
    env: Env,
) -> None:
    await env.put(
        node("n1"),
        workload(replicas=2),
        inst("a", P.PENDING, message="1 node: no such driver"),
        inst("b", P.PENDING, message="1 node: cordoned"),
    )
    await env.plan()
    assert env.repo.workloads["web"].status.unschedulable_unresolvable is False
    # The placement queue parked "a": every node refused it for unresolvable reasons.
    env.queue.parked["a"] = (0, env.repo.workloads["web"].spec)
    await env.put(env.inst("a").model_copy(update={"message": "1 node: no such driver (2)"}))
    await env.plan()
    assert env.repo.workloads["web"].status.unschedulable_unresolvable is True


def random_state(rng: random.Random) -> tuple[Workload, dict[str, Instance], dict[str, Node]]:
    """A workload, its instances and the nodes, in any mix of the states planning looks at."""
    gen = rng.choice([1, 2])
    now = time.time()
    # Any rollout state, mostly of the current revision: a settled workload whose rollout
    # progresses has only its state to move (instances turning ready, failing, a deadline).
    rollout = Rollout(
        state=rng.choice(list(RolloutState)),
        revision=gen if rng.random() < 0.9 else 3 - gen,
        stable=rng.choice([0, 1]),
        started_at=now - 30,
        deadline=now + rng.choice([-1, 600]),
    )
    w = workload(replicas=rng.randint(0, 4), generation=gen, rollout=rollout)
    update = UpdateStrategy(min_ready_seconds=rng.choice([0, 5]), auto_rollback=rng.random() < 0.5)
    w.spec = w.spec.model_copy(update={"update": update})
    nodes = {
        n: node(
            n,
            state=rng.choice([NodeState.READY] * 6 + list(NodeState)),
            draining=rng.random() < 0.1,
        )
        for n in ("n1", "n2", "n3")
    }
    phases = [P.RUNNING] * 6 + [P.SCHEDULED, P.STARTING, P.PENDING] * 2 + list(P)
    count = max(0, w.spec.replicas + rng.choice([0, 0, 0, 0, -1, 1]))
    names = [f"web-{i}" for i in range(count)]
    insts = {}
    for name in names:
        phase = rng.choice(phases)
        insts[name] = inst(
            name,
            phase,
            node="" if phase is P.PENDING else rng.choice(["n1", "n2", "n3", "n9"]),
            generation=gen if rng.random() < 0.9 else 3 - gen,
            desired_stop=rng.random() < 0.05,
            replaced_by=rng.choice(names) if rng.random() < 0.05 else "",
            message=rng.choice(["", "", "1 node: cordoned"]) if phase is P.PENDING else "",
            health=rng.choice([HealthState.HEALTHY] * 4 + list(HealthState)),
            health_changed_at=now - rng.choice([1, 60]),
            restarts=rng.choice([0] * 9 + [1]),
        )
    return w, insts, nodes


async def test_a_settled_workload_plans_what_the_full_steps_plan(env: Env) -> None:
    """`_plan_workload` skips its steps for a workload it finds settled; over many random
    states, whenever it does, the steps themselves would have planned exactly the same."""
    rng = random.Random(7)
    settled = unsettled = 0
    for _ in range(3000):
        w, insts, nodes = random_state(rng)
        env.repo.nodes = nodes
        env.rec.recount_nodes()
        if not env.rec._settled(w, Tally.of(insts.values())):
            unsettled += 1
            continue
        settled += 1
        now = time.time()
        fast = env.rec._plan_workload(w, insts, now)
        env.rec._settled = lambda w, tally: False  # type: ignore[method-assign]
        try:
            full = env.rec._plan_workload(w, insts, now)
        finally:
            del env.rec._settled
        assert fast == full
        assert all(c.kind == "workloads" for c in fast)
    # Both kinds were met often enough for the comparison to mean something.
    assert settled > 300 and unsettled > 300


# ---- on_updates ----


async def feed(env: Env, updates: list[apb.ClusterUpdate]) -> None:
    """What the scheduler link hands the reconciler for these messages."""
    await env.rec.on_updates(updates_from_pb(updates))


def status_pb(name: str, phase: int = pb.Instance.RUNNING, **kw: Any) -> apb.InstanceStatus:
    return apb.InstanceStatus(name=name, workload="web", phase=phase, **kw)


def report_update(node_name: str, status: apb.InstanceStatus) -> apb.ClusterUpdate:
    return apb.ClusterUpdate(instance=apb.InstanceUpdate(node=node_name, status=status))


def sync_update(node_name: str, *statuses: apb.InstanceStatus) -> apb.ClusterUpdate:
    return apb.ClusterUpdate(sync=apb.NodeSync(node=node_name, instances=statuses))


def node_update(name: str, **kw: Any) -> apb.ClusterUpdate:
    kw.setdefault("state", pb.Node.READY)
    return apb.ClusterUpdate(node=pb.Node(name=name, **kw))


async def test_report_of_running_updates_phase(env: Env) -> None:
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.STARTING))
    await feed(env, [report_update("n1", status_pb("web-a", started_at=5.0))])
    a = env.inst("web-a")
    assert a.phase is P.RUNNING
    assert a.started_at == 5.0
    assert env.rec._dirty.is_set()
    assert env.link.commands == []


@pytest.mark.parametrize(
    ("stored", "reason"),
    [
        (inst("web-a", P.RUNNING, "n1"), "not bound to this node"),
        (None, "not bound to this node"),
        (inst("web-a", P.LOST, "n2"), "replaced after node loss"),
    ],
)
async def test_report_for_instance_not_bound_there_stops_it(
    env: Env, stored: Instance | None, reason: str
) -> None:
    await env.put(node("n1"), node("n2"), workload(replicas=1), *([stored] if stored else []))
    await feed(env, [report_update("n2", status_pb("web-a"))])
    assert len(env.link.commands) == 1
    cmd = env.link.commands[0]
    assert cmd.node == "n2"
    assert (cmd.stop.instance, cmd.stop.remove, cmd.stop.reason) == ("web-a", True, reason)
    if stored is not None:
        assert env.inst("web-a") == stored  # the stored record is untouched
    # A repeat within the resend window sends nothing new.
    await feed(env, [report_update("n2", status_pb("web-a"))])
    assert len(env.link.commands) == 1


async def test_sync_missing_running_instance_marks_it_lost(env: Env) -> None:
    now = time.time()
    await env.put(
        node("n1"),
        workload(replicas=4),
        inst("web-a", P.RUNNING, "n1"),
        inst("web-b", P.RUNNING, "n1"),
        inst("web-c", P.SCHEDULED, "n1", scheduled_at=now),  # just bound: in grace
        inst("web-d", P.SCHEDULED, "n1", scheduled_at=now - 60),
        inst("web-e", P.RUNNING, "n2"),  # another node's: not this sync's business
    )
    await feed(env, [sync_update("n1", status_pb("web-a"))])
    assert env.inst("web-a").phase is P.RUNNING
    for name in ("web-b", "web-d"):
        lost = env.inst(name)
        assert lost.phase is P.LOST
        assert lost.reason == "NotOnNode"
    assert env.inst("web-c").phase is P.SCHEDULED
    assert env.inst("web-e").phase is P.RUNNING


async def test_admin_cordon_survives_scheduler_forgetting_it(env: Env) -> None:
    await env.put(node("n1", schedulable=False))
    await feed(env, [node_update("n1", schedulable=True)])
    assert env.repo.nodes["n1"].schedulable is False
    assert env.link.set_nodes == [("n1", {"schedulable": False, "draining": None})]


async def test_drain_survives_scheduler_forgetting_it(env: Env) -> None:
    await env.put(node("n1", schedulable=False, draining=True))
    await feed(env, [node_update("n1", schedulable=True, draining=False)])
    stored = env.repo.nodes["n1"]
    assert (stored.schedulable, stored.draining) == (False, True)
    assert env.link.set_nodes[-1] == ("n1", {"schedulable": False, "draining": True})


async def test_new_ready_node_is_stored_and_retries_placement(env: Env) -> None:
    env.queue.backoff["web-x"] = _Backoff(until=time.monotonic() + 100, delay=10)
    await feed(env, [node_update("n3", schedulable=True, labels={"zone": "a"})])
    assert env.repo.nodes["n3"].labels == {"zone": "a"}
    assert env.queue.backoff == {}
    assert env.link.set_nodes == []


async def test_unchanged_node_update_writes_nothing(env: Env) -> None:
    await env.put(node("n1"))
    writes = env.repo.writes
    env.queue.backoff["web-x"] = backoff = _Backoff(until=time.monotonic() + 100, delay=10)
    await feed(env, [node_update("n1", schedulable=True, last_heartbeat_time=Timestamp(seconds=9))])
    assert env.repo.writes == writes
    assert env.queue.backoff == {"web-x": backoff}  # nothing freed: placements keep waiting
    assert not env.rec._dirty.is_set()  # and no pass is due
    assert env.repo.nodes["n1"].last_heartbeat == 9.0  # soft field refreshed in memory


async def test_bad_update_is_skipped_not_fatal(env: Env) -> None:
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.STARTING))
    with structlog.testing.capture_logs() as logs:
        await feed(
            env,
            [
                report_update("n1", status_pb("", pb.Instance.RUNNING)),
                report_update("n1", status_pb("web-a", pb.Instance.PHASE_UNSPECIFIED)),
                report_update("n1", status_pb("web-a", pb.Instance.RUNNING)),
            ],
        )
    assert env.inst("web-a").phase is P.RUNNING
    assert logs == [
        {"event": "bad update from scheduler", "error": error, "log_level": "warning"}
        for error in [
            "instance status: name is required",
            "instance status web-a: phase: is required",
        ]
    ]


async def test_reports_of_one_instance_in_one_batch_apply_in_turn(env: Env) -> None:
    """The second report folds into what the first made of the instance: once FAILED, a late
    RUNNING does not bring it back."""
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.STARTING))
    await feed(
        env,
        [
            report_update("n1", status_pb("web-a", pb.Instance.FAILED, exit_code=3)),
            report_update("n1", status_pb("web-a", pb.Instance.RUNNING)),
        ],
    )
    a = env.inst("web-a")
    assert (a.phase, a.exit_code) == (P.FAILED, 3)


@pytest.mark.parametrize(
    "change",
    [
        {"state": NodeState.NOT_READY},
        {"schedulable": False},
        {"draining": True},
        {"labels": {"zone": "b"}},
        {"drivers": ["process", "fake"]},
        {"capacity": Resources(cpu_millis=2000, memory_bytes=1 << 30)},
        {"allocatable": Resources(cpu_millis=1000, memory_bytes=1 << 29)},
    ],
)
def test_a_node_is_written_when_one_field_the_controller_keeps_changes(
    change: dict[str, Any],
) -> None:
    old = node("n1", labels={"zone": "a"}, drivers=["process"])
    assert _node_changed(old, old.model_copy(update=change)) is True


def test_a_node_is_not_written_for_its_soft_fields() -> None:
    old = node("n1", labels={"zone": "a"}, drivers=["process"])
    new = old.model_copy(
        update={
            "usage": Resources(cpu_millis=5),
            "allocated": Resources(cpu_millis=5),
            "instance_count": 3,
            "last_heartbeat": 9.0,
            "message": "busy",
        }
    )
    assert _node_changed(old, new) is False


# ---- planning: crash-loop backoff ----


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def fail_newest(env: Env, at: float) -> str:
    """The workload's newest live instance fails at `at`; its name."""
    newest = active(env.of())[-1]
    await env.set_inst(newest.name, phase=P.FAILED, finished_at=at, message="cannot exec")
    return newest.name


async def wait_for_replacement(env: Env, clock: Clock, step: float = 0.25) -> float:
    """Plan every `step` seconds until the failed replica is replaced; how long that took."""
    start = clock.now
    while not active(env.of()):
        await env.plan()
        if active(env.of()):
            break
        clock.now += step
        assert clock.now - start < 1000, "never replaced"
    return clock.now - start


async def test_failing_replicas_are_replaced_with_doubling_backoff(env: Env) -> None:
    clock = Clock()
    env.rec.clock = clock
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.RUNNING))
    delays = []
    for _ in range(11):
        await fail_newest(env, clock.now)
        delays.append(await wait_for_replacement(env, clock))
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert env.rec.crashes["web"].failures == 11


async def test_backoff_shows_in_status_and_ends_after_a_healthy_run(env: Env) -> None:
    clock = Clock()
    env.rec.clock = clock
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.RUNNING))
    for _ in range(3):
        await fail_newest(env, clock.now)
        await wait_for_replacement(env, clock)
    await fail_newest(env, clock.now)
    await env.plan()
    message = env.repo.workloads["web"].status.message
    assert message.startswith("4 instance failure(s) in a row (the last: cannot exec)")
    await wait_for_replacement(env, clock)
    probe = active(env.of())[0]
    await env.set_inst(probe.name, phase=P.RUNNING, node="n1", started_at=clock.now)
    clock.now += 59
    await env.plan()
    assert env.rec.crashes["web"].failures == 4  # not yet a healthy run
    clock.now += 2
    await env.plan()
    assert env.rec.crashes["web"].failures == 0
    assert not env.repo.workloads["web"].status.message
    # The streak starts over: the next failure waits 1 s again.
    await fail_newest(env, clock.now)
    assert await wait_for_replacement(env, clock) == 1


async def test_a_failing_rolling_update_successor_stops_the_rollout(env: Env) -> None:
    clock = Clock()
    env.rec.clock = clock
    await env.put(node("n1"), workload(replicas=1, generation=2), inst("web-a", generation=1))
    await env.plan()
    (succ,) = [i.name for i in env.of() if i.generation == 2]
    await env.set_inst(succ, phase=P.FAILED, node="n1", finished_at=clock.now)
    for _ in range(4):
        clock.now += 1.0
        await env.plan()
    # The predecessor keeps serving, and no other successor is tried: the rollout FAILED.
    assert not env.inst("web-a").desired_stop
    assert [i.name for i in env.of() if i.generation == 2] == [succ]
    assert env.repo.workloads["web"].rollout.state is RolloutState.FAILED


async def test_a_settled_workload_ends_its_streak_too(env: Env) -> None:
    """Failed history trimmed away, the workload is settled (one RUNNING replica): the
    replacement's healthy run still ends the streak."""
    clock = Clock()
    env.rec.clock = clock
    probe = inst("web-p", P.RUNNING, started_at=clock.now - 61)
    await env.put(node("n1"), workload(replicas=1), probe)
    env.rec.crashes["web"] = CrashBackoff(failures=3, probes={"web-p"})
    await env.plan()
    assert env.rec.crashes["web"].failures == 0


async def test_replicas_failing_together_wait_one_round(env: Env) -> None:
    clock = Clock()
    env.rec.clock = clock
    failed = [
        inst(f"web-{i}", P.FAILED, finished_at=clock.now - 0.1 * i, message="cannot exec")
        for i in range(3)
    ]
    await env.put(node("n1"), workload(replicas=3), *failed)
    await env.plan()
    assert active(env.of()) == []
    assert env.rec.crashes["web"].failures == 1  # one round, not three failures in a row
    assert await wait_for_replacement(env, clock) == 1.0
    assert len(active(env.of())) == 3  # all three replaced together


# ---- commands to nodes ----


class FakeTime:
    """Stands in for the reconciler module's `time`: wall and monotonic clocks set by hand."""

    def __init__(self, wall: float = 1_000_000.0, mono: float = 5_000.0) -> None:
        self.wall = wall
        self.mono = mono

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    t = FakeTime()
    monkeypatch.setattr(reconciler_module, "time", t)
    return t


def sent(cmds: Iterable[apb.NodeCommand]) -> list[tuple[str, str, str, str]]:
    """(node, kind, instance, stop reason or the started spec's name) of each command."""
    out = []
    for c in cmds:
        if c.WhichOneof("command") == "stop":
            assert c.stop.remove is True
            out.append((c.node, "stop", c.stop.instance, c.stop.reason))
        else:
            a = c.start.assignment
            out.append((c.node, "start", a.instance, f"{a.spec.name}@{a.generation}"))
    return out


async def test_a_stop_is_sent_again_only_after_resend_after(env: Env, fake_time: FakeTime) -> None:
    await env.put(
        node("n1"),
        workload(replicas=1),
        inst("web-a", desired_stop=True, message="scaled down"),
        inst("web-b"),
    )
    await env.rec._send_commands()
    assert sent(env.link.commands) == [("n1", "stop", "web-a", "scaled down")]
    fake_time.mono += RESEND_AFTER
    await env.rec._send_commands()
    assert len(env.link.commands) == 1  # exactly RESEND_AFTER: not yet
    fake_time.mono += 0.001
    await env.rec._send_commands()
    assert sent(env.link.commands) == [("n1", "stop", "web-a", "scaled down")] * 2


async def test_a_start_not_confirmed_is_sent_again_after_resend_after(
    env: Env, fake_time: FakeTime
) -> None:
    wall = fake_time.wall
    await env.put(
        node("n1"),
        node("n2", state=NodeState.NOT_READY),
        workload(replicas=9, generation=2),
        # Each skipped, and the ones after it still sent: its workload is gone, ...
        inst("x-orphan", P.SCHEDULED, "n1", workload="x", scheduled_at=0.0),
        inst("web-pend", P.PENDING, desired_stop=True),  # no node
        inst("web-failed", P.FAILED, "n1", desired_stop=True),  # finished
        inst("web-nr", P.SCHEDULED, "n2", scheduled_at=0.0),  # node not READY
        inst("web-gone", P.SCHEDULED, "n9", scheduled_at=0.0),  # no node record
        inst("web-run", P.RUNNING, "n1", scheduled_at=0.0),
        inst("web-old", P.SCHEDULED, "n1", generation=2, scheduled_at=wall - RESEND_AFTER - 0.01),
        inst("web-edge", P.SCHEDULED, "n1", scheduled_at=wall - RESEND_AFTER),
        inst("web-none", P.SCHEDULED, "n1"),  # no bind time: as old as can be
    )
    expected = [("n1", "start", "web-old", "web@2"), ("n1", "start", "web-none", "web@1")]
    await env.rec._send_commands()
    assert sent(env.link.commands) == expected
    # Every bind is old now; the ones sent wait out the resend window, exactly.
    fake_time.wall += 0.001
    fake_time.mono += RESEND_AFTER
    env.link.commands.clear()
    await env.rec._send_commands()
    assert sent(env.link.commands) == [("n1", "start", "web-edge", "web@1")]
    fake_time.mono += 0.001
    env.link.commands.clear()
    await env.rec._send_commands()
    assert sent(env.link.commands) == expected


async def test_a_full_pass_forgets_what_was_sent_for_instances_that_are_gone(
    env: Env, fake_time: FakeTime
) -> None:
    await env.put(
        node("n1"),
        workload(replicas=1),
        inst("web-a", desired_stop=True),
        inst("web-b", P.SCHEDULED, "n1", scheduled_at=0.0),
    )
    await env.rec._send_commands()
    assert (set(env.rec._stops_sent), set(env.rec._starts_sent)) == ({"web-a"}, {"web-b"})
    env.rec._stops_sent["web-x"] = env.rec._starts_sent["web-y"] = fake_time.mono
    env.rec._cleanup_sent[("n1", "old")] = fake_time.mono - RESEND_AFTER
    env.rec._cleanup_sent[("n1", "new")] = fake_time.mono - RESEND_AFTER + 0.01
    # An incremental pass leaves them all.
    await env.rec._send_commands([], full=False)
    assert (set(env.rec._stops_sent), set(env.rec._starts_sent)) == (
        {"web-a", "web-x"},
        {"web-b", "web-y"},
    )
    assert set(env.rec._cleanup_sent) == {("n1", "old"), ("n1", "new")}
    await env.rec._send_commands([])
    assert (set(env.rec._stops_sent), set(env.rec._starts_sent)) == ({"web-a"}, {"web-b"})
    assert set(env.rec._cleanup_sent) == {("n1", "new")}
    assert len(env.link.commands) == 2


async def test_cleanup_stops_an_unexpected_instance_once_per_resend_window(
    env: Env, fake_time: FakeTime
) -> None:
    with structlog.testing.capture_logs() as logs:
        first = env.rec.cleanup("n1", "web-a", "not bound to this node")
        assert env.rec.cleanup("n1", "web-a", "not bound to this node") is None
        other = env.rec.cleanup("n2", "web-a", "replaced after node loss")
        fake_time.mono += RESEND_AFTER - 0.01
        assert env.rec.cleanup("n1", "web-a", "again") is None
        fake_time.mono += 0.01
        again = env.rec.cleanup("n1", "web-a", "again")
    assert sent([command_to_pb(c) for c in (first, other, again) if c is not None]) == [
        ("n1", "stop", "web-a", "not bound to this node"),
        ("n2", "stop", "web-a", "replaced after node loss"),
        ("n1", "stop", "web-a", "again"),
    ]
    assert logs == [
        {
            "event": "stopping unexpected instance",
            "node": n,
            "instance": "web-a",
            "why": why,
            "log_level": "info",
        }
        for n, why in [
            ("n1", "not bound to this node"),
            ("n2", "replaced after node loss"),
            ("n1", "again"),
        ]
    ]


class FailingLink(DummyLink):
    """Delivers nothing (`error`) or answers each command with `answers` (ok, error)."""

    def __init__(self, error: str = "", answers: list[tuple[bool, str]] | None = None) -> None:
        super().__init__()
        self.error = error
        self.answers = answers or []

    async def command(self, cmds: Sequence[NodeCommand]) -> list[CommandResult]:
        self.commands.extend(command_to_pb(c) for c in cmds)
        if self.error:
            raise Unavailable(self.error)
        return [
            command_result_from_pb(
                apb.CommandResult(
                    status=convert.ok_status()
                    if ok
                    else convert.error_status(code_pb2.FAILED_PRECONDITION, e)
                )
            )
            for ok, e in self.answers
        ]


async def test_commands_not_delivered_or_refused_are_logged(env: Env) -> None:
    cmds = [stop_command("n1", "web-a", "x"), stop_command("n2", "web-b", "y")]
    env.rec.link = FailingLink(error="scheduler gone")  # type: ignore[assignment]
    with structlog.testing.capture_logs() as logs:
        await env.rec._command(cmds)
    assert logs == [
        {
            "event": "commands not delivered",
            "count": 2,
            "error": "scheduler gone",
            "log_level": "warning",
        }
    ]
    env.rec.link = FailingLink(answers=[(False, "no such task"), (True, "")])  # type: ignore[assignment]
    with structlog.testing.capture_logs() as logs:
        await env.rec._command(cmds)
    assert logs == [
        {"event": "command refused", "node": "n1", "error": "no such task", "log_level": "warning"}
    ]
    env.rec.link = FailingLink(answers=[(True, "")])  # type: ignore[assignment]
    with pytest.raises(ValueError):
        await env.rec._command(cmds)  # a short answer is an error, not a partial success


async def test_a_forgotten_finished_instance_is_removed_from_its_ready_node(env: Env) -> None:
    """Trimmed history: the record goes, and a READY node is told to remove the task (its logs,
    its container); a node not READY, or no node, is told nothing."""
    failed = [
        inst("web-f1", P.FAILED, "n1", finished_at=1.0),
        inst("web-f2", P.FAILED, "n2", finished_at=2.0),
        inst("web-f3", P.FAILED, "", finished_at=3.0),
        inst("web-f4", P.FAILED, "n9", finished_at=4.0),
    ] + [inst(f"web-k{i}", P.FAILED, "n1", finished_at=10.0 + i) for i in range(KEEP_FINISHED)]
    await env.put(
        node("n1"), node("n2", state=NodeState.NOT_READY), workload(replicas=1), inst("web-run")
    )
    await env.put(*failed)
    await env.rec.reconcile_once()
    assert {i.name for i in env.of() if i.terminal} == {f"web-k{i}" for i in range(KEEP_FINISHED)}
    assert sent(env.link.commands) == [("n1", "stop", "web-f1", "forgotten")]


# ---- incremental passes ----


def listen(env: Env) -> None:
    """What `run` does before its first pass: the reconciler hears every write."""
    env.repo.listeners.append(env.rec._on_change)
    env.rec._listening = True


async def put_unheard(env: Env, *objs: Workload | Instance | Node) -> None:
    """A write the reconciler does not hear of (as if made before it listened)."""
    env.repo.listeners.remove(env.rec._on_change)
    try:
        await env.put(*objs)
    finally:
        env.repo.listeners.append(env.rec._on_change)


async def test_writes_name_the_workloads_of_the_next_pass(env: Env) -> None:
    rec = env.rec
    rec._full_due = False
    rec._on_change(Change("instances", "a-1", inst("a-1", workload="a")), None)
    rec._on_change(Change("instances", "b-1", None), inst("b-1", workload="b"))
    rec._on_change(Change("workloads", "c", workload("c")), None)
    assert (rec._changed_workloads, rec._full_due) == ({"a", "b", "c"}, False)
    rec._on_change(Change("nodes", "n1", node("n1")), None)
    assert (rec._changed_workloads, rec._full_due) == ({"a", "b", "c"}, True)


async def test_an_incremental_pass_plans_sends_and_queues_only_what_changed(
    env: Env, fake_time: FakeTime
) -> None:
    listen(env)
    await env.put(node("n1"), workload("a", replicas=1), workload("b", replicas=1))
    await env.rec.reconcile_once()  # the first pass is full
    await env.rec.reconcile_once()  # the next one looks at what the first wrote
    assert (len(env.of("a")), len(env.of("b"))) == (1, 1)
    start = fake_time.mono
    # Unheard of: b wants two replicas, and one of its instances is to stop.
    await put_unheard(
        env,
        workload("b", replicas=2),
        inst("b-stop", P.RUNNING, "n1", workload="b", desired_stop=True, message="scaled down"),
    )
    env.rec._stops_sent["gone"] = start  # what was sent for an instance no longer there
    env.queue.pending.clear()
    (a_first,) = env.of("a")
    await env.put(workload("a", replicas=2))  # heard of
    await env.rec.reconcile_once()
    assert (len(env.of("a")), len(env.of("b"))) == (2, 2)  # b-stop and its first instance
    # Only a's new instance: the first, unchanged, is queued again by a full pass.
    assert set(env.queue.pending) == {i.name for i in env.of("a") if i != a_first}
    assert env.link.commands == []
    assert set(env.rec._stops_sent) == {"gone"}  # only a full pass prunes
    # Nothing changed, the last full pass not FULL_PASS_EVERY ago: nothing is planned.
    fake_time.mono = start + FULL_PASS_EVERY - 0.001
    await env.rec.reconcile_once()
    assert len(env.of("b")) == 2
    fake_time.mono = start + FULL_PASS_EVERY
    await env.rec.reconcile_once()
    assert len(active(env.of("b"))) == 2
    assert sent(env.link.commands) == [("n1", "stop", "b-stop", "scaled down")]
    assert set(env.rec._stops_sent) == {"b-stop"}
    assert set(env.queue.pending) == {i.name for i in env.of("a") + active(env.of("b"))}


async def test_the_kept_tallies_count_what_the_repo_holds_after_every_write(
    env: Env, fake_time: FakeTime
) -> None:
    """Incremental passes plan from tallies moved by each write; after passes and writes of
    every sort (new instances, reports, scale-down stops, deletes, a drain), each kept tally
    equals a fresh count of its workload's instances, and the planned statuses follow."""
    listen(env)
    rec = env.rec

    def check() -> None:
        assert rec._tallies  # the passes below plan from kept tallies, not fresh ones
        for name, kept in rec._tallies.items():
            assert kept == Tally.of(env.repo.instances_of(name)), name

    await env.put(node("n1"), node("n2"), workload("a", replicas=3), workload("b", replicas=2))
    await rec.reconcile_once()  # full: counts afresh, then creates five instances
    check()
    a1, a2, a3 = env.of("a")
    await env.put(
        a1.model_copy(update={"node": "n1", "phase": P.SCHEDULED}),
        a2.model_copy(update={"node": "n2", "phase": P.SCHEDULED}),
    )
    await rec.reconcile_once()
    check()
    await feed(
        env,
        [
            report_update("n1", status_pb(a1.name, started_at=time.time())),
            report_update("n2", status_pb(a2.name, phase=pb.Instance.FAILED, exit_code=1)),
        ],
    )
    check()
    await rec.reconcile_once()  # a2 failed: a replacement (after its backoff)
    check()
    await env.put(workload("a", replicas=1))
    await rec.reconcile_once()  # scaled down: stops
    check()
    status = env.repo.workloads["a"].status
    assert (status.desired, status.placed, status.running) == (1, 1, 1)
    await env.repo.mutate(lambda: [Change("instances", a3.name, None)])
    await rec.reconcile_once()
    check()
    await env.put(node("n1", draining=True))  # the next pass is full, and counts afresh
    await rec.reconcile_once()
    check()
    assert rec._unsettling == {"n1"}
    await env.put(node("n1"))
    assert rec._unsettling == set()


@pytest.mark.parametrize("why", ["node", "reload", "not listening", "failed pass"])
async def test_a_full_pass_follows_a_node_write_a_reload_or_a_failed_pass(
    env: Env, fake_time: FakeTime, why: str
) -> None:
    listen(env)
    await env.put(node("n1"), workload("a", replicas=1), workload("b", replicas=1))
    await env.rec.reconcile_once()
    await env.rec.reconcile_once()
    await put_unheard(env, workload("b", replicas=2))
    await env.rec.reconcile_once()
    assert len(env.of("b")) == 1  # an incremental pass with nothing in it
    if why == "node":
        await env.put(node("n2"))
    elif why == "reload":
        env.repo.reloads += 1
    elif why == "not listening":
        env.rec._listening = False
    else:
        env.rec.link = FailingLink()  # type: ignore[assignment]
        await env.put(
            workload("a", replicas=1, deleting=True),
            inst("a-gone", P.FAILED, "n1", workload="a"),
        )
        with pytest.raises(ValueError):
            await env.rec.reconcile_once()  # its removal command got no answer
        assert len(env.of("b")) == 1
    await env.rec.reconcile_once()
    assert len(env.of("b")) == 2
    # And the one after it is incremental again (once what the full one wrote is planned).
    await env.rec.reconcile_once()
    await put_unheard(env, workload("b", replicas=3))
    await env.rec.reconcile_once()
    assert len(env.of("b")) == (3 if why == "not listening" else 2)


async def test_a_plan_outside_a_pass_looks_at_every_workload(env: Env) -> None:
    listen(env)
    await env.put(workload("a", replicas=1))
    await env.rec.reconcile_once()
    await env.put(workload("b", replicas=1))
    await env.plan()
    assert (len(env.of("a")), len(env.of("b"))) == (1, 1)


async def test_a_workload_gone_from_the_scope_is_skipped_not_the_end_of_the_pass(
    env: Env,
) -> None:
    listen(env)
    await env.put(workload("a", replicas=0))
    await env.rec.reconcile_once()
    await env.rec.reconcile_once()
    await env.repo.mutate(lambda: [Change("workloads", "a", None)])
    await env.put(workload("b", replicas=2))
    await env.rec.reconcile_once()  # scope: a (gone), then b
    assert len(env.of("b")) == 2


async def test_one_pass_plans_every_workload_deleting_or_not(env: Env) -> None:
    await env.put(
        node("n1"),
        workload("a", replicas=1),
        workload("b", replicas=1, deleting=True),
        inst("b-1", P.PENDING, workload="b"),
        workload("c", replicas=1),
    )
    await env.plan()
    assert (len(env.of("a")), env.of("b"), len(env.of("c"))) == (1, [], 1)
    assert set(env.repo.workloads) == {"a", "c"}


# ---- on_updates: more ----


async def test_a_report_after_one_for_another_node_still_applies(
    env: Env, fake_time: FakeTime
) -> None:
    env.queue.backoff["web-x"] = _Backoff(until=time.monotonic() + 100, delay=10)
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.STARTING))
    await feed(
        env,
        [
            report_update("n1", status_pb("web-zz")),  # not bound anywhere: stopped
            report_update("n1", status_pb("web-a", pb.Instance.FAILED, exit_code=1)),
        ],
    )
    a = env.inst("web-a")
    assert (a.phase, a.exit_code, a.updated_at) == (P.FAILED, 1, fake_time.wall)
    assert sent(env.link.commands) == [("n1", "stop", "web-zz", "not bound to this node")]
    assert env.queue.backoff == {}  # a finished instance frees its resources


async def test_a_sync_marks_lost_what_the_node_no_longer_runs(
    env: Env, fake_time: FakeTime
) -> None:
    wall = fake_time.wall
    env.queue.backoff["web-x"] = _Backoff(until=time.monotonic() + 100, delay=10)
    await env.put(
        node("n1"),
        workload(replicas=5),
        inst("web-x", P.RUNNING, "n1"),  # reported FAILED in the same batch
        inst("web-b", P.RUNNING, "n1"),
        inst("web-edge", P.SCHEDULED, "n1", scheduled_at=wall - START_GRACE),
        inst("web-in", P.SCHEDULED, "n1", scheduled_at=wall - START_GRACE + 0.01),
    )
    await feed(
        env,
        [
            report_update("n1", status_pb("web-x", pb.Instance.FAILED, exit_code=1)),
            sync_update("n1"),
        ],
    )
    assert env.inst("web-x").phase is P.FAILED
    for name in ("web-b", "web-edge"):
        lost = env.inst(name)
        assert (lost.phase, lost.reason, lost.message, lost.finished_at, lost.updated_at) == (
            P.LOST,
            "NotOnNode",
            "node n1 re-registered without it",
            wall,
            wall,
        )
    assert env.inst("web-in").phase is P.SCHEDULED  # still in its start grace
    assert env.queue.backoff == {}


async def test_syncs_of_several_nodes_in_one_batch_each_judge_their_own_instances(
    env: Env,
) -> None:
    """A scheduler's failover re-registers every node at once: each node's sync loses what
    that node no longer holds, and nothing of another node's."""
    await env.put(
        node("n1"),
        node("n2"),
        node("n3"),
        workload(replicas=5),
        inst("web-1a", P.RUNNING, "n1"),
        inst("web-1b", P.RUNNING, "n1"),
        inst("web-2a", P.RUNNING, "n2"),
        inst("web-2b", P.RUNNING, "n2"),
        inst("web-3a", P.RUNNING, "n3"),  # n3 does not sync in this batch
    )
    await feed(
        env,
        [
            sync_update("n1", status_pb("web-1a")),
            sync_update("n2", status_pb("web-2b")),
        ],
    )
    phases = {i.name: (i.phase, i.message) for i in env.of()}
    assert phases == {
        "web-1a": (P.RUNNING, ""),
        "web-1b": (P.LOST, "node n1 re-registered without it"),
        "web-2a": (P.LOST, "node n2 re-registered without it"),
        "web-2b": (P.RUNNING, ""),
        "web-3a": (P.RUNNING, ""),
    }


async def test_a_sync_losing_an_instance_frees_its_resources(env: Env) -> None:
    env.queue.backoff["web-x"] = _Backoff(until=time.monotonic() + 100, delay=10)
    await env.put(node("n1"), workload(replicas=1), inst("web-b", P.RUNNING, "n1"))
    await feed(env, [sync_update("n1")])
    assert env.inst("web-b").phase is P.LOST
    assert env.queue.backoff == {}


class CordonFailingLink(DummyLink):
    async def set_node(self, name: str, **kw: Any) -> None:
        raise Unavailable("scheduler restarting")


async def test_a_cordon_that_cannot_be_re_applied_is_logged(env: Env) -> None:
    env.rec.link = CordonFailingLink()  # type: ignore[assignment]
    await env.put(node("n1", schedulable=False))
    with structlog.testing.capture_logs() as logs:
        await feed(env, [node_update("n1", schedulable=True)])
    assert logs == [
        {
            "event": "could not re-apply cordon",
            "node": "n1",
            "error": "scheduler restarting",
            "log_level": "warning",
        }
    ]
    assert env.repo.nodes["n1"].schedulable is False


# ---- crash-loop backoff: more ----


@pytest.mark.parametrize(
    ("message", "reason", "last"),
    [
        ("x" * 300, "Crashed", "x" * 200),
        ("", "Crashed", "Crashed"),
        ("", "", "failed"),
    ],
)
async def test_the_backoff_status_names_the_last_error(
    env: Env, message: str, reason: str, last: str
) -> None:
    clock = Clock()
    env.rec.clock = clock
    await env.put(
        node("n1"),
        workload(replicas=1),
        inst("web-a", P.FAILED, finished_at=clock.now, message=message, reason=reason),
    )
    await env.plan()
    assert env.repo.workloads["web"].status.message == (
        f"1 instance failure(s) in a row (the last: {last}); replaced with backoff, up to 300s"
    )


async def test_each_counted_failure_is_logged_once_and_wakes_its_workload(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = asyncio.get_running_loop()
    timers: list[tuple[float, Any, tuple[Any, ...]]] = []
    real_call_later = loop.call_later

    def call_later(delay: float, cb: Any, *args: Any) -> asyncio.TimerHandle:
        timers.append((delay, cb, args))
        return real_call_later(delay, cb, *args)

    monkeypatch.setattr(loop, "call_later", call_later)
    clock = Clock()
    env.rec.clock = clock
    await env.put(
        node("n1"),
        workload(replicas=2),
        inst("web-a", P.FAILED, finished_at=clock.now - 0.26, reason="Crashed", message="y" * 300),
        inst("web-b", P.RUNNING),
    )
    with structlog.testing.capture_logs() as logs:
        await env.plan()
        await env.plan()
    assert logs == [
        {
            "event": "instance failed; replacing with backoff",
            "workload": "web",
            "instance": "web-a",
            "reason": "Crashed",
            "error": "y" * 200,
            "failures": 1,
            "retry_in": 0.7,
            "log_level": "info",
        }
    ]
    assert [(round(d, 6), cb, args) for d, cb, args in timers] == [(0.75, env.rec._wake, ("web",))]
    # A failure long past its backoff still wakes its workload, at once.
    clock.now += 20
    await env.set_inst("web-b", phase=P.FAILED, finished_at=clock.now - 10)
    await env.plan()
    assert [(round(d, 6), args) for d, _, args in timers[1:]] == [(0.01, ("web",))]
    env.rec._changed_workloads.clear()
    env.rec._dirty.clear()
    await asyncio.wait_for(env.rec._dirty.wait(), 5)
    assert env.rec._changed_workloads == {"web"}


async def test_failures_count_in_the_order_they_happened(env: Env) -> None:
    """The second failure in time starts a new round only if it came after the first's
    backoff: counted oldest first, whatever the order of the table."""
    w = workload(replicas=2)
    late = inst("web-late", P.FAILED, finished_at=10.0)
    early = inst("web-early", P.FAILED, finished_at=5.0)
    crash = env.rec._crash_streak(w, {late.name: late, early.name: early}, now=20.0)
    assert crash is not None
    assert (crash.failures, crash.not_before) == (2, 12.0)


async def test_a_stop_is_stamped_with_the_time_it_was_decided(
    env: Env, fake_time: FakeTime
) -> None:
    await env.put(workload(replicas=0), inst("web-a"))
    await env.plan()
    a = env.inst("web-a")
    assert (a.desired_stop, a.message, a.updated_at) == (True, "scaled down", fake_time.wall)


def test_new_instance_names_are_the_workload_and_six_hex_digits() -> None:
    names = {new_instance(workload(generation=4), 0, taken=()).name for _ in range(50)}
    assert all(re.fullmatch(r"web-[0-9a-f]{6}", n) for n in names)
    assert len(names) > 45


# ---- the loop ----


async def test_run_listens_passes_on_each_kick_and_tick_and_outlives_a_failed_pass(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = env.rec
    loop = asyncio.get_running_loop()
    timers: list[tuple[float, Any]] = []
    real_call_later = loop.call_later

    def call_later(delay: float, cb: Any, *args: Any) -> asyncio.TimerHandle:
        timers.append((delay, cb))
        return real_call_later(delay, cb, *args)

    monkeypatch.setattr(loop, "call_later", call_later)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    class Aio:
        """The reconciler's `asyncio`, with `sleep` recorded and made instant."""

        def __getattr__(self, name: str) -> Any:
            return getattr(asyncio, name)

        async def sleep(self, delay: float) -> None:
            sleeps.append(delay)
            await real_sleep(0)

    monkeypatch.setattr(reconciler_module, "asyncio", Aio())
    passes: list[tuple[bool, bool, bool]] = []
    passed = asyncio.Event()

    async def reconcile_once() -> None:
        passes.append((rec._listening, rec._full_due, rec._on_change in env.repo.listeners))
        rec._full_due = False
        passed.set()
        if len(passes) == 2:
            raise RuntimeError("boom")

    monkeypatch.setattr(rec, "reconcile_once", reconcile_once)

    async def next_pass(count: int) -> None:
        while len(passes) < count:
            passed.clear()
            await asyncio.wait_for(passed.wait(), 5)

    rec._full_due = False
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(rec.run())
        rec.kick()
        await next_pass(1)  # at once, on the kick
        await next_pass(3)  # then on the 1 s tick: one fails, the next is full
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert passes == [(True, True, True), (True, False, True), (True, True, True)]
    assert [(e["event"], e["log_level"]) for e in logs] == [("reconcile pass failed", "error")]
    assert sleeps == [0.5]
    ticks = [d for d, cb in timers if cb == rec._dirty.set]
    assert len(ticks) >= 3 and set(ticks) == {1.0}
    assert (rec._listening, rec._on_change in env.repo.listeners) == (False, False)


# ---- planning: each step looks at every instance ----


def planned(changes: list[Change]) -> dict[str, Instance | None]:
    """The last planned value of each instance."""
    return {c.name: c.value for c in changes if c.kind == "instances"}  # type: ignore[misc]


async def test_a_node_loss_is_seen_behind_finished_and_unplaced_instances(env: Env) -> None:
    env.repo.nodes = {"n1": node("n1", state=NodeState.LOST)}
    insts = {
        "web-f": inst("web-f", P.FAILED, "n1", reason="Crashed"),
        "web-p": inst("web-p", P.PENDING),
        "web-r": inst("web-r", P.RUNNING, "n1"),
    }
    out = planned(env.rec._plan_workload(workload(replicas=2), insts, now=77.0))
    assert "web-f" not in out  # finished before the loss: it stays what it was
    lost = out["web-r"]
    assert lost is not None
    assert (lost.phase, lost.reason, lost.message, lost.finished_at, lost.updated_at) == (
        P.LOST,
        "NodeLost",
        "node n1 is LOST",
        77.0,
        77.0,
    )


async def test_rolling_and_draining_steps_look_past_what_they_skip(env: Env) -> None:
    env.repo.nodes = {"n1": node("n1"), "n2": node("n2", draining=True)}
    w = workload(replicas=4, generation=2)
    insts = {
        "web-f": inst("web-f", P.FAILED, "n1", generation=1),  # finished: not rolled
        "web-s": inst("web-s", P.RUNNING, "n1", generation=1, desired_stop=True),  # stopping
        "web-p": inst("web-p", P.PENDING, generation=1),  # updated in place, then ...
        "web-r": inst("web-r", P.RUNNING, "n1", generation=1),  # ... the oldest bound one
        "web-o": inst("web-o", P.RUNNING, "n1", generation=1),  # waits: one at a time
        "web-d": inst("web-d", P.RUNNING, "n2", generation=2),  # but a drain does not wait
    }
    out = planned(env.rec._plan_workload(w, insts, now=time.time()))
    assert out["web-p"] is not None and out["web-p"].generation == 2
    # The drain does not wait; the rollout adds one (surge 1) and stops none yet.
    assert {n for n, i in out.items() if i is not None and i.replaced_by} == {"web-d"}
    fresh = [n for n in out if n not in insts]
    assert len(fresh) == 2  # the drain's successor and the rollout's new one
    assert "web-f" not in out and "web-s" not in out and "web-o" not in out
    assert "web-r" not in out


async def test_a_rolling_update_waits_for_its_successor_to_run(env: Env) -> None:
    olds = [inst(f"web-{i}", P.RUNNING, "n1", generation=1) for i in range(3)]
    await env.put(node("n1"), workload(replicas=3, generation=2), *olds)
    await env.plan()
    await env.plan()
    assert len([i for i in env.of() if i.generation == 2]) == 1
    assert not [i.name for i in env.of() if i.desired_stop]


async def test_during_a_backoff_outdated_pending_instances_are_still_updated(env: Env) -> None:
    env.repo.nodes = {"n1": node("n1")}
    now = 1000.0
    env.rec.crashes["web"] = CrashBackoff(failures=1, not_before=now + 1)
    insts = {
        "web-r": inst("web-r", P.RUNNING, "n1", generation=1, created_at=1.0),
        "web-p": inst("web-p", P.PENDING, generation=1, created_at=2.0),
    }
    out = planned(env.rec._plan_workload(workload(replicas=2, generation=2), insts, now))
    assert set(out) == {"web-p"}  # web-r waits out the backoff
    assert out["web-p"] is not None and out["web-p"].generation == 2


async def test_a_rolling_successor_waits_until_the_backoff_ends_exactly(env: Env) -> None:
    clock = Clock()
    env.rec.clock = clock
    await env.put(node("n1"), workload(replicas=1, generation=2), inst("web-a", generation=1))
    env.rec.crashes["web"] = CrashBackoff(failures=1, not_before=clock.now + 1)
    clock.now += 1 - 0.001
    await env.plan()
    assert not [i for i in env.of() if i.generation == 2]
    clock.now = env.rec.crashes["web"].not_before
    await env.plan()
    (succ,) = [i.name for i in env.of() if i.generation == 2]
    assert env.rec.crashes["web"].probes == {succ}


async def test_the_backoff_status_ends_when_the_backoff_does(env: Env) -> None:
    clock = Clock()
    env.rec.clock = clock
    await env.put(node("n1"), workload(replicas=1), inst("web-a", P.FAILED, finished_at=clock.now))
    await env.plan()
    w = env.repo.workloads["web"]
    assert w.status.message.startswith("1 instance failure(s) in a row")
    assert w.updated_at == clock.now
    clock.now += 1
    await env.plan()
    w = env.repo.workloads["web"]
    assert (w.status.message, w.updated_at) == ("", clock.now)


async def test_history_is_trimmed_by_finish_time(env: Env) -> None:
    # The first to finish was written last (a late report): still the first to go.
    failed = [
        inst(f"web-f{i}", P.FAILED, finished_at=float(i + 1), updated_at=float(100 - i))
        for i in range(KEEP_FINISHED + 1)
    ]
    await env.put(node("n1"), workload(replicas=1), inst("web-run"), *failed)
    await env.plan()
    assert "web-f0" not in env.repo.instances
    assert len([i for i in env.of() if i.terminal]) == KEEP_FINISHED


async def test_without_run_every_pass_is_full(env: Env) -> None:
    await env.rec.reconcile_once()
    await env.put(workload(replicas=1))
    await env.rec.reconcile_once()
    assert len(env.of()) == 1


async def test_the_streak_ends_at_exactly_the_healthy_run_logged_with_its_failures(
    env: Env,
) -> None:
    clock = Clock()
    env.rec.clock = clock
    probe = inst("web-p", P.RUNNING, started_at=clock.now - CRASH_HEALTHY_RUN + 1)
    await env.put(node("n1"), workload(replicas=1), probe)
    crash = CrashBackoff(failures=3, not_before=clock.now + 4, probes={"web-p", "web-gone"})
    env.rec.crashes["web"] = crash
    await env.plan()
    # a probe whose record is gone is dropped; the live one runs 1 s short of healthy
    assert (crash.failures, crash.probes) == (3, {"web-p"})
    clock.now += 1  # exactly CRASH_HEALTHY_RUN
    with structlog.testing.capture_logs() as logs:
        await env.plan()
    assert (crash.failures, crash.not_before, crash.probes) == (0, 0.0, set())
    recovered = [e for e in logs if e["event"] == "workload recovered"]
    assert recovered == [
        {"event": "workload recovered", "workload": "web", "failures": 3, "log_level": "info"}
    ]
