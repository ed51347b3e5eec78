"""`orka.v1.Controller`: the public API. Protobuf stops here; the rest works on models."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller.events import EventHub, Subscriber
from orka.controller.link import SchedulerLink
from orka.controller.reconciler import Reconciler
from orka.controller.repo import Change, Repo
from orka.controller.secrets import keep_redacted
from orka.errors import AlreadyExists, Invalid, NotFound, OrkaError, ResourceExhausted
from orka.models import InstancePhase, Node, Workload, check_name
from orka.rpc import convert
from orka.rpc.frames import drain
from orka.rpc.server import Auditor, stream, unary
from orka.security.identity import Identity

# Who may call what. Only people hold these certificates: the controller, scheduler and agent
# certificates never reach this API. A viewer reads; writes need an admin.
ADMIN = frozenset({"admin"})
READERS = frozenset({"admin", "viewer"})
# Events per WatchEventBatches message: a burst's backlog goes in a few messages, each far
# below gRPC's 4 MiB limit (an event is a few hundred bytes).
MAX_EVENT_BATCH = 1000

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


async def _always() -> None:
    return None


def leader_only(fn: F) -> F:
    """Below @unary: a follower answers UNAVAILABLE naming the leader (see leadership.py)."""

    @functools.wraps(fn)
    async def handler(self: ControllerApi, *args: Any) -> Any:
        await self.gate()
        return await fn(self, *args)

    return handler  # type: ignore[return-value]


def _name(value: str, field: str = "name") -> str:
    try:
        return check_name(value, field)
    except ValueError as err:
        raise Invalid(str(err)) from None


class ControllerApi(pb_grpc.ControllerServicer):
    # Records the calls that write (orka/controller/audit.py); set by the controller.
    auditor: Auditor | None = None

    def __init__(
        self,
        repo: Repo,
        reconciler: Reconciler,
        link: SchedulerLink,
        events: EventHub,
        gate: Callable[[], Awaitable[None]] = _always,
    ) -> None:
        self.repo = repo
        self.reconciler = reconciler
        self.link = link
        self.events = events
        # Raises Unavailable on a controller that does not lead; the controller swaps in
        # the reconciler and link of each new term.
        self.gate = gate

    # ---- workloads ----

    @unary(roles=ADMIN)
    @leader_only
    async def CreateWorkload(self, request: pb.CreateWorkloadRequest, who: Identity) -> pb.Workload:
        spec = keep_redacted(None, convert.spec_from_pb(request.spec))
        workload = Workload(spec=spec, created_by=str(who), updated_by=str(who))

        def plan() -> list[Change]:
            if spec.name in self.repo.workloads:
                raise AlreadyExists(f"workload {spec.name!r} already exists")
            return [Change("workloads", spec.name, workload, create=True)]

        await self.repo.mutate(plan)
        self.reconciler.kick()
        return convert.workload_to_pb(self.repo.workloads.get(spec.name, workload))

    @unary(roles=ADMIN)
    @leader_only
    async def UpdateWorkload(self, request: pb.UpdateWorkloadRequest, who: Identity) -> pb.Workload:
        spec = convert.spec_from_pb(request.spec)

        def plan() -> list[Change]:
            old = self.repo.workloads.get(spec.name)
            if old is None:
                raise NotFound(f"workload {spec.name!r} not found")
            if old.deleting:
                raise OrkaError(f"workload {spec.name!r} is being deleted")
            if old.spec.kind is not spec.kind:
                raise Invalid(
                    f"spec.kind: cannot change from {old.spec.kind.value} to {spec.kind.value}"
                )
            new_spec = keep_redacted(old.spec, spec)
            if old.spec == new_spec:
                return []
            # Only a change to what runs needs new instances; replicas alone just scales.
            runs_same = old.spec.model_copy(update={"replicas": spec.replicas}) == new_spec
            generation = old.generation if runs_same else old.generation + 1
            new = old.model_copy(
                update={
                    "spec": new_spec,
                    "generation": generation,
                    "updated_at": time.time(),
                    "updated_by": str(who),
                }
            )
            return [Change("workloads", spec.name, new)]

        await self.repo.mutate(plan)
        self.reconciler.kick()
        return convert.workload_to_pb(self.repo.workloads[spec.name])

    @unary(roles=READERS)
    @leader_only
    async def GetWorkload(self, request: pb.GetWorkloadRequest, who: Identity) -> pb.Workload:
        w = self.repo.workloads.get(_name(request.name))
        if w is None:
            raise NotFound(f"workload {request.name!r} not found")
        return convert.workload_to_pb(w)

    @unary(roles=READERS)
    @leader_only
    async def ListWorkloads(
        self, request: pb.ListWorkloadsRequest, who: Identity
    ) -> pb.ListWorkloadsResponse:
        return pb.ListWorkloadsResponse(
            workloads=[convert.workload_to_pb(w) for _, w in sorted(self.repo.workloads.items())]
        )

    @unary(roles=ADMIN)
    @leader_only
    async def DeleteWorkload(
        self, request: pb.DeleteWorkloadRequest, who: Identity
    ) -> pb.DeleteWorkloadResponse:
        name = _name(request.name)

        def plan() -> list[Change]:
            w = self.repo.workloads.get(name)
            if w is None:
                raise NotFound(f"workload {name!r} not found")
            if w.deleting:
                return []
            return [Change("workloads", name, w.model_copy(update={"deleting": True}))]

        await self.repo.mutate(plan)
        self.reconciler.kick()
        w = self.repo.workloads.get(name)
        return pb.DeleteWorkloadResponse(workload=convert.workload_to_pb(w) if w else None)

    # ---- instances ----

    @unary(roles=READERS)
    @leader_only
    async def ListInstances(
        self, request: pb.ListInstancesRequest, who: Identity
    ) -> pb.ListInstancesResponse:
        phase: InstancePhase | None = None
        if request.phase != pb.Instance.PHASE_UNSPECIFIED:
            phase = convert.phase_from_pb(request.phase)
        if request.workload:
            _name(request.workload, "workload")
            source = self.repo.instances_of(request.workload)
        else:
            source = list(self.repo.instances.values())
        out = [
            convert.instance_to_pb(i)
            for i in sorted(source, key=lambda i: (i.workload, i.created_at, i.name))
            if (not request.node or i.node == request.node) and (phase is None or i.phase is phase)
        ]
        return pb.ListInstancesResponse(instances=out)

    @unary(roles=READERS)
    @leader_only
    async def GetInstance(self, request: pb.GetInstanceRequest, who: Identity) -> pb.Instance:
        if not request.name:
            raise Invalid("name: is required")
        inst = self.repo.instances.get(request.name)
        if inst is None:
            raise NotFound(f"instance {request.name!r} not found")
        return convert.instance_to_pb(inst)

    # ---- nodes ----

    def _node(self, name: str) -> Node:
        _name(name)
        node = self.repo.nodes.get(name)
        if node is None:
            raise NotFound(f"node {name!r} not found")
        return node

    @unary(roles=READERS)
    @leader_only
    async def ListNodes(self, request: pb.ListNodesRequest, who: Identity) -> pb.ListNodesResponse:
        return pb.ListNodesResponse(
            nodes=[convert.node_to_pb(n) for _, n in sorted(self.repo.nodes.items())]
        )

    @unary(roles=READERS)
    @leader_only
    async def GetNode(self, request: pb.GetNodeRequest, who: Identity) -> pb.Node:
        return convert.node_to_pb(self._node(request.name))

    async def _set_node(self, name: str, schedulable: bool, draining: bool) -> pb.Node:
        self._node(name)

        def plan() -> list[Change]:
            node = self._node(name)
            new = node.model_copy(update={"schedulable": schedulable, "draining": draining})
            return [Change("nodes", name, new)] if new != node else []

        await self.repo.mutate(plan)
        # The store is the truth; a scheduler that is away gets it when it reconnects.
        try:
            await self.link.set_node(name, schedulable=schedulable, draining=draining)
        except OrkaError:
            pass
        self.reconciler.kick()
        if schedulable:
            self.reconciler.queue.cluster_changed()
        return convert.node_to_pb(self.repo.nodes[name])

    @unary(roles=ADMIN)
    @leader_only
    async def CordonNode(self, request: pb.CordonNodeRequest, who: Identity) -> pb.Node:
        return await self._set_node(request.name, schedulable=False, draining=False)

    @unary(roles=ADMIN)
    @leader_only
    async def UncordonNode(self, request: pb.UncordonNodeRequest, who: Identity) -> pb.Node:
        return await self._set_node(request.name, schedulable=True, draining=False)

    @unary(roles=ADMIN)
    @leader_only
    async def DrainNode(self, request: pb.DrainNodeRequest, who: Identity) -> pb.Node:
        return await self._set_node(request.name, schedulable=False, draining=True)

    # ---- events ----

    @stream(roles=READERS)
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, who: Identity
    ) -> AsyncIterator[pb.Event]:
        async for events in self._watch(request, limit=1):
            yield events[0]

    @stream(roles=READERS)
    async def WatchEventBatches(
        self, request: pb.WatchEventsRequest, who: Identity
    ) -> AsyncIterator[pb.EventBatch]:
        async for events in self._watch(request, limit=MAX_EVENT_BATCH):
            yield pb.EventBatch(events=events)

    async def _watch(
        self, request: pb.WatchEventsRequest, limit: int
    ) -> AsyncIterator[list[pb.Event]]:
        """The subscriber's events, up to `limit` at a time: whatever is queued when the
        previous ones have been sent."""
        await self.gate()
        if request.workload:
            _name(request.workload, "workload")
        sub = Subscriber(request.workload)
        self.events.subscribers.add(sub)
        try:
            while True:
                first = await sub.queue.get()
                events, closed = ([], True) if first is None else drain(first, sub.queue, limit)
                if events:
                    yield events
                if closed:
                    if sub.cut_off:
                        raise ResourceExhausted(
                            f"this subscriber fell {sub.cut_off} events behind and was cut off;"
                            " subscribe again (and list what changed meanwhile)"
                        )
                    return
        except asyncio.CancelledError:
            raise
        finally:
            self.events.subscribers.discard(sub)
