"""A workload's tally, moved record by record, reads the same as the records counted afresh
and as a plain look at each record (the per-instance rules are the reference)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orka.controller.tally import Tally, active, age, failing, is_ready, ready_in
from orka.models import HealthState, Instance, InstancePhase

NOW = 1_000_000_000.123
STARTED = 50.0  # when the rollout the failures are read for began

# Offsets from NOW that land on and around the ready edge of each min_ready below: NOW - 0.1
# is not exactly 0.1 before NOW in floats, which is where a search by value alone miscounts.
OFFSETS = [0.0, 0.1, 0.3, 5.0, 10.0, -1.0, 0.1 + 1e-9, 0.3 - 1e-9, 2.5]
MIN_READY = [0.0, 0.1, 0.3, 5.0]


@st.composite
def instances(draw: st.DrawFn) -> Instance:
    def moment() -> float | None:
        return draw(st.one_of(st.none(), st.sampled_from(OFFSETS).map(lambda d: NOW - d)))

    return Instance(
        name=draw(st.sampled_from("abcdef")),
        workload="web",
        generation=draw(st.sampled_from([1, 2])),
        node=draw(st.sampled_from(["", "n1", "n2"])),
        phase=draw(st.sampled_from(list(InstancePhase))),
        message=draw(st.sampled_from(["", "no node fits", "cordoned"])),
        restarts=draw(st.sampled_from([0, 0, 1])),
        desired_stop=draw(st.booleans()),
        replaced_by=draw(st.sampled_from(["", "", "x"])),
        created_at=draw(st.sampled_from([10.0, 50.0, 60.0])),
        started_at=moment(),
        health=draw(st.sampled_from(list(HealthState))),
        health_changed_at=moment(),
        health_message=draw(st.sampled_from(["", "refused"])),
    )


def readings(t: Tally, min_ready: float) -> dict[str, Any]:
    return {
        "size": t.size,
        "all_of": (t.all_of(1), t.all_of(2)),
        "on": (t.on_any(["n1"]), t.on_any(["n2", "n3"]), t.on_any([])),
        "counts": (t.placed, t.running, t.healthy),
        "updated": (t.updated(1), t.updated(2), t.outdated(1), t.outdated(2)),
        "ready": (t.ready(min_ready, NOW), t.ready(min_ready, NOW, 1), t.ready(min_ready, NOW, 2)),
        "wake_in": t.wake_in(min_ready, NOW),
        "failure": (t.failure(1, STARTED), t.failure(2, STARTED)),
        "unplaced": [i.name for i in t.unplaced_oldest_first()],
    }


def reference(insts: list[Instance], min_ready: float) -> dict[str, Any]:
    """The same readings, one look at each record."""
    live = [i for i in insts if active(i)]
    unsettled = {
        InstancePhase.SUCCEEDED,
        InstancePhase.FAILED,
        InstancePhase.STOPPED,
        InstancePhase.LOST,
        InstancePhase.DISCONNECTED,
    }
    troubled = any(i.phase in unsettled or i.desired_stop or i.replaced_by for i in insts)

    def all_of(g: int) -> bool:
        return not troubled and all(i.generation == g for i in insts)

    def ready(g: int | None) -> int:
        return sum(is_ready(i, min_ready, NOW) for i in live if g is None or i.generation == g)

    def failure(g: int) -> str:
        shown = [i for i in insts if i.generation == g and i.created_at >= STARTED and failing(i)]
        return failing(min(shown, key=age)) if shown else ""

    waits = [w for w in (ready_in(i, min_ready, NOW) for i in live) if w is not None]
    unplaced = [i for i in live if i.phase is InstancePhase.PENDING and i.message]
    nodes = {i.node for i in insts if i.node}
    return {
        "size": len(insts),
        "all_of": (all_of(1), all_of(2)),
        "on": ("n1" in nodes, bool(nodes & {"n2", "n3"}), False),
        "counts": (
            sum(bool(i.node) for i in live),
            sum(i.phase is InstancePhase.RUNNING for i in live),
            sum(i.phase is InstancePhase.RUNNING and i.health is HealthState.HEALTHY for i in live),
        ),
        "updated": (
            sum(i.generation == 1 for i in live),
            sum(i.generation == 2 for i in live),
            sum(i.generation != 1 for i in live),
            sum(i.generation != 2 for i in live),
        ),
        "ready": (ready(None), ready(1), ready(2)),
        "wake_in": min(waits, default=None),
        "failure": (failure(1), failure(2)),
        "unplaced": [i.name for i in sorted(unplaced, key=age)],
    }


@settings(max_examples=300, deadline=None)
@given(
    writes=st.lists(st.one_of(instances(), st.sampled_from("abcdef")), max_size=40),
    min_ready=st.sampled_from(MIN_READY),
)
def test_a_tally_moved_write_by_write_reads_as_the_records_counted_afresh(
    writes: list[Instance | str], min_ready: float
) -> None:
    """Each write replaces the record of its name (a name alone deletes it); after every one,
    the moved tally, a fresh count and the plain look all read the same."""
    records: dict[str, Instance] = {}
    moved = Tally()
    for write in writes:
        name = write if isinstance(write, str) else write.name
        old = records.pop(name, None)
        if old is not None:
            moved.remove(old)
        if isinstance(write, Instance):
            records[name] = write
            moved.add(write)
        expected = reference(list(records.values()), min_ready)
        assert readings(moved, min_ready) == expected
        assert readings(Tally.of(records.values()), min_ready) == expected
        assert moved == Tally.of(records.values())
    # Emptied again, nothing is left over: no key of a count at zero lingers.
    for inst in records.values():
        moved.remove(inst)
    assert (moved.size, moved.generations, moved.nodes, moved.active, moved.since) == (
        0,
        {},
        {},
        {},
        {},
    )
    assert (moved.troubled, moved.failing, moved.unplaced) == (set(), {}, {})


def test_the_ready_count_follows_the_rule_where_float_rounding_moves_the_edge() -> None:
    """0.1 s after `since` is not `now - 0.1` in floats; the count is the rule's own."""
    since = [NOW - 0.1, NOW - 0.1 - 1e-9, NOW - 0.3, NOW]
    insts = [
        Instance(
            name=f"i{k}",
            workload="web",
            phase=InstancePhase.RUNNING,
            health=HealthState.HEALTHY,
            started_at=s,
        )
        for k, s in enumerate(since)
    ]
    t = Tally.of(insts)
    for min_ready in (0.0, 0.1, 0.3, 1.0):
        assert t.ready(min_ready, NOW) == sum(is_ready(i, min_ready, NOW) for i in insts)
        left = [ready_in(i, min_ready, NOW) for i in insts]
        assert t.wake_in(min_ready, NOW) == min((x for x in left if x is not None), default=None)
    assert t.ready(0.1, NOW) == sum(NOW - s >= 0.1 for s in since)


def running(name: str, since: float | None, **kw: Any) -> Instance:
    kw.setdefault("health", HealthState.HEALTHY)
    return Instance(name=name, workload="web", phase=InstancePhase.RUNNING, started_at=since, **kw)


def test_ready_and_its_wait_count_by_the_rule_on_both_sides_of_a_rounded_edge() -> None:
    """At 3.3 s, `now - min_ready` rounds below the exact edge for 2.9 and 0.7: the values just
    above it are ready (2.9) or no longer waiting (0.7) by the rule itself, and are counted so;
    an instance that never reported a start counts from 0."""
    now = 3.3
    for min_ready in (2.9, 0.7, 0.0):
        edge = now - min_ready
        since = [edge, math.nextafter(edge, math.inf), math.nextafter(edge, -math.inf), now, 0.1]
        insts = [running(f"i{k}", s) for k, s in enumerate(since)] + [running("never", None)]
        t = Tally.of(insts)
        values = [*since, 0.0]
        assert t.ready(min_ready, now) == sum(now - s >= min_ready for s in values), min_ready
        left = [s + min_ready - now for s in values]
        assert t.wake_in(min_ready, now) == min((x for x in left if x > 0), default=None)
    # Written out: both values past the rounded edge of 2.9 are ready, the start-less one too.
    t = Tally.of([running("a", math.nextafter(now - 2.9, math.inf)), running("b", None)])
    assert t.ready(2.9, now) == 2
    assert Tally.of([running("a", now)]).ready(0.0, now) == 1  # ready from its first moment
    # And the other way: at NOW, `NOW - 0.3` rounds to a value that is not yet 0.3 s old by
    # the rule, so of it and an older one, only the older is ready.
    edge = NOW - 0.3
    assert NOW - edge < 0.3
    t = Tally.of([running("a", edge), running("b", edge - 1.0)])
    assert t.ready(0.3, NOW) == 1


def test_a_failing_revision_is_named_by_its_oldest_failing_instance() -> None:
    def failed(name: str, created_at: float, **kw: Any) -> Instance:
        return Instance(name=name, workload="web", created_at=created_at, **kw)

    t = Tally.of(
        [
            failed("c", 70.0, phase=InstancePhase.RUNNING, restarts=2, message="exit code 3"),
            failed("b", 60.0, phase=InstancePhase.FAILED, reason="Error"),
            failed("a", 40.0, phase=InstancePhase.FAILED),  # before the rollout began
            running("d", 1.0, created_at=80.0, health=HealthState.UNHEALTHY),
        ]
    )
    assert t.failure(1, since=STARTED) == "instance b failed: Error"
    assert t.failure(1, since=65.0) == "instance c restarted 2 time(s): exit code 3"
    assert t.failure(1, since=75.0) == "instance d is unhealthy: check failed"
    assert t.failure(1, since=90.0) == t.failure(2, since=0.0) == ""
    assert failing(failed("e", 1.0, phase=InstancePhase.FAILED)) == (
        "instance e failed: no reason given"
    )
    assert failing(failed("f", 1.0, restarts=1)) == "instance f restarted 1 time(s)"
