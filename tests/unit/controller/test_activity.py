"""The activity recorder: bounds per object and in total (LRU), folding of repeats, and what
the repo's writes record by themselves."""

from __future__ import annotations

from orka import fit
from orka.controller.activity import NORMAL, WARNING, ActivityLog, placed_text
from orka.controller.repo import Change
from orka.models import (
    HealthState,
    Instance,
    InstancePhase,
    Node,
    NodeState,
    Revision,
    Rollout,
    RolloutState,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def test_repeats_fold_into_one_entry_with_a_count_and_move_to_newest() -> None:
    clock = Clock()
    log = ActivityLog(clock=clock)
    log.record("instance", "a", WARNING, "FailedScheduling", "no node took it: 2 nodes: x")
    log.record("instance", "a", NORMAL, "Other", "in between")
    log.record("instance", "a", WARNING, "FailedScheduling", "no node took it: 2 nodes: x")
    entries = log.entries("instance", "a")
    assert [(e.reason, e.count) for e in entries] == [("FailedScheduling", 2), ("Other", 1)]
    assert entries[0].first_time == 1001.0 and entries[0].last_time == 1003.0
    # Another message is another entry.
    log.record("instance", "a", WARNING, "FailedScheduling", "no node took it: 3 nodes: x")
    assert len(log.entries("instance", "a")) == 3


def test_each_object_keeps_only_its_latest_entries() -> None:
    log = ActivityLog(per_object=3)
    for n in range(10):
        log.record("node", "n1", NORMAL, "R", f"m{n}")
    assert [e.message for e in log.entries("node", "n1")] == ["m9", "m8", "m7"]


def test_the_least_recently_written_objects_are_dropped_past_the_total() -> None:
    log = ActivityLog(per_object=2, max_objects=3)
    for name in ("a", "b", "c"):
        log.record("instance", name, NORMAL, "R", "x")
    log.record("instance", "a", NORMAL, "R", "again")  # a is now the most recent
    log.record("instance", "d", NORMAL, "R", "x")
    assert log.objects == 3
    assert log.entries("instance", "b") == []
    assert [e.message for e in log.entries("instance", "a")] == ["again", "x"]
    for n in range(1000):
        log.record("instance", f"i{n}", NORMAL, "R", "x")
        log.record("instance", f"i{n}", NORMAL, "R", "y")
        log.record("instance", f"i{n}", NORMAL, "R", "z")
    assert log.objects == 3 and len(log) == 6


def inst(**kw: object) -> Instance:
    base: dict[str, object] = {"name": "web-1", "workload": "web", "node": "n1"}
    base.update(kw)
    return Instance(**base)  # type: ignore[arg-type]


Record = Instance | Node | Workload


def write(log: ActivityLog, old: Record | None, new: Record | None) -> None:
    value = new if new is not None else old
    assert value is not None
    kind = {Instance: "instances", Node: "nodes", Workload: "workloads"}[type(value)]
    log.on_change(Change(kind, value.name, new), old)  # type: ignore[arg-type]


def test_restarts_record_the_exit_code_once_per_restart_folded() -> None:
    log = ActivityLog()
    running = inst(phase=InstancePhase.RUNNING)
    once = running.model_copy(update={"restarts": 1, "exit_code": 3, "message": "exit 3 at t1"})
    twice = once.model_copy(update={"restarts": 2, "message": "exit 3 at t2"})
    write(log, running, once)
    write(log, once, twice)
    write(log, twice, twice.model_copy(update={"address": "10.0.0.2"}))  # nothing to say
    (entry,) = log.entries("instance", "web-1")
    assert (entry.type, entry.reason, entry.count) == (WARNING, "Restarted", 2)
    assert "exited with code 3" in entry.message


def test_phase_and_health_changes() -> None:
    log = ActivityLog()
    pending = inst(phase=InstancePhase.PENDING, node="")
    scheduled = pending.scheduled("n1", 1.0)
    running = scheduled.model_copy(update={"phase": InstancePhase.RUNNING})
    sick = running.model_copy(
        update={"health": HealthState.UNHEALTHY, "health_message": "GET / -> 500"}
    )
    well = sick.model_copy(update={"health": HealthState.HEALTHY})
    failed = well.model_copy(update={"phase": InstancePhase.FAILED, "exit_code": 7})
    for old, new in [(None, pending), (pending, scheduled), (scheduled, running)]:
        write(log, old, new)
    for old, new in [(running, sick), (sick, well), (well, failed)]:
        write(log, old, new)
    got = [(e.reason, e.message) for e in reversed(log.entries("instance", "web-1"))]
    assert got == [
        ("Started", "running on node n1"),
        ("Unhealthy", "GET / -> 500"),
        ("Healthy", "health check passing again"),
        ("Failed", "exited with code 7; failed"),
    ]
    write(log, failed, None)
    assert log.entries("instance", "web-1") == []


def test_node_states_and_cordon() -> None:
    log = ActivityLog()
    ready = Node(name="n1", state=NodeState.READY)
    write(log, None, ready)
    late = ready.model_copy(update={"state": NodeState.NOT_READY})
    write(log, ready, late)
    cordoned = late.model_copy(update={"schedulable": False})
    write(log, late, cordoned)
    got = [(e.type, e.reason) for e in reversed(log.entries("node", "n1"))]
    assert got == [
        (NORMAL, "Registered"),
        (WARNING, "NodeNotReady"),
        (NORMAL, "Cordoned"),
    ]


def test_rollout_steps_are_recorded_once_each() -> None:
    log = ActivityLog()
    spec = WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["sleep", "9"])
    w1 = Workload(spec=spec)
    write(log, None, w1)

    def at(w: Workload, generation: int, **rollout: object) -> Workload:
        return w.model_copy(update={"generation": generation, "rollout": Rollout(**rollout)})

    w2a = at(w1, 2, state=RolloutState.PROGRESSING, revision=2, stable=1)
    # Changed again mid-rollout: another revision, the same state.
    w2 = at(w2a, 3, state=RolloutState.PROGRESSING, revision=3, stable=1)
    w2b = w2.model_copy(update={"updated_at": w2.updated_at + 1})  # a status write: no step
    w2f = at(w2, 3, state=RolloutState.FAILED, revision=3, stable=1, message="web-7 exited")
    w3 = at(w2f, 4, state=RolloutState.PROGRESSING, revision=4, stable=1, rollback_of=3)
    w3.revisions = [Revision(revision=4, cause="automatic rollback to revision 2: web-7 exited")]
    w3c = at(w3, 4, state=RolloutState.ROLLED_BACK, revision=4, stable=4, rollback_of=3)
    for old, new in [(w1, w2a), (w2a, w2), (w2, w2b), (w2b, w2f), (w2f, w3), (w3, w3c)]:
        write(log, old, new)
    got = [(e.type, e.reason, e.message) for e in reversed(log.entries("workload", "web"))]
    assert [g for g in got if g[1].startswith("Roll")] == [
        (NORMAL, "RolloutProgressing", "revision 2: progressing"),
        (NORMAL, "RolloutProgressing", "revision 3: progressing"),
        (WARNING, "RolloutFailed", "revision 3: failed: web-7 exited"),
        (
            WARNING,
            "RollingBack",
            "revision 3 failed; revision 4 rolls back: automatic rollback to revision 2:"
            " web-7 exited",
        ),
        (WARNING, "RolledBack", "revision 4: rolled back"),
    ]


def test_placed_text_names_the_node_and_why_others_were_passed_over() -> None:
    counts = [
        fit.ReasonCount("INSUFFICIENT_MEMORY", "insufficient memory", 2, True),
        fit.ReasonCount("CORDONED", "cordoned", 1, True),
    ]
    assert placed_text("node-2", counts, {"node-1": "image missing"}) == (
        "placed on node-2; 3 nodes passed over: 2 nodes: insufficient memory; 1 node: cordoned;"
        " refused the offer: node-1: image missing"
    )
    assert placed_text("node-2", [], {}) == "placed on node-2"
