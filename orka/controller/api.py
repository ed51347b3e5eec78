"""`orka.v1.Controller`: the public API. Protobuf stops here; the rest works on models."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from google.protobuf.message import Message

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller import classes_api, paging, rollout, rollout_api, streams, volumes_api
from orka.controller.activity import ActivityLog
from orka.controller.activity_rpc import list_activities
from orka.controller.events import EventHub
from orka.controller.link import SchedulerLink
from orka.controller.reconciler import Reconciler
from orka.controller.repo import Change, Repo
from orka.controller.secrets import keep_redacted
from orka.controller.volumes import VolumeKeeper
from orka.errors import (
    AlreadyExists,
    Conflict,
    FieldViolation,
    Invalid,
    NotFound,
    OrkaError,
    ResourceExhausted,
)
from orka.etags import check_etag, new_workload_etag, node_etag
from orka.models import Instance, InstancePhase, Node, Workload, WorkloadSpec, check_name
from orka.rpc import convert
from orka.rpc.server import Auditor, boundaries, stream, unary
from orka.security.identity import Identity
from orka.validation import quote

# Who may call what. Only people hold these certificates: the controller, scheduler and agent
# certificates never reach this API. A viewer reads; writes need an admin.
ADMIN = frozenset({"admin"})
READERS = frozenset({"admin", "viewer"})
# Events per WatchEventBatches message: a burst's backlog goes in a few messages. Most
# events are a few hundred bytes, but a workload's carries its spec (up to 1 MiB), so a
# batch is bounded in bytes too, below the 4 MiB a client with gRPC's defaults takes.
MAX_EVENT_BATCH = 1000
MAX_BATCH_BYTES = 3 << 20

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


@dataclass(frozen=True)
class Quotas:
    """Cluster-wide bounds on what the API accepts; a request past one is RESOURCE_EXHAUSTED
    naming it, and stores nothing. Defaults sit well above the largest benchmark (10,000
    instances on 5,000 nodes) and below what one controller's cache holds comfortably."""

    max_workloads: int = 10_000
    # Replicas summed over every workload: each is an instance record, and every List,
    # reconcile pass and placement round grows with them.
    max_instances: int = 100_000
    # Serialized specs summed over every workload: the cache, every event history entry and
    # a full listing grow with them.
    max_spec_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        for name in ("max_workloads", "max_instances", "max_spec_bytes"):
            if getattr(self, name) <= 0:
                raise Invalid(f"--{name.replace('_', '-')}: must be > 0")


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
        text = str(err)
        raise Invalid(
            text, fields=[FieldViolation(field, text.removeprefix(f"{field} "))]
        ) from None


@boundaries(
    CreateWorkload=(unary(roles=ADMIN), leader_only),
    UpdateWorkload=(unary(roles=ADMIN), leader_only),
    GetWorkload=(unary(roles=READERS), leader_only),
    ListWorkloads=(unary(roles=READERS), leader_only),
    DeleteWorkload=(unary(roles=ADMIN), leader_only),
    ListInstances=(unary(roles=READERS), leader_only),
    GetInstance=(unary(roles=READERS), leader_only),
    ListEndpoints=(unary(roles=READERS), leader_only),
    ListNodes=(unary(roles=READERS), leader_only),
    GetNode=(unary(roles=READERS), leader_only),
    CordonNode=(unary(roles=ADMIN), leader_only),
    UncordonNode=(unary(roles=ADMIN), leader_only),
    DrainNode=(unary(roles=ADMIN), leader_only),
    WatchEvents=stream(roles=READERS),
    WatchEventBatches=stream(roles=READERS),
    ListActivities=(unary(roles=READERS), leader_only),
    ListWorkloadRevisions=(unary(roles=READERS), leader_only),
    RollbackWorkload=(unary(roles=ADMIN), leader_only),
    PauseRollout=(unary(roles=ADMIN), leader_only),
    ResumeRollout=(unary(roles=ADMIN), leader_only),
    PromoteRollout=(unary(roles=ADMIN), leader_only),
    ReadLogs=stream(roles=ADMIN),
    ExecInstance=stream(roles=ADMIN),
    AttachConsole=stream(roles=ADMIN),
    CreateClass=(unary(roles=ADMIN), leader_only),
    GetClass=(unary(roles=READERS), leader_only),
    ListClasses=(unary(roles=READERS), leader_only),
    UpdateClass=(unary(roles=ADMIN), leader_only),
    DeleteClass=(unary(roles=ADMIN), leader_only),
    ListPools=(unary(roles=READERS), leader_only),
    CreateVolume=(unary(roles=ADMIN), leader_only),
    GetVolume=(unary(roles=READERS), leader_only),
    ListVolumes=(unary(roles=READERS), leader_only),
    DeleteVolume=(unary(roles=ADMIN), leader_only),
)
class ControllerApi(pb_grpc.ControllerServicer):
    # Records the calls that write (orka/controller/audit.py); set by the controller.
    auditor: Auditor | None = None
    # Recent activity per object (orka/controller/activity.py); set by the controller.
    activity: ActivityLog = ActivityLog()
    # Volume commands and reports (orka/controller/volumes.py); set by the controller.
    volume_keeper: VolumeKeeper | None = None

    def __init__(
        self,
        repo: Repo,
        reconciler: Reconciler,
        link: SchedulerLink,
        events: EventHub,
        gate: Callable[[], Awaitable[None]] = _always,
        quotas: Quotas | None = None,
    ) -> None:
        self.repo = repo
        self.reconciler = reconciler
        self.link = link
        self.events = events
        # Raises Unavailable on a controller that does not lead; the controller swaps in
        # the reconciler and link of each new term.
        self.gate = gate
        self.quotas = quotas or Quotas()
        # Each workload's current spec and its serialized size (quota checks sum them all):
        # only the spec the repo holds anyway is kept, never an old one.
        self._spec_sizes: dict[str, tuple[WorkloadSpec, int]] = {}

    # Classes and pools (orka/controller/classes_api.py), volumes (volumes_api.py).
    CreateClass = classes_api.create_class
    GetClass = classes_api.get_class
    ListClasses = classes_api.list_classes
    UpdateClass = classes_api.update_class
    DeleteClass = classes_api.delete_class
    ListPools = classes_api.list_pools
    CreateVolume = volumes_api.create_volume
    GetVolume = volumes_api.get_volume
    ListVolumes = volumes_api.list_volumes
    DeleteVolume = volumes_api.delete_volume

    # The rollout RPCs (orka/controller/rollout_api.py).
    ListWorkloadRevisions = rollout_api.list_revisions
    RollbackWorkload = rollout_api.rollback
    PauseRollout = rollout_api.pause
    ResumeRollout = rollout_api.resume
    PromoteRollout = rollout_api.promote

    # The RPCs that reach into instances through their agents (orka/controller/streams.py).

    def ReadLogs(self, request: pb.ReadLogsRequest, who: Identity) -> AsyncIterator[pb.LogChunk]:
        return streams.read_logs(self, request, who)

    def ExecInstance(
        self, requests: AsyncIterator[pb.ExecInstanceRequest], who: Identity
    ) -> AsyncIterator[pb.ExecResponse]:
        return streams.exec_instance(self, requests, who)

    def AttachConsole(
        self, requests: AsyncIterator[pb.AttachConsoleRequest], who: Identity
    ) -> AsyncIterator[pb.AttachConsoleResponse]:
        return streams.attach_console(self, requests, who)

    # Messages of stored objects carry the revision of their last write.

    def _workload_pb(self, w: Workload) -> pb.Workload:
        msg = convert.workload_to_pb(w)
        msg.revision = self.repo.revision_of("workloads", w.name)
        return msg

    def _instance_pb(self, i: Instance) -> pb.Instance:
        msg = convert.instance_to_pb(i)
        msg.revision = self.repo.revision_of("instances", i.name)
        return msg

    def _node_pb(self, n: Node) -> pb.Node:
        msg = convert.node_to_pb(n)
        msg.revision = self.repo.revision_of("nodes", n.name)
        return msg

    def _stored_spec_bytes(self, name: str, spec: WorkloadSpec) -> int:
        hit = self._spec_sizes.get(name)
        if hit is None or hit[0] is not spec:
            hit = (spec, convert.spec_to_pb(spec).ByteSize())
            self._spec_sizes[name] = hit
        return hit[1]

    def _replicas(self, skip: str = "") -> int:
        return sum(w.spec.replicas for n, w in self.repo.workloads.items() if n != skip)

    def _check_spec_bytes(self, size: int, skip: str = "") -> None:
        workloads = self.repo.workloads
        total = size + sum(
            self._stored_spec_bytes(n, w.spec) for n, w in workloads.items() if n != skip
        )
        for gone in [n for n in self._spec_sizes if n not in workloads]:
            del self._spec_sizes[gone]
        limit = self.quotas.max_spec_bytes
        if total > limit:
            raise ResourceExhausted(
                f"quota max_spec_bytes: the workloads' specs would take {total} bytes, over the"
                f" cluster's limit of {limit} (this spec: {size} bytes)"
            )

    def _check_instances(self, replicas: int, skip: str = "") -> None:
        total = self._replicas(skip) + replicas
        limit = self.quotas.max_instances
        if total > limit:
            raise ResourceExhausted(
                f"quota max_instances: {total} replicas over all workloads would exceed the"
                f" cluster's limit of {limit}"
            )

    # ---- workloads ----

    async def CreateWorkload(self, request: pb.CreateWorkloadRequest, who: Identity) -> pb.Workload:
        spec = keep_redacted(None, convert.spec_from_pb(request.spec))
        workload: Workload | None = None

        def plan() -> list[Change]:
            nonlocal workload
            # The class is read in the plan: what is stored matches the class as committed.
            resolved = classes_api.resolve_class(self.repo, spec)
            workload = rollout.first_revision(
                Workload(spec=resolved, created_by=str(who), updated_by=str(who)), str(who)
            )
            if spec.name in self.repo.workloads:
                raise AlreadyExists(f"workload {spec.name!r} already exists")
            if len(self.repo.workloads) >= self.quotas.max_workloads:
                raise ResourceExhausted(
                    f"quota max_workloads: the cluster already holds {len(self.repo.workloads)}"
                    f" workloads, its limit is {self.quotas.max_workloads}"
                )
            self._check_instances(spec.replicas)
            self._check_spec_bytes(request.spec.ByteSize())
            return [Change("workloads", spec.name, workload, create=True)]

        await self.repo.mutate(plan)
        self.reconciler.kick()
        stored = self.repo.workloads.get(spec.name, workload)
        assert stored is not None  # the plan ran
        return self._workload_pb(stored)

    async def UpdateWorkload(self, request: pb.UpdateWorkloadRequest, who: Identity) -> pb.Workload:
        spec = convert.spec_from_pb(request.spec)

        def plan() -> list[Change]:
            old = self.repo.workloads.get(spec.name)
            if old is None:
                raise NotFound(f"workload {spec.name!r} not found")
            check_etag(request.etag, old.etag, f"workload {spec.name!r}")
            if old.deleting:
                raise Conflict(f"workload {spec.name!r} is being deleted")
            if old.spec.kind is not spec.kind:
                raise Invalid.at(
                    "spec.kind", f"cannot change from {old.spec.kind.value} to {spec.kind.value}"
                )
            new_spec = classes_api.resolve_class(self.repo, keep_redacted(old.spec, spec))
            if old.spec == new_spec:
                return []
            if spec.replicas > old.spec.replicas:
                self._check_instances(spec.replicas, skip=spec.name)
            size = request.spec.ByteSize()
            if size > self._stored_spec_bytes(spec.name, old.spec):
                self._check_spec_bytes(size, skip=spec.name)
            # Only a change to what runs needs new instances (a revision and its rollout);
            # replicas or the update strategy alone restart nothing.
            now = time.time()
            if rollout.runs_same(old.spec, new_spec):
                new = old.model_copy(
                    update={
                        "spec": new_spec,
                        "updated_at": now,
                        "updated_by": str(who),
                        "etag": new_workload_etag(),
                    }
                )
            else:
                new = rollout.new_revision(old, new_spec, str(who), now, "update")
            return [Change("workloads", spec.name, new)]

        await self.repo.mutate(plan)
        self.reconciler.kick()
        return self._workload_pb(self.repo.workloads[spec.name])

    async def GetWorkload(self, request: pb.GetWorkloadRequest, who: Identity) -> pb.Workload:
        w = self.repo.workloads.get(_name(request.name))
        if w is None:
            raise NotFound(f"workload {request.name!r} not found")
        return self._workload_pb(w)

    async def ListWorkloads(
        self, request: pb.ListWorkloadsRequest, who: Identity
    ) -> pb.ListWorkloadsResponse:
        page, token = self._page_by_name(
            "workloads", request, self._workload_pb, pb.Workload.ByteSize
        )
        return pb.ListWorkloadsResponse(
            workloads=page, next_page_token=token, revision=self.repo.revision
        )

    def _page_by_name(
        self,
        kind: Literal["workloads", "nodes"],
        request: pb.ListWorkloadsRequest | pb.ListNodesRequest,
        to_pb: Callable[[Any], Message],
        weigh: Callable[[Any], int],
    ) -> tuple[list[Any], str]:
        """A page of a table listed by name alone, and the token of the page after it."""
        size = paging.page_size(request.page_size)
        filters = paging.fingerprint(kind)
        start = paging.decode_token(request.page_token, filters, (str,))
        table = self.repo.workloads if kind == "workloads" else self.repo.nodes

        def pick(key: paging.Key) -> Message | None:
            value = table.get(key[0])
            return to_pb(value) if value is not None else None

        keys = paging.after(self.repo.order[kind], start)
        page, last = paging.take_page(keys, size, pick, weigh)
        return page, paging.encode_token(last, filters) if last else ""

    async def DeleteWorkload(
        self, request: pb.DeleteWorkloadRequest, who: Identity
    ) -> pb.DeleteWorkloadResponse:
        name = _name(request.name)

        def plan() -> list[Change]:
            w = self.repo.workloads.get(name)
            if w is None:
                raise NotFound(f"workload {name!r} not found")
            check_etag(request.etag, w.etag, f"workload {name!r}")
            if w.deleting and (w.delete_volumes or not request.with_volumes):
                return []
            new = w.model_copy(
                update={
                    "deleting": True,
                    "delete_volumes": w.delete_volumes or request.with_volumes,
                    "etag": new_workload_etag(),
                }
            )
            return [Change("workloads", name, new)]

        await self.repo.mutate(plan)
        self.reconciler.kick()
        w = self.repo.workloads.get(name)
        return pb.DeleteWorkloadResponse(workload=self._workload_pb(w) if w else None)

    # ---- instances ----

    async def ListInstances(
        self, request: pb.ListInstancesRequest, who: Identity
    ) -> pb.ListInstancesResponse:
        phase: InstancePhase | None = None
        if request.phase != pb.Instance.PHASE_UNSPECIFIED:
            phase = convert.phase_from_pb(request.phase)
        if request.workload:
            _name(request.workload, "workload")
        size = paging.page_size(request.page_size)
        filters = paging.fingerprint("instances", request.workload, request.node, request.phase)
        start = paging.decode_token(request.page_token, filters, (str, float, str))
        instances = self.repo.instances
        node = request.node

        def pick(key: paging.Key) -> pb.Instance | None:
            i = instances.get(key[2])
            if (
                i is None
                or (node and i.node != node)
                or (phase is not None and i.phase is not phase)
            ):
                return None
            return self._instance_pb(i)

        # The index is sorted by workload first: one workload's instances are one range.
        order = self.repo.order["instances"]
        if request.workload:
            workload = request.workload
            keys = itertools.takewhile(
                lambda k: k[0] == workload, paging.after(order, start, lower=(workload,))
            )
        else:
            keys = paging.after(order, start)
        page, last = paging.take_page(keys, size, pick, pb.Instance.ByteSize)
        return pb.ListInstancesResponse(
            instances=page,
            next_page_token=paging.encode_token(last, filters) if last else "",
            revision=self.repo.revision,
        )

    async def ListEndpoints(
        self, request: pb.ListEndpointsRequest, who: Identity
    ) -> pb.ListEndpointsResponse:
        """The workload's RUNNING instances and where each is reached: one range of the
        instance index (sorted by workload first), like ListInstances with a workload."""
        if not request.workload:
            raise Invalid.at("workload", "is required")
        workload = _name(request.workload, "workload")
        if workload not in self.repo.workloads:
            raise NotFound(f"workload {quote(workload)} not found")
        size = paging.page_size(request.page_size)
        filters = paging.fingerprint("endpoints", workload)
        start = paging.decode_token(request.page_token, filters, (str, float, str))
        instances = self.repo.instances

        def pick(key: paging.Key) -> pb.Endpoint | None:
            i = instances.get(key[2])
            if i is None or i.phase is not InstancePhase.RUNNING:
                return None
            return pb.Endpoint(
                instance=i.name,
                node=i.node,
                address=i.address,
                host_ip=i.host_ip,
                ports=[convert.binding_to_pb(b) for b in i.ports],
                revision=self.repo.revision_of("instances", i.name),
            )

        keys = itertools.takewhile(
            lambda k: k[0] == workload,
            paging.after(self.repo.order["instances"], start, lower=(workload,)),
        )
        page, last = paging.take_page(keys, size, pick, pb.Endpoint.ByteSize)
        return pb.ListEndpointsResponse(
            endpoints=page,
            next_page_token=paging.encode_token(last, filters) if last else "",
            revision=self.repo.revision,
        )

    # ---- views ----

    async def ListActivities(
        self, request: pb.ListActivitiesRequest, who: Identity
    ) -> pb.ListActivitiesResponse:
        return list_activities(self.activity, self.repo, request)

    async def GetInstance(self, request: pb.GetInstanceRequest, who: Identity) -> pb.Instance:
        if not request.name:
            raise Invalid.at("name", "is required")
        inst = self.repo.instances.get(request.name)
        if inst is None:
            raise NotFound(f"instance {quote(request.name)} not found")
        return self._instance_pb(inst)

    # ---- nodes ----

    def _node(self, name: str) -> Node:
        _name(name)
        node = self.repo.nodes.get(name)
        if node is None:
            raise NotFound(f"node {name!r} not found")
        return node

    async def ListNodes(self, request: pb.ListNodesRequest, who: Identity) -> pb.ListNodesResponse:
        page, token = self._page_by_name("nodes", request, self._node_pb, pb.Node.ByteSize)
        return pb.ListNodesResponse(nodes=page, next_page_token=token, revision=self.repo.revision)

    async def GetNode(self, request: pb.GetNodeRequest, who: Identity) -> pb.Node:
        return self._node_pb(self._node(request.name))

    async def _set_node(self, name: str, etag: str, schedulable: bool, draining: bool) -> pb.Node:
        self._node(name)

        def plan() -> list[Change]:
            node = self._node(name)
            check_etag(etag, node_etag(node), f"node {name!r}")
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
        return self._node_pb(self.repo.nodes[name])

    async def CordonNode(self, request: pb.CordonNodeRequest, who: Identity) -> pb.Node:
        return await self._set_node(request.name, request.etag, schedulable=False, draining=False)

    async def UncordonNode(self, request: pb.UncordonNodeRequest, who: Identity) -> pb.Node:
        return await self._set_node(request.name, request.etag, schedulable=True, draining=False)

    async def DrainNode(self, request: pb.DrainNodeRequest, who: Identity) -> pb.Node:
        return await self._set_node(request.name, request.etag, schedulable=False, draining=True)

    # ---- events ----

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, who: Identity
    ) -> AsyncIterator[pb.Event]:
        async for events in self._watch(request, limit=1):
            yield events[0]

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
        sub = self.events.subscribe(request.workload, request.since_revision)
        try:
            while True:
                first = await sub.queue.get()
                if first is None:
                    events, closed = [], True
                else:
                    events, closed = sub.take(first, limit, MAX_BATCH_BYTES)
                if events:
                    yield events
                if closed:
                    if sub.cut_off or sub.cut_off_bytes:
                        err = ResourceExhausted(
                            f"this subscriber fell {sub.cut_off} events behind"
                            f" ({sub.cut_off_bytes} bytes) and was cut off after revision"
                            f" {sub.sent}; watch again with since_revision={sub.sent}",
                            retry_after=1.0,
                        )
                        # For the error's details: where the watcher resumes.
                        err.last_revision = sub.sent
                        raise err
                    return
        except asyncio.CancelledError:
            raise
        finally:
            self.events.subscribers.discard(sub)
