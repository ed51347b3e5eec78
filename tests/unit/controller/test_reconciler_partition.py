"""Lost nodes the operators' way (WorkloadSpec.on_node_lost): what the reconciler decides for
an instance whose node is lost, and how each instance is settled once when the node is back.

The decision itself is a table (`node_lost_policy`); the whole passes below walk a partition
through its steps: lost, waited for (or replaced), back.
"""

# The env fixture is imported from the whole-pass tests; taking it as a parameter is not a
# redefinition.
# ruff: noqa: F811

from __future__ import annotations

from typing import Any

import pytest

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.cli.manifest import parse_manifests
from orka.cli.output import describe_instance
from orka.controller.commands import InstanceReported, NodeSynced
from orka.controller.reconciler import LossDecision, node_lost_policy
from orka.errors import Invalid
from orka.models import (
    Instance,
    InstancePhase,
    InstanceReport,
    InvalidTransition,
    NodeState,
    OnNodeLost,
    WorkloadSpec,
)
from orka.rpc.convert import (
    instance_from_pb,
    instance_to_pb,
    report_from_pb,
    spec_from_pb,
    spec_to_pb,
)
from tests.unit.controller.test_reconciler import (  # noqa: F401
    Clock,
    Env,
    active,
    env,
    inst,
    node,
    workload,
)

P = InstancePhase
WAIT = {"on_node_lost": OnNodeLost.WAIT, "max_disconnect": 60.0}
NOW = 1_000_000.0


def spec(**kw: Any) -> WorkloadSpec:
    return workload().spec.model_copy(update=kw)


# (policy, instance phase, node state or None for no record, seconds since DISCONNECTED) -> decision
POLICY_TABLE = [
    # REPLACE: a lost or departed node's instances are lost at once; others are kept.
    ({}, P.RUNNING, NodeState.READY, None, LossDecision.KEEP),
    ({}, P.RUNNING, NodeState.NOT_READY, None, LossDecision.KEEP),
    ({}, P.RUNNING, NodeState.LOST, None, LossDecision.LOSE),
    ({}, P.SCHEDULED, NodeState.LEFT, None, LossDecision.LOSE),
    ({}, P.RUNNING, None, None, LossDecision.KEEP),
    # WAIT: a LOST node is waited for; a node that left is not (it does not come back with it).
    (WAIT, P.RUNNING, NodeState.NOT_READY, None, LossDecision.KEEP),
    (WAIT, P.RUNNING, NodeState.LOST, None, LossDecision.WAIT),
    (WAIT, P.STARTING, NodeState.LOST, None, LossDecision.WAIT),
    (WAIT, P.RUNNING, NodeState.LEFT, None, LossDecision.LOSE),
    (WAIT, P.DISCONNECTED, NodeState.LOST, 0.0, LossDecision.WAITING),
    (WAIT, P.DISCONNECTED, NodeState.LOST, 59.9, LossDecision.WAITING),
    (WAIT, P.DISCONNECTED, NodeState.LOST, 60.0, LossDecision.EXPIRED),
    # Back READY without reporting it: its sync settles it; if not, the wait still ends.
    (WAIT, P.DISCONNECTED, NodeState.READY, 10.0, LossDecision.WAITING),
    (WAIT, P.DISCONNECTED, NodeState.READY, 61.0, LossDecision.EXPIRED),
    (WAIT, P.DISCONNECTED, NodeState.LEFT, 1.0, LossDecision.LOSE),
    (WAIT, P.DISCONNECTED, None, 1.0, LossDecision.WAITING),
    (WAIT, P.DISCONNECTED, None, 60.0, LossDecision.EXPIRED),
    # The policy changed to REPLACE while it waited: replaced now.
    ({}, P.DISCONNECTED, NodeState.LOST, 1.0, LossDecision.LOSE),
]


@pytest.mark.parametrize(("policy", "phase", "state", "since", "decision"), POLICY_TABLE)
def test_node_lost_policy(
    policy: dict[str, Any],
    phase: InstancePhase,
    state: NodeState | None,
    since: float | None,
    decision: LossDecision,
) -> None:
    extra = {} if since is None else {"disconnected_at": NOW - since}
    i = inst("web-a", phase, "n1", **extra)
    n = node("n1", state=state) if state is not None else None
    assert node_lost_policy(spec(**policy), i, n, NOW) is decision


def running(name: str, node_name: str = "n1") -> InstanceReport:
    return InstanceReport(name=name, workload="web", node=node_name, phase=P.RUNNING, reason="")


def copies(env: Env) -> dict[str, tuple[InstancePhase, str, bool]]:
    return {i.name: (i.phase, i.node, i.desired_stop) for i in env.of()}


async def test_wait_keeps_a_lost_nodes_instances_and_takes_them_back(env: Env) -> None:
    clock = Clock(NOW)
    env.rec.clock = clock
    await env.put(
        node("n1", state=NodeState.LOST),
        node("n2"),
        workload(replicas=2).model_copy(update={"spec": spec(replicas=2, **WAIT)}),
        inst("web-a", P.RUNNING, "n1"),
        inst("web-b", P.RUNNING, "n2"),
    )
    await env.plan()
    a = env.inst("web-a")
    assert (a.phase, a.reason, a.disconnected_at) == (P.DISCONNECTED, "NodeDisconnected", NOW)
    assert "waiting up to 60s" in a.message
    assert {i.name for i in env.of()} == {"web-a", "web-b"}  # nothing placed in its stead
    status = env.repo.workloads["web"].status
    assert (status.placed, status.running) == (2, 1)
    clock.now += 59
    await env.plan()
    assert env.inst("web-a").phase is P.DISCONNECTED and len(env.of()) == 2
    # Back within the wait, still running it: kept as it was, nothing stopped, nothing new.
    await env.put(node("n1"))
    await env.rec.on_updates([NodeSynced(node="n1", reports=[running("web-a")])])
    await env.plan()
    a = env.inst("web-a")
    assert (a.phase, a.reason, a.disconnected_at, a.desired_stop) == (P.RUNNING, "", None, False)
    assert len(env.of()) == 2
    assert env.link.commands == []


async def test_wait_replaces_once_max_disconnect_has_passed(env: Env) -> None:
    clock = Clock(NOW)
    env.rec.clock = clock
    await env.put(
        node("n1", state=NodeState.LOST),
        node("n2"),
        workload(replicas=1).model_copy(update={"spec": spec(replicas=1, **WAIT)}),
        inst("web-a", P.RUNNING, "n1"),
    )
    await env.plan()
    clock.now += 60
    await env.plan()
    a = env.inst("web-a")
    assert (a.phase, a.reason) == (P.LOST, "NodeLost")
    assert "60s waited" in a.message
    [new] = active(env.of())
    assert new.phase is P.PENDING


async def test_back_without_it_a_disconnected_instance_is_lost_and_replaced(env: Env) -> None:
    await env.put(
        node("n1", state=NodeState.LOST),
        workload(replicas=1).model_copy(update={"spec": spec(replicas=1, **WAIT)}),
        inst("web-a", P.RUNNING, "n1"),
    )
    await env.plan()
    await env.put(node("n1"))
    await env.rec.on_updates([NodeSynced(node="n1", reports=[])])
    await env.plan()
    assert (env.inst("web-a").phase, env.inst("web-a").reason) == (P.LOST, "NotOnNode")
    assert [i.phase for i in active(env.of())] == [P.PENDING]


# What a returning node's copy of a LOST (replaced) instance becomes, by where its replacement
# is: never placed -> the original is kept and the replacement dropped; placed -> the original
# is stopped on its node (a stop command), the replacement stays.
@pytest.mark.parametrize(
    ("successor", "kept"),
    [
        (None, False),  # none: scaled to 0 meanwhile, so not needed; stopped
        (P.PENDING, True),
        (P.SCHEDULED, False),
        (P.RUNNING, False),
    ],
)
async def test_replaced_instance_back_is_settled_once(
    env: Env, successor: InstancePhase | None, kept: bool
) -> None:
    lost = inst("web-a", P.LOST, "n1", reason="NodeLost", ordinal=0)
    objs: list[Any] = [node("n1"), node("n2"), workload(replicas=1 if successor else 0), lost]
    if successor is not None:
        objs.append(inst("web-b", successor, None if successor is P.PENDING else "n2", ordinal=0))
    await env.put(*objs)
    report = running("web-a")
    # Twice, as a sync and then a heartbeat: the second changes nothing more.
    await env.rec.on_updates([NodeSynced(node="n1", reports=[report])])
    await env.rec.on_updates([InstanceReported(report=report)])
    await env.plan()
    a = env.inst("web-a")
    stops = [(c.node, c.stop.instance) for c in env.link.commands if c.HasField("stop")]
    if kept:
        assert (a.phase, a.reason, a.finished_at) == (P.RUNNING, "", None)
        assert stops == []
        assert "web-b" not in env.repo.instances or env.inst("web-b").desired_stop
        assert [i.name for i in active(env.of())] == ["web-a"]
    else:
        assert a.phase is P.LOST
        assert stops == [("n1", "web-a")]
        assert [i.name for i in active(env.of())] == (["web-b"] if successor else [])


async def test_each_returning_original_drops_its_own_pending_replacement(env: Env) -> None:
    """Two replicas lost with one node, two replacements pending: each original is matched to
    the replacement of its own replica (ordinal), each dropped once."""
    await env.put(
        node("n1"),
        workload(replicas=2),
        inst("web-a", P.LOST, "n1", reason="NodeLost", ordinal=0),
        inst("web-b", P.LOST, "n1", reason="NodeLost", ordinal=1),
        inst("web-c", P.PENDING, ordinal=1),
        inst("web-d", P.PENDING, ordinal=0),
    )
    await env.rec.on_updates([NodeSynced(node="n1", reports=[running("web-a"), running("web-b")])])
    got = copies(env)
    assert got["web-a"] == (P.RUNNING, "n1", False)
    assert got["web-b"] == (P.RUNNING, "n1", False)
    assert got["web-c"] == (P.PENDING, "", True)
    assert got["web-d"] == (P.PENDING, "", True)
    assert "web-a is back" in env.inst("web-d").message
    await env.plan()
    assert sorted(i.name for i in env.of()) == ["web-a", "web-b"]


async def test_a_scale_down_drops_a_disconnected_instance_before_a_running_one(
    env: Env,
) -> None:
    await env.put(
        node("n1", state=NodeState.LOST),
        node("n2"),
        workload(replicas=2).model_copy(update={"spec": spec(replicas=2, **WAIT)}),
        inst("web-a", P.RUNNING, "n1"),
        inst("web-b", P.RUNNING, "n2"),
    )
    await env.plan()
    await env.put(env.repo.workloads["web"].model_copy(update={"spec": spec(replicas=1, **WAIT)}))
    await env.plan()
    assert env.inst("web-a").desired_stop and not env.inst("web-b").desired_stop


def test_reconnected_only_from_a_node_loss_and_to_a_live_phase() -> None:
    report = running("web-a")
    with pytest.raises(InvalidTransition):
        inst("web-a", P.LOST, reason="NotOnNode").reconnected(report, NOW)
    with pytest.raises(InvalidTransition):
        inst("web-a", P.RUNNING).reconnected(report, NOW)
    failed = report.model_copy(update={"phase": P.FAILED})
    with pytest.raises(InvalidTransition):
        inst("web-a", P.DISCONNECTED).reconnected(failed, NOW)
    back: Instance = inst("web-a", P.DISCONNECTED, disconnected_at=1.0).reconnected(report, NOW)
    assert (back.phase, back.disconnected_at) == (P.RUNNING, None)


# ---- the policy at the edges: the API, manifests, agents' reports ----


def test_the_policy_round_trips_through_the_api() -> None:
    waiting = spec(**WAIT)
    msg = spec_to_pb(waiting)
    assert (msg.on_node_lost, msg.max_disconnect.seconds) == (pb.WorkloadSpec.ON_NODE_LOST_WAIT, 60)
    assert spec_from_pb(msg) == waiting
    # REPLACE, the default, stays unset on the wire.
    assert not spec_to_pb(spec()).HasField("max_disconnect")
    assert spec_to_pb(spec()).on_node_lost == pb.WorkloadSpec.ON_NODE_LOST_UNSPECIFIED


@pytest.mark.parametrize(
    ("policy", "seconds", "field", "words"),
    [
        (2, None, "spec.max_disconnect", "required with on_node_lost WAIT"),
        (2, 0, "spec.max_disconnect", "more than 0s"),
        (2, -5, "spec.max_disconnect", "more than 0s"),
        (2, 7 * 24 * 3600 + 1, "spec.max_disconnect", "at most 604800s"),
        (1, 30, "spec.max_disconnect", "only with on_node_lost WAIT"),
        (0, 30, "spec.max_disconnect", "only with on_node_lost WAIT"),
        (7, None, "spec.on_node_lost", "unknown policy 7"),
    ],
)
def test_a_bad_policy_is_refused_naming_its_field(
    policy: int, seconds: int | None, field: str, words: str
) -> None:
    msg = spec_to_pb(spec())
    msg.on_node_lost = policy  # type: ignore[assignment]
    if seconds is not None:
        msg.max_disconnect.seconds = seconds
    with pytest.raises(Invalid) as err:
        spec_from_pb(msg)
    assert [v.field for v in err.value.fields] == [field]
    assert words in err.value.message


def test_a_manifest_takes_the_policy_as_users_write_it() -> None:
    [got] = parse_manifests(
        "name: web\nkind: process\ncommand: [sleep, '9']\non_node_lost: wait\nmax_disconnect: 5m\n"
    )
    assert isinstance(got, WorkloadSpec)
    assert (got.on_node_lost, got.max_disconnect) == (OnNodeLost.WAIT, 300.0)


def test_an_agent_cannot_report_an_instance_disconnected() -> None:
    msg = apb.InstanceStatus(name="web-a", workload="web", phase=pb.Instance.DISCONNECTED)
    with pytest.raises(Invalid, match="set by the controller"):
        report_from_pb(msg, "n1")


async def test_a_pending_replacement_is_dropped_for_one_original_only(env: Env) -> None:
    """Two originals back in one sync, one replacement pending and one placed: the first takes
    the pending one; the second was replaced for real and is stopped on its node."""
    await env.put(
        node("n1"),
        node("n2"),
        workload(replicas=2),
        inst("web-a", P.LOST, "n1", reason="NodeLost", ordinal=0),
        inst("web-b", P.LOST, "n1", reason="NodeLost", ordinal=1),
        inst("web-c", P.PENDING, ordinal=0),
        inst("web-d", P.RUNNING, "n2", ordinal=1),
    )
    await env.rec.on_updates([NodeSynced(node="n1", reports=[running("web-a"), running("web-b")])])
    got = copies(env)
    assert got["web-a"] == (P.RUNNING, "n1", False)
    assert got["web-b"] == (P.LOST, "n1", False)
    assert got["web-c"] == (P.PENDING, "", True)
    assert got["web-d"] == (P.RUNNING, "n2", False)
    assert [(c.node, c.stop.instance) for c in env.link.commands] == [("n1", "web-b")]


def test_an_instance_says_since_when_it_is_disconnected() -> None:
    waiting = inst("web-a", P.DISCONNECTED, disconnected_at=NOW - 30, reason="NodeDisconnected")
    msg = instance_to_pb(waiting)
    assert (msg.phase, msg.disconnect_time.seconds) == (pb.Instance.DISCONNECTED, int(NOW - 30))
    assert instance_from_pb(msg).disconnected_at == NOW - 30
    assert not instance_to_pb(inst("web-b")).HasField("disconnect_time")
    assert "Disconnected:" in describe_instance(waiting, now=NOW)


@pytest.mark.parametrize("phase", list(InstancePhase))
def test_only_a_bound_live_instance_can_be_disconnected(phase: InstancePhase) -> None:
    i = inst("web-a", phase, "n1")
    if phase in (P.SCHEDULED, P.STARTING, P.RUNNING, P.STOPPING):
        got = i.disconnected("node n1 is LOST", NOW)
        assert (got.phase, got.reason, got.disconnected_at) == (
            P.DISCONNECTED,
            "NodeDisconnected",
            NOW,
        )
        assert i.phase is phase  # the record is a value: the old one is left as it was
    else:
        with pytest.raises(InvalidTransition):
            i.disconnected("node n1 is LOST", NOW)
