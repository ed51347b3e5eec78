"""The reconciler's scheduling loop: which workloads a pass plans (incremental and full passes),
the commands a pass sends, the wake-ups after a backoff, and the small helpers the loop uses."""

from __future__ import annotations

import asyncio
import re
import time
import types
from typing import Any

import pytest

from orka.controller import reconciler as rmod
from orka.controller import rollout
from orka.controller.commands import stop_command
from orka.controller.link import command_to_pb
from orka.controller.reconciler import (
    RESEND_AFTER,
    CrashBackoff,
    _node_changed,
    _stop,
    new_instance,
)
from orka.controller.repo import Change
from orka.controller.tally import Tally
from orka.models import (
    HealthState,
    InstanceReason,
    NodeState,
    Resources,
    RolloutState,
    WorkloadStatus,
)
from tests.unit.controller.test_reconciler import Env, P, env, inst, node, workload

__all__ = ["env"]  # the fixture, imported from the reconciler's planning tests


class FakeMonotonic:
    """Stands in for the reconciler module's `time` (monotonic only; wall time stays real)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float = 100.0) -> None:
        self.now = now
        monkeypatch.setattr(
            rmod, "time", types.SimpleNamespace(monotonic=lambda: self.now, time=time.time)
        )


def listen(env: Env) -> None:
    """What `run` does before its loop: passes become incremental."""
    env.repo.listeners.append(env.rec._on_change)
    env.rec._listening = True


async def quietly(env: Env, *objs: Any) -> None:
    """Write without the reconciler hearing of it (a change an incremental pass must skip)."""
    env.repo.listeners.remove(env.rec._on_change)
    try:
        await env.put(*objs)
    finally:
        env.repo.listeners.append(env.rec._on_change)


# ---- which workloads a pass plans ----


async def test_changes_name_the_workloads_to_plan_and_a_node_asks_for_a_full_pass(
    env: Env,
) -> None:
    listen(env)
    await env.put(workload("a"))
    assert env.rec._changed_workloads == {"a"}
    await env.put(inst("b-1", workload="b"))
    assert env.rec._changed_workloads == {"a", "b"}
    env.rec._changed_workloads = set()
    # A deleted instance names its workload through the old record.
    await env.repo.mutate(lambda: [Change("instances", "b-1", None)])
    assert env.rec._changed_workloads == {"b"}
    env.rec._full_due = False
    await env.put(node("n1"))
    assert env.rec._full_due is True
    assert env.rec._changed_workloads == {"b"}


async def test_next_scope_is_full_when_due_and_otherwise_the_changed_workloads(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeMonotonic(monkeypatch)
    rec = env.rec
    # Not listening: every pass is full.
    rec._changed_workloads = {"a"}
    assert rec._next_scope() is None
    assert rec._next_scope() is None
    listen(env)
    rec._full_due = True
    clock.now = 100.5
    assert rec._next_scope() is None  # due: the first pass after `run` starts
    assert rec._changed_workloads == set()
    await env.put(workload("a"))
    clock.now = 101.0
    assert rec._next_scope() == {"a"}
    assert rec._next_scope() == set()
    await env.put(workload("b"))
    assert rec._next_scope() == {"b"}
    # A node changed: full, even well within FULL_PASS_EVERY.
    await env.put(node("n1"))
    assert rec._next_scope() is None
    await env.put(workload("c"))
    assert rec._next_scope() == {"c"}
    # The cache was reloaded: full.
    env.repo.reloads += 1
    assert rec._next_scope() is None
    assert rec._next_scope() == set()
    # FULL_PASS_EVERY (2 s) after the last full pass, to the tick.
    clock.now = 102.99
    assert rec._next_scope() == set()
    clock.now = 103.0
    assert rec._next_scope() is None
    clock.now = 103.5
    assert rec._next_scope() == set()
    # Listening stopped: full again.
    rec._listening = False
    assert rec._next_scope() is None


async def test_an_incremental_pass_plans_and_commands_only_the_changed_workloads(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeMonotonic(monkeypatch)
    listen(env)
    await env.put(node("n1"), workload("a", replicas=1), workload("b", replicas=1))
    await env.rec.reconcile_once()  # full
    assert [i.phase for i in env.of("a")] == [P.PENDING]
    assert [i.phase for i in env.of("b")] == [P.PENDING]
    clock.now += 0.1
    await env.rec.reconcile_once()  # the first pass's own writes: nothing more to do
    # b changes unheard: its new replica count and a stop for its running instance wait for
    # the next full pass.
    b_run = inst("b-run", workload="b", desired_stop=True, message="scaled down")
    await quietly(env, workload("b", replicas=2), b_run)
    env.queue.pending.clear()
    (a_first,) = env.of("a")
    await env.put(workload("a", replicas=2))
    clock.now += 0.5
    await env.rec.reconcile_once()
    assert len(env.of("a")) == 2
    assert len(env.of("b")) == 2  # the pending one and b-run: nothing new
    assert env.link.commands == []
    # Queued: a's new instance; its first, unchanged, waits for a full pass like b's.
    assert list(env.queue.pending) == [i.name for i in env.of("a") if i != a_first]
    # The full pass catches up with b, and queues every pending instance.
    clock.now += 2.0
    await env.rec.reconcile_once()
    assert len(env.of("b")) == 3
    assert env.link.commands == [command_to_pb(stop_command("n1", "b-run", "scaled down"))]
    pending = [i for w in ("a", "b") for i in env.of(w) if i.phase is P.PENDING]
    assert sorted(env.queue.pending) == sorted(i.name for i in pending)


async def test_an_incremental_pass_queues_the_pending_instances_written_since_the_last(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever their workload, and even when the pass itself writes nothing (settled
    workloads); a workload's record changing does not look at its instances again."""
    clock = FakeMonotonic(monkeypatch)
    listen(env)
    await env.put(workload("a", replicas=1), workload("b", replicas=1))
    await env.rec.reconcile_once()
    clock.now += 0.1
    await env.rec.reconcile_once()  # the first pass's own writes
    (a1,) = env.of("a")
    (b1,) = env.of("b")
    env.queue.pending.clear()
    # Both touched (a label each, status kept), neither needs a write; b's instance too.
    await env.put(
        *(env.repo.workloads[n].model_copy(update={"labels": {"x": "1"}}) for n in ("a", "b")),
        b1.model_copy(update={"message": "1 node: cordoned"}),
    )
    clock.now += 0.5
    await env.rec.reconcile_once()
    assert list(env.queue.pending) == [b1.name]
    clock.now += 2.0
    await env.rec.reconcile_once()  # full
    assert sorted(env.queue.pending) == sorted([a1.name, b1.name])


async def test_a_pass_queues_only_pending_instances_not_being_stopped(env: Env) -> None:
    await env.put(
        node("n1"),
        workload("web", replicas=2),
        inst("web-run", P.RUNNING),
        inst("web-pend", P.PENDING),
        inst("web-stopping", P.PENDING, desired_stop=True),
    )
    await env.rec.reconcile_once()
    assert list(env.queue.pending) == ["web-pend"]


async def test_a_full_pass_forgets_the_commands_sent_for_deleted_instances(env: Env) -> None:
    await env.put(node("n1"), workload("web", replicas=0), inst("web-a", P.RUNNING))
    await env.rec.reconcile_once()
    assert env.link.commands == [command_to_pb(stop_command("n1", "web-a", "scaled down"))]
    assert list(env.rec._stops_sent) == ["web-a"]
    await env.set_inst("web-a", phase=P.STOPPED, finished_at=5.0)
    await env.rec.reconcile_once()
    await env.repo.mutate(lambda: [Change("instances", "web-a", None)])
    await env.rec.reconcile_once()
    assert env.rec._stops_sent == {}


async def test_a_failed_pass_makes_the_next_one_full_and_plan_stays_whole_after_a_pass(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeMonotonic(monkeypatch)
    listen(env)
    await env.rec.reconcile_once()
    clock.now += 0.5

    def broken() -> list[Change]:
        raise RuntimeError("boom")

    env.rec.plan = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"^boom$"):
        await env.rec.reconcile_once()
    assert env.rec._next_scope() is None
    del env.rec.plan
    # After a pass (incremental here) `plan` called on its own looks at every workload.
    await env.put(workload("a", replicas=1))
    await env.rec.reconcile_once()
    await quietly(env, workload("b", replicas=1))
    await env.plan()
    assert [i.phase for i in env.of("b")] == [P.PENDING]


# ---- forgetting a record removes what the node keeps of a finished task ----


async def test_a_forgotten_finished_instance_is_removed_from_its_ready_node(env: Env) -> None:
    await env.put(
        node("n1"),
        node("n2", state=NodeState.NOT_READY),
        workload("web", deleting=True),
        inst("web-done", P.SUCCEEDED, node="n1"),
        inst("web-away", P.FAILED, node="n2"),
        inst("web-gone", P.STOPPED, node="n9"),
        inst("web-unbound", P.PENDING),
        inst("web-bound", P.PENDING, node="n1"),
    )
    await env.rec.reconcile_once()
    assert env.repo.instances == {}
    assert env.link.commands == [command_to_pb(stop_command("n1", "web-done", "forgotten"))]


# ---- commands for tasks the controller did not bind ----


def test_cleanup_stops_an_unexpected_instance_once_per_resend_period(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeMonotonic(monkeypatch)
    rec = env.rec
    assert rec.cleanup("n1", "x", "not bound here") == stop_command("n1", "x", "not bound here")
    assert rec.cleanup("n1", "x", "not bound here") is None
    assert rec.cleanup("n1", "y", "why") == stop_command("n1", "y", "why")
    assert rec.cleanup("n2", "x", "why") == stop_command("n2", "x", "why")
    clock.now += RESEND_AFTER - 0.01
    assert rec.cleanup("n1", "x", "again") is None
    clock.now = 100.0 + RESEND_AFTER
    assert rec.cleanup("n1", "x", "again") == stop_command("n1", "x", "again")


# ---- waking a workload when its backoff ends ----


async def test_wake_at_plans_the_workload_no_sooner_than_the_delay(env: Env) -> None:
    loop = asyncio.get_running_loop()
    woken: list[float] = []
    wake = env.rec._wake

    def record(workload: str) -> None:
        woken.append(loop.time())
        wake(workload)

    env.rec._wake = record  # type: ignore[method-assign]
    start = loop.time()
    env.rec._wake_at("web", 0.2)
    await asyncio.wait_for(env.rec._dirty.wait(), 5.0)
    assert env.rec._changed_workloads == {"web"}
    assert len(woken) == 1
    assert 0.2 <= woken[0] - start < 0.5


async def test_wake_at_a_past_time_wakes_at_once(env: Env) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    env.rec._wake_at("web", -5.0)
    await asyncio.wait_for(env.rec._dirty.wait(), 5.0)
    assert loop.time() - start < 0.5
    assert env.rec._changed_workloads == {"web"}


# ---- helpers ----


@pytest.mark.parametrize(
    "change",
    [
        {"state": NodeState.NOT_READY},
        {"schedulable": False},
        {"draining": True},
        {"labels": {"zone": "b"}},
        {"drivers": ["process", "vm"]},
        {"capacity": Resources(cpu_millis=2000)},
        {"allocatable": Resources(cpu_millis=1000)},
    ],
)
def test_node_changed_by_each_field_alone(change: dict[str, Any]) -> None:
    old = node("n1", labels={"zone": "a"}, drivers=["process"])
    assert _node_changed(old, old.model_copy(update=change)) is True
    assert _node_changed(old, old.model_copy(update={"usage": Resources(cpu_millis=5)})) is False


def test_stop_marks_the_instance_and_its_update_time() -> None:
    before = time.time()
    stopped = _stop(inst("web-a", updated_at=1.0), InstanceReason.SCALED_DOWN)
    assert (stopped.desired_stop, stopped.message) == (True, "scaled down")
    assert before <= stopped.updated_at <= time.time()


def test_new_instance_is_named_after_its_workload_with_six_hex_digits() -> None:
    w = workload("web", generation=4)
    i = new_instance(w, 0, taken=())
    assert re.fullmatch(r"^web-[0-9a-f]{6}$", i.name)
    assert (i.workload, i.generation, i.phase) == ("web", 4, P.PENDING)


# ---- the workload's status ----


def test_status_shows_the_backoff_until_it_ends_and_stamps_the_update(env: Env) -> None:
    w = workload("web", replicas=1)
    insts = [inst("web-a", P.RUNNING)]
    env.rec.crashes["web"] = CrashBackoff(failures=2, not_before=50.0, last_error="exit code 1")
    waiting = env.rec._status_change(w, w, Tally.of(insts), 49.99)
    assert [(c.kind, c.name) for c in waiting] == [("workloads", "web")]
    assert waiting[0].value.updated_at == 49.99
    assert waiting[0].value.status == WorkloadStatus(
        desired=1,
        placed=1,
        running=1,
        healthy=1,
        updated=1,
        ready=1,
        message=(
            "2 instance failure(s) in a row (the last: exit code 1);"
            " replaced with backoff, up to 300s"
        ),
    )
    done = env.rec._status_change(w, w, Tally.of(insts), 50.0)
    assert done[0].value.status == WorkloadStatus(
        desired=1, placed=1, running=1, healthy=1, updated=1, ready=1
    )
    assert done[0].value.updated_at == 50.0


# What an agent reports of an instance that started, without a health check.
UP = {"phase": P.RUNNING, "health": HealthState.HEALTHY}


def counts(env: Env, name: str = "web") -> tuple[int, int, int, list[str]]:
    s = env.repo.workloads[name].status
    return s.placed, s.running, s.ready, s.unschedulable_reasons


async def test_status_counts_in_motion_are_written_at_most_once_a_period(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeMonotonic(monkeypatch)
    listen(env)
    await env.put(node("n1"), workload(replicas=3))
    await env.put(*(inst(f"web-{c}", P.SCHEDULED) for c in "abc"))
    await env.rec.reconcile_once()
    assert counts(env) == (3, 0, 0, [])
    # A count moves within STATUS_COUNTS_EVERY of the last write: held, its pass woken later.
    clock.now += 0.1
    await env.set_inst("web-a", **UP)
    env.rec._dirty.clear()
    loop = asyncio.get_running_loop()
    start = loop.time()
    await env.rec.reconcile_once()
    assert counts(env) == (3, 0, 0, [])
    assert env.rec._status_held == {"web"}
    # And while it is held.
    clock.now += 0.05
    await env.set_inst("web-b", **UP)
    await env.rec.reconcile_once()
    assert counts(env) == (3, 0, 0, [])
    await asyncio.wait_for(env.rec._dirty.wait(), 5.0)
    # Woken when the period ends (the rest of it, 0.15 s), not at once.
    assert loop.time() - start >= 0.15
    assert env.rec._status_held == set()
    assert env.rec._changed_workloads == {"web"}
    clock.now += 0.11  # the period's end, as the wake-up comes (a little after)
    await env.rec.reconcile_once()
    assert counts(env) == (3, 2, 2, [])
    # A new reason is written at once, within the period, and so is its end.
    clock.now += 0.01
    await env.set_inst("web-c", phase=P.PENDING, node="", message="1 node: cordoned")
    await env.rec.reconcile_once()
    assert counts(env) == (2, 2, 2, ["1 node: cordoned"])
    clock.now += 0.01
    await env.set_inst("web-c", phase=P.SCHEDULED, node="n1", message="")
    await env.rec.reconcile_once()
    assert counts(env) == (3, 2, 2, [])
    # So are the counts once all of them reach the replicas wanted.
    clock.now += 0.01
    await env.set_inst("web-c", **UP)
    await env.rec.reconcile_once()
    assert counts(env) == (3, 3, 3, [])
    assert env.rec._status_held == set()
    # Not listening (a pass run on its own): every change at once.
    env.rec._listening = False
    clock.now += 0.01
    await env.set_inst("web-a", phase=P.SCHEDULED)
    await env.rec.reconcile_once()
    assert counts(env) == (3, 2, 2, [])


async def test_rollout_progress_waits_with_the_counts_that_made_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeMonotonic(monkeypatch)
    listen(env)
    # New: its first rollout runs until its instances are ready.
    w = rollout.first_revision(workload(replicas=3, created_at=time.time()), "test")
    await env.put(node("n1"), w)
    await env.rec.reconcile_once()
    names = [i.name for i in env.of()]
    for name in names:
        await env.set_inst(name, phase=P.SCHEDULED, node="n1")
    clock.now += 0.3
    await env.rec.reconcile_once()
    before = env.repo.workloads["web"]
    assert before.rollout.state is RolloutState.PROGRESSING
    assert (before.status.placed, before.status.ready) == (3, 0)
    # An instance turns ready: progress for the rollout, held with the counts.
    clock.now += 0.1
    await env.set_inst(names[0], **UP)
    await env.rec.reconcile_once()
    assert env.repo.workloads["web"] is before
    assert env.rec._status_held == {"web"}
    env.rec._dirty.clear()
    await asyncio.wait_for(env.rec._dirty.wait(), 5.0)  # woken when the period ends
    clock.now += 0.2
    await env.rec.reconcile_once()
    after = env.repo.workloads["web"]
    assert after.status.ready == 1
    assert after.rollout.progress_at > before.rollout.progress_at
    assert after.rollout.state is RolloutState.PROGRESSING
    # A rollout step is written at once, within the period: the deadline passed.
    clock.now += 0.01
    stalled = after.rollout.model_copy(update={"deadline": time.time() - 1})
    await env.put(after.model_copy(update={"rollout": stalled}))
    await env.rec.reconcile_once()
    failed = env.repo.workloads["web"]
    assert failed.rollout.state is RolloutState.FAILED
    assert failed.rollout.message.startswith("no progress for 600s")
