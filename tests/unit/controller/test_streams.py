"""Which instances a logs, exec or console session can reach, and the codes when not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orka.controller.streams import _instance
from orka.errors import Conflict, Invalid, NotFound, Unavailable
from orka.models import Instance, InstancePhase, Node, NodeState


def api(**instances: Instance) -> SimpleNamespace:
    nodes = {
        "n1": Node(name="n1"),
        "lost": Node(name="lost", state=NodeState.LOST),
        "left": Node(name="left", state=NodeState.LEFT),
        "slow": Node(name="slow", state=NodeState.NOT_READY),
    }
    return SimpleNamespace(repo=SimpleNamespace(instances=instances, nodes=nodes))


def inst(node: str, phase: InstancePhase = InstancePhase.RUNNING) -> Instance:
    return Instance(name="web-1", workload="web", node=node, phase=phase)


@pytest.mark.parametrize(
    ("node", "error", "text"),
    [
        ("lost", Unavailable, "on node lost, which is LOST: its agent cannot be reached"),
        ("left", Unavailable, "which is LEFT"),
        ("gone", Unavailable, "which is gone"),
        ("", Conflict, r"is not on a node yet \(phase RUNNING\)"),
    ],
)
def test_unreachable_instances(node: str, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        _instance(api(**{"web-1": inst(node)}), "web-1")  # type: ignore[arg-type]


def test_reachable_and_missing() -> None:
    a = api(**{"web-1": inst("n1")})
    assert _instance(a, "web-1")[1] == "n1"  # type: ignore[arg-type]
    # NOT_READY may still answer: the session tries (the scheduler says if it is not connected).
    assert _instance(api(**{"web-1": inst("slow")}), "web-1")[1] == "slow"  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="instance 'ghost' not found"):
        _instance(a, "ghost")  # type: ignore[arg-type]
    with pytest.raises(Invalid) as bad:
        _instance(a, "", "start.instance")  # type: ignore[arg-type]
    assert [v.field for v in bad.value.violations()] == ["start.instance"]
