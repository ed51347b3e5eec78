"""Which instances a logs, exec or console session can reach, and the codes when not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from google.rpc import status_pb2

from orka.api import agent_pb2 as apb
from orka.controller.streams import _instance, _nothing, relay
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


class _Call:
    """The scheduler's side of one Session call: records what the controller sent."""

    def __init__(self, requests: object) -> None:
        self.requests = requests
        self.sent: list[apb.SessionRequest] = []

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> apb.SessionResponse:
        if self.sent:
            raise StopAsyncIteration
        self.sent.append(await self.requests.__anext__())  # type: ignore[attr-defined]
        return apb.SessionResponse(output=apb.SessionOutput(end=status_pb2.Status(code=0)))

    def cancel(self) -> bool:
        return True


async def test_a_session_carries_the_controllers_leadership_term() -> None:
    # The scheduler refuses a stale term (tests/integration/test_scheduler_terms.py); this is
    # the other half: the controller names its own term on the opening request.
    calls: list[_Call] = []

    def session(requests: object) -> _Call:
        calls.append(_Call(requests))
        return calls[-1]

    link = SimpleNamespace(term=7, stub=lambda: SimpleNamespace(Session=session))
    opening = apb.SessionOpen(console="vm-0")
    outs = [o async for o in relay(SimpleNamespace(link=link), "n1", opening, _nothing())]  # type: ignore[arg-type]
    assert outs == []
    [call] = calls
    [first] = call.sent
    assert (first.node, first.leader_term, first.open.console) == ("n1", 7, "vm-0")
