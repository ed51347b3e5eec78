"""Instance transitions: each one's resulting record, and the phases it refuses to start from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orka.models import (
    TERMINAL_PHASES,
    Instance,
    InstancePhase,
    InstanceReason,
    InstanceReport,
    InvalidTransition,
)

P = InstancePhase
R = InstanceReason


def inst(phase: InstancePhase = P.RUNNING, **kw: Any) -> Instance:
    kw.setdefault("node", "" if phase is P.PENDING else "n1")
    kw.setdefault("created_at", 1.0)
    kw.setdefault("updated_at", 1.0)
    return Instance(name="web-a", workload="web", phase=phase, **kw)


def changed(old: Instance, new: Instance) -> dict[str, Any]:
    """The fields a transition changed, with their new values."""
    return {k: getattr(new, k) for k in Instance.model_fields if getattr(new, k) != getattr(old, k)}


# ---- each transition's resulting fields ----


def test_scheduled_binds_a_pending_instance_to_its_node() -> None:
    old = inst(P.PENDING, reason="Unschedulable", message="1 node: cordoned")
    assert changed(old, old.scheduled("n2", 9.0)) == {
        "phase": P.SCHEDULED,
        "node": "n2",
        "reason": "Scheduled",
        "message": "",
        "scheduled_at": 9.0,
        "updated_at": 9.0,
    }


def test_unschedulable_keeps_it_pending_with_the_schedulers_reasons() -> None:
    old = inst(P.PENDING)
    assert changed(old, old.unschedulable("2 nodes: insufficient memory", 9.0)) == {
        "reason": "Unschedulable",
        "message": "2 nodes: insufficient memory",
        "updated_at": 9.0,
    }


def test_volume_unavailable_keeps_it_pending_with_why() -> None:
    old = inst(P.PENDING)
    assert changed(old, old.volume_unavailable("volume data-1 does not exist", 9.0)) == {
        "reason": "VolumeUnavailable",
        "message": "volume data-1 does not exist",
        "updated_at": 9.0,
    }


def test_start_refused_unbinds_naming_the_node_that_refused() -> None:
    old = inst(P.SCHEDULED, node="n3", reason="Scheduled", scheduled_at=2.0)
    assert changed(old, old.start_refused("image missing", 9.0)) == {
        "phase": P.PENDING,
        "node": "",
        "reason": "StartRefused",
        "message": "node n3: image missing",
        "updated_at": 9.0,
    }


@pytest.mark.parametrize(
    ("reason", "shown"), [(R.NODE_LOST, "NodeLost"), (R.NOT_ON_NODE, "NotOnNode")]
)
def test_lost_finishes_a_live_instance(reason: InstanceReason, shown: str) -> None:
    old = inst(P.STARTING)
    assert changed(old, old.lost(reason, "node n1 is LOST", 9.0)) == {
        "phase": P.LOST,
        "reason": shown,
        "message": "node n1 is LOST",
        "finished_at": 9.0,
        "updated_at": 9.0,
    }


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        (R.SCALED_DOWN, "scaled down"),
        (R.WORKLOAD_DELETED, "workload deleted"),
        (R.REPLACED, "replaced by web-b"),
    ],
)
def test_stop_asks_for_a_stop_and_says_why_leaving_phase_and_reason(
    reason: InstanceReason, message: str
) -> None:
    old = inst(P.RUNNING, reason="Started", message="up")
    assert changed(old, old.stop(reason, 9.0, successor="web-b")) == {
        "desired_stop": True,
        "message": message,
        "updated_at": 9.0,
    }


def test_hand_over_names_the_successor_and_a_failed_one_clears_it() -> None:
    old = inst(P.RUNNING)
    handing = old.hand_over("web-b")
    assert changed(old, handing) == {"replaced_by": "web-b"}
    assert changed(handing, handing.hand_over_failed()) == {"replaced_by": ""}


def test_relabelled_moves_a_pending_instance_to_the_new_generation() -> None:
    old = inst(P.PENDING, generation=1)
    assert changed(old, old.relabelled(2)) == {"generation": 2}


def test_a_transition_leaves_the_record_it_started_from_alone() -> None:
    old = inst(P.PENDING)
    old.scheduled("n1", 9.0)
    assert (old.phase, old.node, old.updated_at) == (P.PENDING, "", 1.0)


# ---- refused transitions ----

LIVE = [p for p in P if p not in TERMINAL_PHASES]
BOUND = [P.SCHEDULED, P.STARTING, P.RUNNING, P.STOPPING]

TRANSITIONS: dict[str, tuple[Callable[[Instance], Instance], list[InstancePhase]]] = {
    "scheduled": (lambda i: i.scheduled("n1", 9.0), [P.PENDING]),
    "unschedulable": (lambda i: i.unschedulable("no", 9.0), [P.PENDING]),
    "volume_unavailable": (lambda i: i.volume_unavailable("no", 9.0), [P.PENDING]),
    "start_refused": (lambda i: i.start_refused("no", 9.0), [P.SCHEDULED]),
    "lost": (lambda i: i.lost(R.NODE_LOST, "gone", 9.0), LIVE),
    "stop": (lambda i: i.stop(R.SCALED_DOWN, 9.0), LIVE),
    "hand_over": (lambda i: i.hand_over("web-b"), BOUND),
    "hand_over_failed": (lambda i: i.hand_over_failed(), LIVE),
    "relabelled": (lambda i: i.relabelled(2), [P.PENDING]),
}


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
@pytest.mark.parametrize("phase", list(P))
def test_each_transition_starts_only_from_its_phases(name: str, phase: InstancePhase) -> None:
    move, allowed = TRANSITIONS[name]
    old = inst(phase)
    if phase in allowed:
        assert move(old) is not old
        return
    with pytest.raises(InvalidTransition) as info:
        move(old)
    assert str(info.value) == f"instance web-a: cannot {REFUSED_AS[name]} from {phase}"


# What each refusal says the instance cannot do.
REFUSED_AS = {
    "scheduled": "be scheduled",
    "unschedulable": "be unschedulable",
    "volume_unavailable": "wait for a volume",
    "start_refused": "have its start refused",
    "lost": "be lost",
    "stop": "be stopped",
    "hand_over": "be replaced",
    "hand_over_failed": "take back its hand-over",
    "relabelled": "be relabelled",
}


def test_a_loss_or_stop_needs_a_reason_of_its_kind() -> None:
    with pytest.raises(InvalidTransition, match=r"^Scheduled is not a reason to lose an instance$"):
        inst().lost(R.SCHEDULED, "x", 9.0)
    with pytest.raises(InvalidTransition, match=r"^NodeLost is not a reason to stop an instance$"):
        inst().stop(R.NODE_LOST, 9.0)


# ---- reported: what a node says, folded in ----


def rep(phase: InstancePhase = P.RUNNING, **kw: Any) -> InstanceReport:
    return InstanceReport(name="web-a", workload="web", node="n1", phase=phase, **kw)


@pytest.mark.parametrize(
    ("stored", "report", "expected"),
    [
        (inst(P.STARTING), rep(P.SCHEDULED), None),
        (inst(P.RUNNING), rep(P.SCHEDULED), None),
        (inst(P.FAILED, exit_code=1), rep(P.RUNNING), None),
        (inst(P.LOST), rep(P.STARTING), None),
        (inst(P.RUNNING), rep(P.RUNNING), None),
        (inst(P.STARTING), rep(P.RUNNING), {"phase": P.RUNNING}),
        (
            inst(P.RUNNING),
            rep(P.FAILED, exit_code=2, reason="Crashed", finished_at=9.0),
            {"phase": P.FAILED, "exit_code": 2, "reason": "Crashed", "finished_at": 9.0},
        ),
        (inst(P.RUNNING), rep(P.RUNNING, restarts=4), {"restarts": 4}),
        (inst(P.RUNNING), rep(P.RUNNING, started_at=3.0), {"started_at": 3.0}),
        (inst(P.RUNNING), rep(P.RUNNING, message="hi"), {"message": "hi"}),
        (inst(P.RUNNING, message="hi"), rep(P.RUNNING), {"message": ""}),
        # The controller's stop reason is kept when the agent says nothing.
        (inst(P.RUNNING, desired_stop=True, message="scaled down"), rep(P.RUNNING), None),
        (
            inst(P.RUNNING, desired_stop=True, message="scaled down"),
            rep(P.RUNNING, message="killed by signal"),
            {"message": "killed by signal"},
        ),
        (
            inst(P.RUNNING, desired_stop=True, message="scaled down"),
            rep(P.STOPPED),
            {"phase": P.STOPPED},
        ),
        # A terminal report on a terminal instance still lands (e.g. LOST then STOPPED).
        (inst(P.LOST), rep(P.STOPPED), {"phase": P.STOPPED}),
    ],
)
def test_reported(
    stored: Instance, report: InstanceReport, expected: dict[str, Any] | None
) -> None:
    out = stored.reported(report, now=1234.0)
    if expected is None:
        assert out is None
        return
    assert out is not None
    assert changed(stored, out) == {**expected, "updated_at": 1234.0}
