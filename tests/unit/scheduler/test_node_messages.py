"""The scheduler's cached node messages equal the model-based conversion, field for field."""

from __future__ import annotations

from orka.models import NodeState, Resources
from orka.rpc import convert
from orka.scheduler.feed import NodeMessages
from orka.scheduler.registry import Hold, NodeRecord


def _same(messages: NodeMessages, rec: NodeRecord) -> None:
    got = messages.build(rec)
    want = convert.node_to_pb(rec.to_model())
    assert got == want
    for sub in ("capacity", "allocatable", "allocated", "usage"):
        assert got.HasField(sub) == want.HasField(sub)
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def test_node_message_equals_model_conversion_through_changes() -> None:
    messages = NodeMessages()
    rec = NodeRecord(name="n1")
    _same(messages, rec)  # all defaults, zero resources
    rec.capacity = Resources(cpu_millis=4000, memory_bytes=8 << 30)
    rec.allocatable = Resources(cpu_millis=3500, memory_bytes=7 << 30)
    rec.labels = {"zone": "a", "disk": "ssd"}
    rec.drivers = frozenset({"process", "containerd"})
    _same(messages, rec)
    rec.add_hold("web-0", Hold("web", 500, 1 << 30))
    rec.usage = Resources(cpu_millis=120, memory_bytes=1 << 20)
    rec.last_heartbeat_wall = 1234.5
    rec.state = NodeState.NOT_READY
    rec.message = "no heartbeat for 2.1s"
    rec.schedulable = False
    rec.draining = True
    _same(messages, rec)
    # Re-registering with other labels, drivers or sizes is picked up, in place or not.
    rec.labels["zone"] = "b"
    _same(messages, rec)
    rec.labels = {}
    rec.drivers = frozenset()
    rec.allocatable = Resources(cpu_millis=1000, memory_bytes=1 << 30)
    _same(messages, rec)
    for state in NodeState:
        rec.state = state
        _same(messages, rec)


def test_node_messages_are_independent_copies() -> None:
    messages = NodeMessages()
    rec = NodeRecord(name="n1", labels={"a": "1"}, drivers=frozenset({"process"}))
    first = messages.build(rec)
    first.labels["a"] = "changed"
    first.drivers.append("x")
    _same(messages, rec)


def test_fill_into_an_update_sets_the_node_of_the_update() -> None:
    from orka.api import agent_pb2 as apb

    messages = NodeMessages()
    rec = NodeRecord(name="n1", labels={"a": "1"}, drivers=frozenset({"process"}))
    update = apb.ClusterUpdate()
    messages.fill(update.node, rec)
    assert update == apb.ClusterUpdate(node=convert.node_to_pb(rec.to_model()))
    assert update.HasField("node")
