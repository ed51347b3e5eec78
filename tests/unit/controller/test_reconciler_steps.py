"""The steps of `_plan_workload`, each on its own: what one step writes from a given table.

The whole-pass tests (test_reconciler.py) see the steps only together; these pin each one, so
a step that goes wrong is named by the test that fails.
"""

# The env fixture is imported from the whole-pass tests; taking it as a parameter is not a
# redefinition.
# ruff: noqa: F811

from __future__ import annotations

import pytest

from orka.controller.reconciler import (
    CrashBackoff,
    WorkloadStep,
    _completed,
    _release_replaced,
    _scale,
)
from orka.controller.repo import Change
from orka.models import Instance, InstancePhase, NodeState, RestartPolicy, VolumeTemplate
from tests.unit.controller.test_reconciler import (  # noqa: F401
    Env,
    env,
    inst,
    node,
    planned,
    workload,
)

P = InstancePhase


def table(*insts: Instance) -> dict[str, Instance]:
    return {i.name: i for i in insts}


def test_a_step_sees_what_the_steps_before_it_wrote() -> None:
    insts = table(inst("web-a"), inst("web-b"))
    step = WorkloadStep(workload(), insts, now=5.0)
    assert step.current() is insts  # nothing written: the table itself, not a copy
    changed = insts["web-a"].model_copy(update={"message": "x"})
    step.put(changed)
    assert step.current() == {"web-a": changed, "web-b": insts["web-b"]}
    assert insts["web-a"].message == ""  # the workload's own table is left alone
    assert step.changes == [Change("instances", "web-a", changed)]


async def test_lose_on_gone_nodes_marks_only_live_bound_instances_on_lost_or_left_nodes(
    env: Env,
) -> None:
    env.repo.nodes = {
        "n1": node("n1", state=NodeState.LEFT),
        "n2": node("n2", state=NodeState.NOT_READY),
    }
    insts = table(
        inst("web-a", P.STARTING, "n1"),
        inst("web-b", P.RUNNING, "n2"),  # not ready: may come back
        inst("web-c", P.RUNNING, "n9"),  # unknown node: nothing to say it is gone
        inst("web-d", P.STOPPED, "n1"),  # finished before: stays what it was
    )
    step = WorkloadStep(workload(), insts, now=12.0)
    env.rec._lose_on_gone_nodes(step)
    out = planned(step.changes)
    assert list(out) == ["web-a"]
    lost = out["web-a"]
    assert lost is not None
    assert (lost.phase, lost.reason, lost.message, lost.finished_at, lost.updated_at) == (
        P.LOST,
        "NodeLost",
        "node n1 is LEFT",
        12.0,
        12.0,
    )


@pytest.mark.parametrize(
    ("successor", "want"),
    [
        (None, "freed"),  # vanished
        (inst("web-s", P.FAILED), "freed"),
        (inst("web-s", P.RUNNING, desired_stop=True), "freed"),
        (inst("web-s", P.STARTING), "waits"),
        (inst("web-s", P.PENDING), "waits"),
        (inst("web-s", P.RUNNING), "stops"),
    ],
)
def test_release_replaced_stops_a_predecessor_once_its_successor_runs(
    successor: Instance | None, want: str
) -> None:
    old = inst("web-a", P.RUNNING, replaced_by="web-s")
    step = WorkloadStep(workload(), table(old, *([successor] if successor else [])), now=1.0)
    _release_replaced(step)
    out = planned(step.changes)
    if want == "waits":
        assert out == {}
        return
    new = out["web-a"]
    assert new is not None and list(out) == ["web-a"]
    if want == "freed":
        assert (new.replaced_by, new.desired_stop) == ("", False)
    else:
        assert (new.replaced_by, new.desired_stop, new.message) == (
            "web-s",
            True,
            "replaced by web-s",
        )


def test_release_replaced_leaves_stopping_and_finished_predecessors_alone() -> None:
    step = WorkloadStep(
        workload(),
        table(
            inst("web-a", P.RUNNING, replaced_by="gone", desired_stop=True),
            inst("web-b", P.FAILED, replaced_by="gone"),
        ),
        now=1.0,
    )
    _release_replaced(step)
    assert step.changes == []


@pytest.mark.parametrize(
    ("phase", "policy", "desired_stop", "done"),
    [
        (P.SUCCEEDED, RestartPolicy.ALWAYS, False, True),
        (P.SUCCEEDED, RestartPolicy.ALWAYS, True, False),
        (P.FAILED, RestartPolicy.NEVER, False, True),
        (P.FAILED, RestartPolicy.ON_FAILURE, False, False),
        (P.FAILED, RestartPolicy.ALWAYS, False, False),
        (P.STOPPED, RestartPolicy.NEVER, False, False),
        (P.LOST, RestartPolicy.NEVER, False, False),
        (P.RUNNING, RestartPolicy.NEVER, False, False),
    ],
)
def test_completed_is_what_finished_its_replica_for_good(
    phase: InstancePhase, policy: RestartPolicy, desired_stop: bool, done: bool
) -> None:
    i = inst("web-a", phase, desired_stop=desired_stop)
    assert _completed(workload(policy=policy), table(i)) == ([i] if done else [])


def test_scale_counts_completed_replicas_and_skips_replaced_and_finished_ones() -> None:
    insts = table(
        inst("web-a", P.RUNNING),
        inst("web-b", P.RUNNING, replaced_by="web-c"),  # its successor stands for it
        inst("web-c", P.PENDING),
        inst("web-d", P.FAILED),
        inst("web-e", P.SUCCEEDED),
    )
    step = WorkloadStep(workload(replicas=4), insts, now=1.0)
    _scale(step, [insts["web-e"]], None)
    new = [i for i in planned(step.changes).values() if i is not None]
    assert len(new) == 1 and new[0].name.startswith("web-") and new[0].phase is P.PENDING
    assert new[0].name not in insts


@pytest.mark.parametrize(("now", "added"), [(9.99, 0), (10.0, 2)])
def test_scale_adds_nothing_during_a_crash_backoff_and_probes_what_it_adds_after(
    now: float, added: int
) -> None:
    crash = CrashBackoff(failures=1, not_before=10.0)
    step = WorkloadStep(workload(replicas=2), {}, now=now)
    _scale(step, [], crash)
    names = [c.name for c in step.changes]
    assert len(names) == added
    assert crash.probes == set(names)


def test_scale_down_is_not_held_by_a_crash_backoff() -> None:
    crash = CrashBackoff(failures=3, not_before=1e9)
    step = WorkloadStep(workload(replicas=1), table(inst("web-a"), inst("web-b")), now=1.0)
    _scale(step, [], crash)
    out = planned(step.changes)
    assert [(n, i.desired_stop, i.message) for n, i in out.items() if i] == [
        ("web-b", True, "scaled down")  # the newer of two equals
    ]
    assert crash.probes == set()


async def test_draining_is_bound_instances_on_draining_nodes_oldest_first(env: Env) -> None:
    env.repo.nodes = {"n1": node("n1"), "n2": node("n2", draining=True)}
    w = workload(generation=2)
    insts = table(
        inst("web-d", P.RUNNING, "n2", generation=2, created_at=3.0),  # draining
        inst("web-p", P.PENDING, generation=1, created_at=2.0),  # outdated, not placed
        inst("web-o", P.RUNNING, "n1", generation=1, created_at=1.0),  # outdated
        inst("web-q", P.PENDING, "n2", generation=2, created_at=0.5),  # pending: nothing to move
        inst("web-k", P.RUNNING, "n1", generation=2, created_at=0.1),  # current, ready node
        inst("web-r", P.RUNNING, "n2", generation=1, replaced_by="x"),  # already replaced
    )
    # Outdated ones are the rollout's (orka/controller/rollout.py), not the drain's.
    del w
    assert [i.name for i in env.rec._draining(insts)] == ["web-d"]


async def test_forget_finished_drops_stopped_unplaced_ones_not_in_flight(env: Env) -> None:
    insts = table(
        inst("web-a", P.PENDING, desired_stop=True),
        inst("web-b", P.PENDING, desired_stop=True),  # being placed: kept until it is back
        inst("web-c", P.PENDING),
    )
    env.queue.inflight.add("web-b")
    step = WorkloadStep(workload(), insts, now=1.0)
    env.rec._forget_finished(step, [])
    assert step.changes == [Change("instances", "web-a", None)]


def test_scale_gives_each_new_replica_the_lowest_free_ordinal() -> None:
    # Replica 1 failed (its replacement takes 1 back); 0 and 3 run; 2 is being stopped.
    insts = table(
        inst("web-a", P.RUNNING, ordinal=0),
        inst("web-b", P.FAILED, ordinal=1),
        inst("web-c", P.RUNNING, ordinal=3),
        inst("web-d", P.RUNNING, ordinal=2, desired_stop=True),
    )
    step = WorkloadStep(workload(replicas=4), insts, now=1.0)
    _scale(step, [], None)
    new = sorted(i.ordinal for i in planned(step.changes).values() if i is not None)
    assert new == [1, 2]


@pytest.mark.parametrize(
    ("template", "stopped"), [(True, ["web-c", "web-b"]), (False, ["web-a", "web-z"])]
)
def test_scale_down_of_replicas_with_their_own_volumes_stops_the_highest_ordinals(
    template: bool, stopped: list[str]
) -> None:
    spec = workload(replicas=2).spec
    if template:
        spec = spec.model_copy(
            update={"volume_template": VolumeTemplate(name="data", size_bytes=1 << 20)}
        )
    w = workload(replicas=2).model_copy(update={"spec": spec})
    # Without a template: the pending one first, then the newest (web-z).
    insts = table(
        inst("web-a", P.PENDING, ordinal=1),
        inst("web-b", P.RUNNING, ordinal=2),
        inst("web-c", P.RUNNING, ordinal=3),
        inst("web-z", P.RUNNING, ordinal=0),
    )
    step = WorkloadStep(w, insts, now=1.0)
    _scale(step, [], None)
    out = planned(step.changes)
    assert [n for n, i in out.items() if i and i.desired_stop] == stopped
