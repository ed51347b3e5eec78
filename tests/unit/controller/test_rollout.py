"""Rollout planning (orka/controller/rollout.py) on small built workloads, table-driven."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from orka.api import controller_pb2 as pb
from orka.controller import rollout
from orka.errors import Conflict, Invalid
from orka.models import (
    MAX_REVISION_BYTES,
    HealthState,
    Instance,
    InstancePhase,
    OnNodeLost,
    Revision,
    Rollout,
    RolloutState,
    UpdateStrategy,
    VolumeTemplate,
    Workload,
    WorkloadKind,
    WorkloadSpec,
    WorkloadStatus,
)
from orka.rpc import convert

P = InstancePhase
S = RolloutState
NOW = 10_000.0
_seq = itertools.count(1)


def spec(command: str = "v2", replicas: int = 6, **update: Any) -> WorkloadSpec:
    return WorkloadSpec(
        name="web",
        kind=WorkloadKind.PROCESS,
        command=["run", command],
        replicas=replicas,
        update=UpdateStrategy(**update),
    )


def workload(
    s: WorkloadSpec,
    state: RolloutState = S.PROGRESSING,
    stable: int = 1,
    deadline: float = NOW + 600,
    **rollout_fields: Any,
) -> Workload:
    """Generation 2 (spec `s`) rolling out over generation 1 (command v1)."""
    revisions = [
        Revision(revision=1, spec=s.model_copy(update={"command": ["run", "v1"]})),
        Revision(revision=2, spec=s),
    ]
    r = Rollout(
        state=state,
        revision=2,
        stable=stable,
        progress_at=NOW - 1,
        deadline=deadline,
        **rollout_fields,
    )
    return Workload(spec=s, generation=2, rollout=r, revisions=revisions)


def inst(
    gen: int,
    phase: InstancePhase = P.RUNNING,
    health: HealthState | None = None,
    ready_since: float = NOW - 100,
    **kw: Any,
) -> Instance:
    n = next(_seq)
    if health is None:
        health = HealthState.HEALTHY if phase is P.RUNNING else HealthState.UNKNOWN
    return Instance(
        name=f"web-{n:03d}",
        workload="web",
        generation=gen,
        phase=phase,
        node="" if phase is P.PENDING else "n1",
        health=health,
        started_at=ready_since,
        health_changed_at=ready_since,
        **{"created_at": float(n), **kw},
    )


def fresh(w: Workload) -> Instance:
    return Instance(name=f"web-new{next(_seq)}", workload="web", generation=w.generation)


def run(w: Workload, insts: list[Instance], may_add: bool = True) -> rollout.Outcome:
    return rollout.plan_rollout(w, {i.name: i for i in insts}, NOW, may_add, fresh)


def moves(out: rollout.Outcome, insts: list[Instance]) -> tuple[list[str], int]:
    """(names stopped, how many new instances were added)."""
    known = {i.name for i in insts}
    stopped = [i.name for i in out.puts if i.name in known and i.desired_stop]
    added = sum(1 for i in out.puts if i.name not in known)
    return stopped, added


# Each case: update bounds, the instances (old gen 1 / new gen 2), and what one pass does:
# which old ones (by index) stop, and how many new ones it adds.
CASES = [
    # surge 0, unavailable 1: one old stops first, its successor comes in the same pass.
    ("surge0-unavail1-start", {"max_surge": 0, "max_unavailable": 1}, [(1, P.RUNNING)] * 6, [0], 1),
    # surge 1, unavailable 0 (the defaults): one new first, no old stops yet.
    ("surge1-start", {}, [(1, P.RUNNING)] * 6, [], 1),
    # The new one is ready: the oldest old one stops, the next new one comes.
    ("surge1-next", {}, [(1, P.RUNNING)] * 6 + [(2, P.RUNNING)], [0], 1),
    # A new one still starting holds everything back under surge 0 / unavailable 1.
    (
        "surge0-waits",
        {"max_surge": 0, "max_unavailable": 1},
        [(1, P.RUNNING)] * 5 + [(2, P.STARTING)],
        [],
        0,
    ),
    # Two at a time with surge 2 / unavailable 0.
    ("surge2", {"max_surge": 2}, [(1, P.RUNNING)] * 6, [], 2),
    # An old one not ready (starting) goes first, within the budget (unavailable 1).
    (
        "unready-old-first",
        {"max_surge": 0, "max_unavailable": 1},
        [(1, P.RUNNING)] * 5 + [(1, P.STARTING)],
        [5],
        1,
    ),
    # An outdated instance not yet placed becomes a new one (nothing to stop); surge adds one.
    ("pending-relabelled", {}, [(1, P.RUNNING)] * 5 + [(1, P.PENDING)], [], 1),
    # Canary 2: two new ones at most, so old ones make room (surge 0).
    (
        "canary",
        {"max_surge": 0, "max_unavailable": 2, "canary": 2},
        [(1, P.RUNNING)] * 6,
        [0, 1],
        2,
    ),
]


@pytest.mark.parametrize(
    ("bounds", "layout", "stops", "adds"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_one_pass_moves_within_the_bounds(
    bounds: dict[str, int], layout: list[tuple[int, InstancePhase]], stops: list[int], adds: int
) -> None:
    w = workload(spec(**bounds))
    insts = [inst(g, p) for g, p in layout]
    out = run(w, insts)
    stopped, added = moves(out, insts)
    assert stopped == [insts[i].name for i in stops]
    assert added == adds
    assert out.workload.rollout.state is S.PROGRESSING


def test_min_ready_seconds_holds_a_running_new_instance_back_until_it_passes() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1, min_ready_seconds=30))
    olds = [inst(1) for _ in range(5)]
    new = inst(2, ready_since=NOW - 29)
    out = run(w, [*olds, new])
    assert moves(out, [*olds, new]) == ([], 0)
    assert out.wake_in == pytest.approx(1.0)
    new = new.model_copy(update={"started_at": NOW - 31, "health_changed_at": NOW - 31})
    assert moves(run(w, [*olds, new]), [*olds, new]) == ([olds[0].name], 1)


def test_an_unhealthy_new_instance_is_not_ready() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1))
    olds = [inst(1) for _ in range(5)]
    new = inst(2, health=HealthState.UNKNOWN)
    assert moves(run(w, [*olds, new]), [*olds, new]) == ([], 0)


def test_no_instance_is_added_during_a_crash_backoff() -> None:
    w = workload(spec())
    insts = [inst(1) for _ in range(6)]
    assert moves(run(w, insts, may_add=False), insts) == ([], 0)


@pytest.mark.parametrize(
    ("new", "why"),
    [
        (dict(phase=P.FAILED, message="exit code 1"), "failed: exit code 1"),
        (dict(phase=P.STARTING, restarts=2, message="BackOff"), "restarted 2 time(s)"),
        (dict(health=HealthState.UNHEALTHY, health_message="503"), "is unhealthy: 503"),
    ],
    ids=["exits", "crash-loop", "unhealthy"],
)
def test_a_failing_new_instance_fails_the_rollout_and_nothing_moves(
    new: dict[str, Any], why: str
) -> None:
    w = workload(spec())
    phase = new.pop("phase", P.RUNNING)
    insts = [*(inst(1) for _ in range(5)), inst(2, phase, **new)]
    out = run(w, insts)
    assert out.workload.rollout.state is S.FAILED
    assert why in out.workload.rollout.message
    assert moves(out, insts) == ([], 0)
    assert out.workload.generation == 2  # no auto_rollback: it stays


def test_auto_rollback_makes_a_revision_with_the_stable_spec_and_adopts_its_instances() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1, auto_rollback=True))
    olds = [inst(1) for _ in range(5)]
    bad = inst(2, P.FAILED, message="exit code 3")
    out = run(w, [*olds, bad])
    back = out.workload
    assert back.generation == 3
    assert back.spec.command == ["run", "v1"]
    assert back.spec.replicas == 6
    assert back.rollout.state is S.PROGRESSING
    assert back.rollout.rollback_of == 2 and back.rollout.stable == 1
    assert [r.revision for r in back.revisions] == [1, 2, 3]
    assert back.revisions[-1].cause.startswith("automatic rollback to revision 1")
    adopted = {i.name for i in out.puts if i.generation == 3 and not i.desired_stop}
    assert {o.name for o in olds} <= adopted  # the old ones keep running, now revision 3
    assert not any(i.desired_stop for i in out.puts)


def test_no_rollback_without_a_stable_revision() -> None:
    w = workload(spec(auto_rollback=True), stable=0)
    insts = [inst(1), inst(2, P.FAILED)]
    out = run(w, insts)
    assert out.workload.generation == 2 and out.workload.rollout.state is S.FAILED


def test_a_stalled_rollout_fails_past_its_deadline() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1), deadline=NOW - 1)
    w = w.model_copy(update={"status": WorkloadStatus(updated=1, ready=0)})
    insts = [*(inst(1) for _ in range(5)), inst(2, P.STARTING)]
    out = run(w, insts)
    assert out.workload.rollout.state is S.FAILED
    assert out.workload.rollout.message.startswith("no progress for 600s")


def test_progress_pushes_the_deadline_on() -> None:
    w = workload(spec(), deadline=NOW + 5)
    w = w.model_copy(update={"status": WorkloadStatus(updated=1, ready=0)})
    insts = [*(inst(1) for _ in range(6)), inst(2)]
    out = run(w, insts)
    assert out.workload.rollout.deadline == NOW + 600


def test_progress_only_tells_a_moved_deadline_from_any_other_change() -> None:
    w = workload(spec(), deadline=NOW + 5)
    w = w.model_copy(update={"status": WorkloadStatus(updated=1, ready=0)})
    out = run(w, [*(inst(1) for _ in range(6)), inst(2)])
    assert out.workload is not w
    assert rollout.progress_only(w, out.workload) is True
    assert rollout.progress_only(w, w) is True
    r = out.workload.rollout
    for other in (
        w.model_copy(update={"rollout": r.model_copy(update={"state": S.FAILED})}),
        w.model_copy(update={"rollout": r.model_copy(update={"message": "m"})}),
        w.model_copy(update={"rollout": r, "generation": 3}),
        w.model_copy(update={"rollout": r, "spec": spec(replicas=7)}),
    ):
        assert rollout.progress_only(w, other) is False


@pytest.mark.parametrize(
    ("rollback_of", "final"), [(0, S.COMPLETE), (2, S.ROLLED_BACK)], ids=["update", "rollback"]
)
def test_all_new_and_ready_completes(rollback_of: int, final: RolloutState) -> None:
    w = workload(spec(replicas=2), rollback_of=rollback_of)
    out = run(w, [inst(2), inst(2)])
    assert out.workload.rollout.state is final
    assert out.puts == []


def test_a_canary_waits_for_promotion_then_goes_on() -> None:
    w = workload(spec(replicas=4, canary=1))
    insts = [*(inst(1) for _ in range(3)), inst(2)]
    out = run(w, insts)
    assert out.workload.rollout.state is S.AWAITING_PROMOTION
    assert moves(out, insts) == ([], 0)
    promoted = rollout.promote(out.workload, NOW)
    assert promoted.rollout.state is S.PROGRESSING and promoted.rollout.promoted
    assert moves(run(promoted, insts), insts) == ([], 1)


@pytest.mark.parametrize("state", [S.PAUSED, S.FAILED, S.AWAITING_PROMOTION])
def test_a_held_rollout_moves_nothing(state: RolloutState) -> None:
    w = workload(spec(), state=state)
    insts = [inst(1) for _ in range(6)]
    out = run(w, insts)
    assert out.workload.rollout.state is state
    assert out.puts == []


def test_pause_resume_and_their_refusals() -> None:
    w = workload(spec())
    paused = rollout.pause(w, NOW)
    assert paused.rollout.state is S.PAUSED
    assert rollout.pause(paused, NOW) is paused
    resumed = rollout.resume(paused, NOW + 50)
    assert resumed.rollout.state is S.PROGRESSING
    assert resumed.rollout.deadline == NOW + 50 + 600
    with pytest.raises(Conflict, match="only a PROGRESSING rollout can be paused"):
        rollout.pause(workload(spec(), state=S.COMPLETE), NOW)
    with pytest.raises(Conflict, match="AWAITING_PROMOTION"):
        rollout.promote(w, NOW)


@pytest.mark.parametrize(
    ("old", "new", "same"),
    [
        (spec(replicas=3), spec(replicas=7), True),
        (spec(), spec(max_surge=3, auto_rollback=True), True),
        (spec("v1"), spec("v2"), False),
    ],
    ids=["replicas", "update-strategy", "command"],
)
def test_runs_same_ignores_replicas_and_the_update_strategy(
    old: WorkloadSpec, new: WorkloadSpec, same: bool
) -> None:
    assert rollout.runs_same(old, new) is same


def test_new_revision_keeps_a_bounded_history_and_the_last_complete_as_stable() -> None:
    w = workload(spec("v2"), state=S.COMPLETE)
    for n in range(12):
        w = rollout.new_revision(w, spec(f"x{n}"), "admin/admin", NOW, "update")
    assert len(w.revisions) == 10
    assert w.revisions[-1].revision == w.generation == 14
    # None of those rollouts completed: the stable one is still the last that did.
    assert w.rollout.stable == 2


def test_rollback_spec_picks_the_previous_or_a_given_revision() -> None:
    w = workload(spec("v2", replicas=9))
    s, n = rollout.rollback_spec(w, 0)
    assert (n, s.command, s.replicas) == (1, ["run", "v1"], 9)
    with pytest.raises(Conflict, match=r"no revision 7 \(kept: 1, 2\)"):
        rollout.rollback_spec(w, 7)
    with pytest.raises(Invalid):
        rollout.rollback_spec(w, -1)


def test_update_strategy_with_both_bounds_zero_names_both_fields() -> None:
    msg = convert.spec_to_pb(spec())
    msg.update.max_surge = 0
    msg.update.max_unavailable = 0
    with pytest.raises(Invalid) as err:
        convert.spec_from_pb(msg)
    fields = [v.field for v in err.value.violations()]
    assert fields == ["spec.update.max_unavailable", "spec.update.max_surge"]


def test_update_strategy_round_trips_and_defaults_when_unset() -> None:
    s = spec(max_surge=3, max_unavailable=2, min_ready_seconds=5, auto_rollback=True, canary=1)
    assert convert.spec_from_pb(convert.spec_to_pb(s)).update == s.update
    bare = convert.spec_to_pb(spec())
    bare.ClearField("update")
    assert convert.spec_from_pb(bare).update == UpdateStrategy()
    partial = pb.UpdateStrategy(max_unavailable=1)
    bare.update.CopyFrom(partial)
    got = convert.spec_from_pb(bare).update
    assert (got.max_unavailable, got.max_surge, got.progress_deadline_seconds) == (1, 1, 600)


def test_the_current_revision_holds_no_copy_and_big_specs_are_bounded_by_bytes() -> None:
    w = rollout.first_revision(Workload(spec=spec("v1")), "admin/admin")
    assert w.revisions[0].spec is None and w.revision(1).spec == w.spec  # type: ignore[union-attr]
    big = "x" * (100 << 10)  # three earlier specs of 100 KiB pass MAX_REVISION_BYTES
    for n in range(4):  # revisions 2-5: 2-4 hold 300 KiB, so 1 and 2 go
        w = rollout.new_revision(w, spec(f"{big}{n}"), "admin/admin", NOW, "update")
    assert [r.revision for r in w.revisions] == [3, 4, 5]
    assert [r.spec is None for r in w.revisions] == [False, False, True]
    assert w.revision(5).spec == w.spec  # type: ignore[union-attr]
    assert rollout.rollback_spec(w, 0)[0].command == ["run", f"{big}2"]


def test_a_rollback_that_fails_stays_failed_and_adopted_restarts_do_not_count() -> None:
    w = workload(spec(auto_rollback=True), rollback_of=3, started_at=NOW - 10)
    adopted = inst(2, restarts=4, created_at=NOW - 5000)  # restarted long before it
    out = run(w, [adopted, *(inst(1) for _ in range(5))])
    assert out.workload.rollout.state is S.PROGRESSING
    fresh_fail = inst(2, P.FAILED, created_at=NOW - 1)
    out = run(w, [adopted, fresh_fail, *(inst(1) for _ in range(5))])
    assert out.workload.rollout.state is S.FAILED
    assert out.workload.generation == 2  # no rollback of the rollback


@pytest.mark.parametrize(
    ("kind", "stops", "adds"),
    [
        # A VM's disk serves one VM: the old replica stops first, its successor comes with it.
        (WorkloadKind.VM, [0], 1),
        # ext4 volumes are shared on their node: the default surge stays (new one first).
        (WorkloadKind.PROCESS, [], 1),
    ],
)
def test_a_vm_with_volumes_rolls_out_stop_first_whatever_its_surge(
    kind: WorkloadKind, stops: list[int], adds: int
) -> None:
    fields: dict[str, Any] = {"volume_template": VolumeTemplate(name="disk", size_bytes=1 << 20)}
    if kind is WorkloadKind.VM:
        fields |= {"kind": kind, "command": [], "image": "/images/vm.qcow2"}
    s = spec(replicas=3).model_copy(update=fields)
    w = workload(s)
    insts = [inst(1, P.RUNNING) for _ in range(3)]
    stopped, added = moves(run(w, insts), insts)
    assert (stopped, added) == ([insts[i].name for i in stops], adds)


# ---- the bounds at their edges (each case fails if one comparison or count is off by one) ----

EDGE_CASES = [
    # Two unready old ones may go with max_unavailable 2; the ready ones stay.
    (
        "two-unready-within-budget",
        {"max_surge": 0, "max_unavailable": 2},
        [(1, P.RUNNING)] * 3 + [(1, P.STARTING)] * 3,
        [3, 4],
        2,
    ),
    # A new instance still starting counts against the budget; a ready one does not.
    (
        "new-starting-counts",
        {"max_surge": 0, "max_unavailable": 2},
        [(1, P.RUNNING)] * 2 + [(1, P.STARTING)] * 2 + [(2, P.RUNNING), (2, P.STARTING)],
        [2],
        1,
    ),
    # Canary 2 of 6: only two old ones make room, however large the budget (unready ones).
    (
        "canary-unready-surplus",
        {"max_surge": 0, "max_unavailable": 4, "canary": 2},
        [(1, P.STARTING)] * 6,
        [0, 1],
        2,
    ),
    # The same with ready ones, however many may be unavailable.
    (
        "canary-ready-surplus",
        {"max_surge": 0, "max_unavailable": 4, "canary": 2},
        [(1, P.RUNNING)] * 6,
        [0, 1],
        2,
    ),
    # Every new instance exists: an outdated one not yet placed is stopped, not relabelled.
    ("pending-old-when-new-are-enough", {}, [(2, P.RUNNING)] * 6 + [(1, P.PENDING)], [6], 0),
    # A surge larger than what is missing adds only what is missing.
    (
        "big-surge-adds-the-missing",
        {"max_surge": 6},
        [(1, P.RUNNING)] * 3 + [(2, P.RUNNING)] * 3,
        [],
        3,
    ),
]


@pytest.mark.parametrize(
    ("bounds", "layout", "stops", "adds"),
    [c[1:] for c in EDGE_CASES],
    ids=[c[0] for c in EDGE_CASES],
)
def test_one_pass_moves_within_the_bounds_at_their_edges(
    bounds: dict[str, int], layout: list[tuple[int, InstancePhase]], stops: list[int], adds: int
) -> None:
    test_one_pass_moves_within_the_bounds(bounds, layout, stops, adds)


def test_the_oldest_unready_outdated_instance_stops_first_and_is_told_why_and_when() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1))
    ready = [inst(1) for _ in range(4)]
    young, old = inst(1, P.STARTING, created_at=200.0), inst(1, P.STARTING, created_at=100.0)
    insts = [*ready, young, old]
    before = time.time()
    out = run(w, insts)
    after = time.time()
    assert moves(out, insts) == ([old.name], 1)
    (stopped,) = [i for i in out.puts if i.desired_stop]
    assert stopped.message == "replaced by revision 2"
    assert before <= stopped.updated_at <= after


# ---- the rollout's state ----


def test_progress_is_a_change_in_new_instances_not_their_absence() -> None:
    w = workload(spec(), deadline=NOW + 5)
    # One new instance appeared (none ready yet): progress, the deadline moves on.
    moved = run(w, [*(inst(1) for _ in range(6)), inst(2, P.STARTING)]).workload.rollout
    assert (moved.progress_at, moved.deadline) == (NOW, NOW + 600)
    # The new instances are gone (counts differ from the stored ones, but are 0, 0): none.
    w = w.model_copy(update={"status": WorkloadStatus(updated=2, ready=1)})
    held = run(w, [inst(1) for _ in range(6)]).workload.rollout
    assert (held.progress_at, held.deadline) == (NOW - 1, NOW + 5)


def test_the_deadline_itself_is_not_past_it() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1), deadline=NOW)
    w = w.model_copy(update={"status": WorkloadStatus(updated=1, ready=0)})
    insts = [*(inst(1) for _ in range(5)), inst(2, P.STARTING)]
    assert run(w, insts).workload.rollout.state is S.PROGRESSING


def test_each_step_is_stamped_and_logged() -> None:
    long = "x" * 300
    with capture_logs() as logs:
        failed = run(workload(spec()), [inst(1), inst(2, P.FAILED, message=long)]).workload
    assert failed.rollout.state is S.FAILED and failed.rollout.progress_at == NOW
    (entry,) = [e for e in logs if e["event"] == "rollout step"]
    assert entry == {
        "event": "rollout step",
        "log_level": "info",
        "workload": "web",
        "revision": 2,
        "state": "FAILED",
        "message": failed.rollout.message[:200],
    }
    assert len(failed.rollout.message) > 200  # the log line is cut, the record is not
    canary = run(workload(spec(replicas=4, canary=1)), [*(inst(1) for _ in range(3)), inst(2)])
    assert canary.workload.rollout.progress_at == NOW
    assert canary.workload.rollout.message == "1 canary instance(s) ready"
    stalled = workload(spec(max_surge=0, max_unavailable=1), deadline=NOW - 1)
    insts = [*(inst(1) for _ in range(5)), inst(2, P.STARTING)]
    stalled = stalled.model_copy(update={"status": WorkloadStatus(updated=1, ready=0)})
    assert run(stalled, insts).workload.rollout.progress_at == NOW


@pytest.mark.parametrize(
    ("rollback_of", "final", "message"),
    [(0, S.COMPLETE, ""), (2, S.ROLLED_BACK, "rolled back from revision 2")],
    ids=["update", "rollback"],
)
def test_completion_says_what_completed(
    rollback_of: int, final: RolloutState, message: str
) -> None:
    w = workload(spec(replicas=2), rollback_of=rollback_of)
    done = run(w, [inst(2), inst(2)]).workload.rollout
    assert (done.state, done.message, done.progress_at) == (final, message, NOW)


@pytest.mark.parametrize(
    ("state", "stable"),
    [(S.COMPLETE, 1), (S.FAILED, 0), (S.PROGRESSING, 0)],
    ids=["done-before", "failed-before", "under-way-before"],
)
def test_a_record_from_before_rollouts_were_kept_starts_one_now(
    state: RolloutState, stable: int
) -> None:
    # Its rollout names revision 1 while the workload is at 2: the stable revision is 1 if
    # that one had finished, else whatever it called stable (0 here).
    w = workload(spec(), state=state, stable=0)
    w = w.model_copy(update={"rollout": w.rollout.model_copy(update={"revision": 1})})
    r = run(w, [inst(1) for _ in range(6)]).workload.rollout
    assert (r.state, r.revision, r.stable, r.rollback_of, r.message) == (
        S.PROGRESSING,
        2,
        stable,
        0,
        "",
    )
    assert (r.started_at, r.progress_at, r.deadline) == (NOW, NOW, NOW + 600)


# ---- revisions ----


def test_first_revision_is_made_when_the_workload_is_and_by_whom() -> None:
    w = Workload(spec=spec("v1"), created_at=123.0)
    first = rollout.first_revision(w, "admin/alice")
    (rev,) = first.revisions
    assert (rev.revision, rev.created_at, rev.created_by) == (1, 123.0, "admin/alice")
    r = first.rollout
    assert (r.state, r.revision, r.stable, r.rollback_of, r.message) == (
        S.PROGRESSING,
        1,
        0,
        0,
        "",
    )
    assert (r.started_at, r.progress_at, r.deadline) == (123.0, 123.0, 123.0 + 600)
    # Nothing to roll out with no replicas: complete as it is made.
    empty = rollout.first_revision(Workload(spec=spec("v1", replicas=0)), "admin/alice")
    assert empty.rollout.state is S.COMPLETE


def test_new_revision_records_who_when_and_a_new_etag() -> None:
    w = workload(spec("v2"), state=S.COMPLETE)
    w = w.model_copy(update={"etag": "before"})
    moved = rollout.new_revision(w, spec("v3"), "admin/bob", NOW + 7, "update")
    rev = moved.revisions[-1]
    assert (rev.revision, rev.created_at, rev.created_by, rev.cause) == (
        3,
        NOW + 7,
        "admin/bob",
        "update",
    )
    assert (moved.updated_at, moved.updated_by) == (NOW + 7, "admin/bob")
    assert moved.etag not in ("", "before")
    r = moved.rollout
    assert (r.revision, r.stable, r.rollback_of, r.message) == (3, 2, 0, "")


def _padded(size: int, name: str) -> WorkloadSpec:
    """A spec whose JSON is exactly `size` bytes (two arguments, each within exec's limit)."""
    base = spec(name).model_copy(update={"command": ["run", "", ""]})
    pad = size - len(base.model_dump_json())
    half = pad // 2
    s = spec(name).model_copy(update={"command": ["run", "p" * half, "q" * (pad - half)]})
    assert len(s.model_dump_json()) == size
    return s


@pytest.mark.parametrize(("extra", "kept"), [(0, [1, 2, 3]), (1, [2, 3])], ids=["at", "over"])
def test_earlier_specs_up_to_the_byte_bound_are_kept(extra: int, kept: list[int]) -> None:
    first = _padded(100_000, "a")
    w = rollout.first_revision(Workload(spec=first), "admin/admin")
    w = rollout.new_revision(w, _padded(MAX_REVISION_BYTES - 100_000 + extra, "b"), "a", NOW, "u")
    w = rollout.new_revision(w, spec("c"), "admin/admin", NOW, "update")
    assert [r.revision for r in w.revisions] == kept


def test_an_earlier_spec_alone_past_the_byte_bound_is_dropped() -> None:
    w = rollout.first_revision(Workload(spec=_padded(MAX_REVISION_BYTES + 1, "a")), "admin/admin")
    w = rollout.new_revision(w, spec("b"), "admin/admin", NOW, "update")
    assert [r.revision for r in w.revisions] == [2]


# ---- rolling back ----


def test_auto_rollback_keeps_todays_replicas_and_stops_what_it_does_not_adopt() -> None:
    w = workload(spec(max_surge=0, max_unavailable=1, auto_rollback=True))
    # Revision 1 ran 3 replicas; the workload was scaled to 6 since.
    one = w.revisions[0].model_copy(
        update={"spec": w.revisions[0].spec.model_copy(update={"replicas": 3})}  # type: ignore[union-attr]
    )
    w = w.model_copy(update={"revisions": [one, w.revisions[1]]})
    olds = [inst(1) for _ in range(5)]
    bad = inst(2, P.FAILED, message="exit code 3 " + "e" * 600)
    good = inst(2)  # of the failed revision, running: not adopted, replaced
    before = time.time()
    out = run(w, [*olds, bad, good])
    back = out.workload
    assert (back.generation, back.spec.command, back.spec.replicas) == (3, ["run", "v1"], 6)
    assert back.rollout.message == "rolling back"
    rev = back.revisions[-1]
    assert rev.created_by == "controller"
    assert rev.cause.startswith("automatic rollback to revision 1: ") and len(rev.cause) == 500
    adopted = [i for i in out.puts if i.generation == 3 and not i.desired_stop and i.node]
    assert sorted(i.name for i in adopted) == sorted(o.name for o in olds)
    assert all(i.updated_at >= before for i in adopted)
    stopped = [i for i in out.puts if i.desired_stop]
    assert [(i.name, i.message) for i in stopped] == [(good.name, "replaced by revision 3")]
    assert len([i for i in out.puts if i.name.startswith("web-new")]) == 1


def test_no_rollback_to_the_failing_revision_itself() -> None:
    w = workload(spec(auto_rollback=True), stable=2)
    out = run(w, [inst(1), inst(2, P.FAILED)])
    assert (out.workload.generation, out.workload.rollout.state) == (2, S.FAILED)


def test_adopt_takes_only_live_instances_of_revisions_that_run_the_same() -> None:
    w = workload(spec("v2"))
    same = w.revisions[1].spec.model_copy(update={"replicas": 2})  # type: ignore[union-attr]
    w = w.model_copy(
        update={
            "revisions": [
                Revision(revision=1, spec=spec("v1")),
                Revision(revision=2, spec=same),
                Revision(revision=3),
            ],
            "generation": 3,
        }
    )
    keep = inst(2)
    others = [
        inst(1),  # a revision that runs differently
        inst(2, P.FAILED),  # finished
        inst(2).model_copy(update={"desired_stop": True}),  # on its way out
        inst(3),  # already of this revision
    ]
    adopted = rollout.adopt(w, [keep, *others])
    assert [(i.name, i.generation) for i in adopted] == [(keep.name, 3)]


def test_rollback_spec_takes_todays_replicas_and_says_what_is_missing() -> None:
    w = workload(spec("v2", replicas=9))
    one = w.revisions[0].model_copy(
        update={"spec": w.revisions[0].spec.model_copy(update={"replicas": 2})}  # type: ignore[union-attr]
    )
    w = w.model_copy(update={"revisions": [one, w.revisions[1]]})
    s, n = rollout.rollback_spec(w, 1)
    assert (n, s.command, s.replicas) == (1, ["run", "v1"], 9)
    alone = rollout.first_revision(Workload(spec=spec("v1")), "admin/admin")
    with pytest.raises(Conflict, match="'web' has no earlier revision to return to"):
        rollout.rollback_spec(alone, 0)
    with pytest.raises(Conflict, match=r"'web' has no revision 4 \(kept: none\)"):
        rollout.rollback_spec(Workload(spec=spec()), 4)
    with pytest.raises(Invalid) as err:
        rollout.rollback_spec(w, -2)
    assert [(v.field, v.description) for v in err.value.violations()] == [
        ("revision", "must be >= 0, got -2")
    ]


def test_the_node_loss_policy_runs_the_same() -> None:
    waits = spec().model_copy(update={"on_node_lost": OnNodeLost.WAIT, "max_disconnect": 30.0})
    assert rollout.runs_same(spec(), waits) is True
    assert rollout.runs_same(waits, spec()) is True


# ---- what users ask ----


def test_pause_and_resume_say_so_and_keep_a_promotion() -> None:
    w = workload(spec(), promoted=True).model_copy(update={"updated_at": 0.0})
    paused = rollout.pause(w, NOW)
    assert (paused.rollout.state, paused.rollout.message) == (S.PAUSED, "paused")
    assert paused.updated_at > 0
    resumed = rollout.resume(paused, NOW + 50)
    r = resumed.rollout
    assert (r.state, r.message, r.promoted, r.progress_at) == (S.PROGRESSING, "", True, NOW + 50)
    failed = workload(spec(), state=S.FAILED, message="no progress for 600s")
    again = rollout.resume(failed, NOW).rollout
    assert (again.state, again.message, again.promoted) == (S.PROGRESSING, "", False)
    with pytest.raises(
        Conflict, match="only a PAUSED or FAILED rollout can be resumed; it is COMPLETE"
    ):
        rollout.resume(workload(spec(), state=S.COMPLETE), NOW)
