"""The controller feed: node and instance changes, fanned out to every connected controller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.models import NodeState, Resources
from orka.rpc import convert
from orka.scheduler.registry import NodeRecord, Registry

# One Watch message carries at most this many updates of a burst.
MAX_BATCH = 1000


class WatchHub:
    """Fans cluster updates out to every connected controller, batched per wake-up."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[apb.ClusterUpdate | None]] = set()

    def publish(self, update: apb.ClusterUpdate) -> None:
        for q in self.queues:
            q.put_nowait(update)

    def close(self) -> None:
        for q in self.queues:
            q.put_nowait(None)


class NodeMessages:
    """`pb.Node` of a node record, the same as `convert.node_to_pb(node.to_model())`.

    Every node is published every `usage_report_interval`, so this skips the model and keeps
    what only registering changes (name, labels, drivers, capacity, allocatable) as one message
    per node, copied into each new one; the rest is written by the same converter as the
    model's (convert.fill_node_status).
    """

    def __init__(self) -> None:
        # Node name -> (labels, drivers, capacity, allocatable, the message of those, and
        # (pool, volume backends, volume capacity)).
        self._static: dict[
            str,
            tuple[
                dict[str, str],
                frozenset[str],
                Resources,
                Resources,
                pb.Node,
                tuple[str, frozenset[str], int],
            ],
        ] = {}

    def build(self, node: NodeRecord) -> pb.Node:
        msg = pb.Node()
        self.fill(msg, node)
        return msg

    def fill(self, msg: pb.Node, node: NodeRecord) -> None:
        """Write the node into `msg`, an empty message (such as a new update's `node`)."""
        cached = self._static.get(node.name)
        if (
            cached is None
            or cached[1] is not node.drivers
            or cached[2] is not node.capacity
            or cached[3] is not node.allocatable
            or cached[0] != node.labels
            or cached[5] != (node.pool, node.volume_backends, node.volume_capacity_bytes)
        ):
            static = convert.node_static_to_pb(
                node.name,
                node.capacity,
                node.allocatable,
                node.labels,
                node.drivers,
                pool=node.pool,
                volume_backends=node.volume_backends,
                volume_capacity_bytes=node.volume_capacity_bytes,
            )
            storage = (node.pool, node.volume_backends, node.volume_capacity_bytes)
            cached = (
                dict(node.labels),
                node.drivers,
                node.capacity,
                node.allocatable,
                static,
                storage,
            )
            self._static[node.name] = cached
        msg.CopyFrom(cached[4])
        convert.fill_node_status(
            msg,
            state=node.state,
            schedulable=node.schedulable,
            draining=node.draining,
            leaving=node.leaving,
            allocated_cpu_millis=node.cpu_used,
            allocated_memory_bytes=node.mem_used,
            usage=node.usage,
            instance_count=len(node.holds),
            last_heartbeat=node.last_heartbeat_wall,
            message=node.message,
        )


def sync_update(node: NodeRecord) -> apb.ClusterUpdate:
    """Everything the node reports holding, for the controller to reconcile against."""
    sync = apb.NodeSync(node=node.name)
    for report in node.reports.values():
        sync.instances.append(convert.instance_status_to_pb(report))
    sync.volumes.extend(node.volumes.values())
    return apb.ClusterUpdate(sync=sync)


class Feed:
    """What the controllers hear: each node change at once, every live node's usage at a
    steady pace, and a full snapshot when a controller (re)connects.

    It has no loop of its own: the usage report is paced by the liveness clock
    (`report_usage`), so that a pass of that clock sees states and usage in a fixed order."""

    def __init__(self, registry: Registry, usage_report_interval: float) -> None:
        self.registry = registry
        self.usage_report_interval = usage_report_interval
        self.hub = WatchHub()
        self.nodes = NodeMessages()
        self._last_usage_report = 0.0

    def publish_node(self, node: NodeRecord) -> None:
        update = apb.ClusterUpdate()
        self.nodes.fill(update.node, node)
        self.hub.publish(update)

    def publish_sync(self, node: NodeRecord) -> None:
        self.hub.publish(sync_update(node))

    def publish_instance(self, node: NodeRecord, status: apb.InstanceStatus) -> None:
        self.hub.publish(
            apb.ClusterUpdate(instance=apb.InstanceUpdate(node=node.name, status=status))
        )

    def pace_from(self, now: float) -> None:
        """Start the usage report's pace: the first report is due an interval after `now`."""
        self._last_usage_report = now

    def report_usage(self, now: float) -> None:
        """Usage and allocation change with every heartbeat; the controller gets them at this
        pace rather than once per heartbeat per node."""
        if now - self._last_usage_report < self.usage_report_interval:
            return
        self._last_usage_report = now
        for node in self.registry:
            if node.state in (NodeState.READY, NodeState.NOT_READY):
                self.publish_node(node)

    def close(self) -> None:
        self.hub.close()

    async def watch(self) -> AsyncIterator[apb.ClusterUpdates]:
        """One controller's feed: every node first, then each change, a burst per message."""
        queue: asyncio.Queue[apb.ClusterUpdate | None] = asyncio.Queue()
        first = apb.ClusterUpdates()
        for node in self.registry:
            first.updates.append(apb.ClusterUpdate(node=self.nodes.build(node)))
            if node.state in (NodeState.READY, NodeState.NOT_READY):
                first.updates.append(sync_update(node))
        self.hub.queues.add(queue)
        try:
            yield first
            while True:
                update = await queue.get()
                if update is None:
                    return
                batch = apb.ClusterUpdates(updates=[update])
                # Drain whatever else is queued so a burst travels as one message.
                while not queue.empty() and len(batch.updates) < MAX_BATCH:
                    more = queue.get_nowait()
                    if more is None:
                        yield batch
                        return
                    batch.updates.append(more)
                yield batch
        finally:
            self.hub.queues.discard(queue)
