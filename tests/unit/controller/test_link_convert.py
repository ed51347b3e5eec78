"""The scheduler link's converters: each domain command to its message, each message back to
its domain result, the raw message kept; a bad feed update is skipped, named in the log."""

from __future__ import annotations

import pytest
import structlog
from google.rpc import code_pb2

from orka import fit
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.controller.commands import (
    Assignment,
    InstanceReported,
    NodeSeen,
    NodeSynced,
    Release,
    Start,
    Stop,
    start_command,
    stop_command,
)
from orka.controller.link import (
    CommandResult,
    PlaceResult,
    assignment_bytes,
    assignment_to_pb,
    command_result_from_pb,
    command_to_pb,
    place_result_from_pb,
    update_from_pb,
    updates_from_pb,
)
from orka.models import (
    Instance,
    InstancePhase,
    InstanceReport,
    Node,
    NodeState,
    Resources,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert

SPEC = WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["sleep", "1"], env={"A": "b"})


def test_assignment_and_commands_to_messages() -> None:
    inst = Instance(name="web-0000", workload="web", generation=3, node="n1")
    a = Assignment.of(inst, Workload(spec=SPEC))
    assert a == Assignment(instance="web-0000", generation=3, spec=SPEC)
    want = apb.Assignment(instance="web-0000", generation=3, spec=convert.spec_to_pb(SPEC))
    assert assignment_to_pb(a) == want
    assert start_command(inst, Workload(spec=SPEC)) == Start(node="n1", assignment=a)
    assert command_to_pb(Start(node="n1", assignment=a)) == apb.NodeCommand(
        node="n1", start=apb.StartInstance(assignment=want)
    )
    # A replica's ordinal rides in the start too (the start is filled in place, not copied).
    numbered = Assignment(instance="web-0003", generation=3, spec=SPEC, ordinal=2)
    assert command_to_pb(Start(node="n1", assignment=numbered)) == apb.NodeCommand(
        node="n1",
        start=apb.StartInstance(
            assignment=apb.Assignment(
                instance="web-0003", generation=3, spec=convert.spec_to_pb(SPEC), ordinal=2
            )
        ),
    )
    assert stop_command("n2", "web-0001", "scaled down") == Stop("n2", "web-0001", "scaled down")
    assert command_to_pb(Stop("n2", "web-0001", "scaled down")) == apb.NodeCommand(
        node="n2", stop=apb.StopInstance(instance="web-0001", remove=True, reason="scaled down")
    )
    assert command_to_pb(Release("n3", "web-0002")) == apb.NodeCommand(
        node="n3", release=apb.ReleaseOffer(instance="web-0002")
    )


def test_assignment_bytes_is_about_the_size_on_the_wire() -> None:
    a = Assignment(instance="web-0000", generation=3, spec=SPEC)
    wire = assignment_to_pb(a).ByteSize()
    assert wire <= assignment_bytes(a) <= wire + 64


def test_results_from_messages_keep_the_raw_message() -> None:
    msg = apb.PlaceResult(
        instance="web-0",
        reasons=[apb.PlaceReason(code="Cordoned", message="cordoned", node_count=1)],
        refusals={"n1": "busy"},
    )
    placed = place_result_from_pb(msg)
    assert placed == PlaceResult(
        instance="web-0",
        node="",
        reasons=[fit.ReasonCount("Cordoned", "cordoned", 1, False)],
        refusals={"n1": "busy"},
    )
    assert placed.raw is msg
    assert place_result_from_pb(apb.PlaceResult(instance="web-1", node="n2")) == PlaceResult(
        instance="web-1", node="n2"
    )
    msg2 = apb.CommandResult(
        status=convert.error_status(code_pb2.DEADLINE_EXCEEDED, "no answer"), unconfirmed=True
    )
    result = command_result_from_pb(msg2)
    assert result == CommandResult(ok=False, error="no answer", unconfirmed=True)
    assert result.raw is msg2
    assert command_result_from_pb(apb.CommandResult()) == CommandResult(ok=True)


def status(name: str, phase: int = pb.Instance.RUNNING) -> apb.InstanceStatus:
    return apb.InstanceStatus(name=name, workload="web", phase=phase)


def report(name: str, node: str) -> InstanceReport:
    return InstanceReport(name=name, workload="web", node=node, phase=InstancePhase.RUNNING)


def test_each_kind_of_feed_update() -> None:
    node = apb.ClusterUpdate(
        node=pb.Node(name="n1", state=pb.Node.NOT_READY, capacity=pb.Resources(cpu_millis=5))
    )
    seen = update_from_pb(node)
    assert isinstance(seen, NodeSeen)
    assert (seen.node.name, seen.node.state, seen.node.capacity) == (
        "n1",
        NodeState.NOT_READY,
        Resources(cpu_millis=5),
    )
    assert isinstance(seen.node, Node)
    one = apb.ClusterUpdate(instance=apb.InstanceUpdate(node="n1", status=status("web-a")))
    assert update_from_pb(one) == InstanceReported(report("web-a", "n1"))
    sync = apb.ClusterUpdate(
        sync=apb.NodeSync(node="n2", instances=[status("web-a"), status("web-b")])
    )
    assert update_from_pb(sync) == NodeSynced("n2", [report("web-a", "n2"), report("web-b", "n2")])
    assert update_from_pb(apb.ClusterUpdate(sync=apb.NodeSync(node="n3"))) == NodeSynced("n3")
    assert update_from_pb(apb.ClusterUpdate()) is None  # no body: nothing to say


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            apb.ClusterUpdate(instance=apb.InstanceUpdate(node="n1", status=status(""))),
            "instance status: name is required",
        ),
        # A sync is a whole list: one bad entry and the list cannot be trusted as complete.
        (
            apb.ClusterUpdate(
                sync=apb.NodeSync(
                    node="n1",
                    instances=[status("web-a"), status("web-b", pb.Instance.PHASE_UNSPECIFIED)],
                )
            ),
            "instance status web-b: phase: is required",
        ),
    ],
)
def test_a_bad_update_is_skipped_and_logged_the_rest_kept(
    bad: apb.ClusterUpdate, error: str
) -> None:
    good = apb.ClusterUpdate(instance=apb.InstanceUpdate(node="n1", status=status("web-c")))
    with structlog.testing.capture_logs() as logs:
        out = updates_from_pb([bad, apb.ClusterUpdate(), good])
    assert out == [InstanceReported(report("web-c", "n1"))]
    assert logs == [{"event": "bad update from scheduler", "error": error, "log_level": "warning"}]
