"""The admin client every user-facing command uses: one mutual-TLS channel to the controller.

`--controller` may list several controllers (`a:7443,b:7443`): only the leader answers, and a
follower's UNAVAILABLE (ErrorInfo reason NOT_LEADER, `orka.errors.NotLeader`) carries the
leader's HOST:PORT in its ErrorInfo metadata, so the client moves to that leader, or down the
list when a controller cannot be reached at all or names no leader. Either answer means the
request was not acted on, so trying it elsewhere is safe. The message is for people; nothing
here reads it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc
from pydantic import BaseModel

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.errors import Invalid, NotLeader, OrkaError, Unavailable, from_rpc_error
from orka.models import (
    Endpoint,
    Instance,
    InstancePhase,
    Node,
    Revision,
    Volume,
    VolumeSpec,
    Workload,
    WorkloadSpec,
)
from orka.rpc import convert, convert_volumes
from orka.rpc.client import call, refused_role, secure_channel
from orka.rpc.pages import list_all
from orka.security.tls import TlsFiles

Req = TypeVar("Req")
Change = Workload | Instance | Node
Resp = TypeVar("Resp")

RPC_TIMEOUT = 15.0


@dataclass(frozen=True, slots=True)
class WatchedChange:
    """One event of WatchEvents as domain types: `type` is ADDED, MODIFIED or DELETED, `kind`
    workload, instance or node, `obj` the object as written (its last state for DELETED)."""

    type: str
    kind: str
    obj: Change
    revision: int


def change_from_pb(ev: pb.Event) -> WatchedChange | None:
    kind = ev.WhichOneof("object")
    if kind is None:
        return None  # a kind this client does not know yet
    msg = getattr(ev, kind)
    convert_one: Callable[..., Change] = {
        "workload": convert.workload_from_pb,
        "instance": convert.instance_from_pb,
        "node": convert.node_from_pb,
    }[kind]
    return WatchedChange(pb.Event.Type.Name(ev.type), kind, convert_one(msg), ev.revision)


class Activity(BaseModel):
    """One entry of an object's recent activity (ListActivities), as `orka describe` shows it."""

    type: str
    reason: str
    message: str
    count: int = 1
    first_at: float | None = None
    last_at: float | None = None


def activity_from_pb(msg: pb.Activity) -> Activity:
    return Activity(
        type=pb.Activity.Type.Name(msg.type).title(),
        reason=msg.reason,
        message=msg.message,
        count=msg.count,
        first_at=convert.seconds_from_pb(msg.first_time),
        last_at=convert.seconds_from_pb(msg.last_time),
    )


def admin_tls(certs: Path) -> TlsFiles:
    return client_tls(certs, ("admin", "admin"))


def client_tls(certs: Path, identity: tuple[str, str]) -> TlsFiles:
    """The pair of `identity` (role, name) in `certs`, as `orka certs` wrote it."""
    role, name = identity
    try:
        return TlsFiles.for_service(certs, role, name)
    except Invalid as e:
        if identity == ("admin", "admin"):
            hint = (
                f"run `orka up`, or `orka certs init --dir {certs}`, "
                "or point --certs / ORKA_CERTS at your cluster's certs"
            )
        else:
            hint = (
                f"issue it with `orka certs issue --dir {certs} --role {role} --name {name}`, "
                "or pick another with --identity / ORKA_IDENTITY"
            )
        raise Invalid(f"{e.message} ({hint})") from None


class AdminClient:
    def __init__(
        self,
        address: str,
        certs: Path,
        timeout: float = RPC_TIMEOUT,
        identity: tuple[str, str] = ("admin", "admin"),
    ) -> None:
        self.identity = identity
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.address = self.addresses[0]
        self.certs = certs
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ControllerStub | None = None

    async def __aenter__(self) -> AdminClient:
        self._connect(self.address)
        return self

    def _connect(self, address: str) -> None:
        self.address = address
        self._channel = secure_channel(
            address,
            client_tls(self.certs, self.identity),
            "controller",
            bulk=True,
            # Every answer of the public API fits gRPC's default limit: lists are paged.
            max_receive=None,
        )
        self._stub = pb_grpc.ControllerStub(self._channel)

    async def _switch(self, address: str) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._connect(address)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def stub(self) -> pb_grpc.ControllerStub:
        if self._stub is None:
            raise RuntimeError("AdminClient used outside `async with`")
        return self._stub

    async def _call(self, name: str, request: Req, timeout: float | None = None) -> Resp:
        """Call RPC `name` on the leader: follow a follower's redirect, or try the next address
        when one cannot be reached; every address is tried at most about twice."""
        tried: list[str] = []
        last: Unavailable | None = None
        for _ in range(2 * len(self.addresses) + 1):
            try:
                return await self._call_once(name, request, timeout)
            except Unavailable as e:
                last = e
                tried.append(self.address)
                leader = e.leader if isinstance(e, NotLeader) else None
                if leader is not None and tried.count(leader) < 2:
                    await self._switch(leader)
                    continue
                untried = [a for a in self.addresses if a not in tried]
                if not untried:
                    break
                await self._switch(untried[0])
        assert last is not None
        raise last

    async def _call_once(self, name: str, request: Req, timeout: float | None) -> Resp:
        method: Callable[..., Awaitable[Resp]] = getattr(self.stub, name)
        try:
            return await call(method, request, timeout=timeout or self.timeout)
        except NotLeader as e:
            raise NotLeader(
                f"controller {self.address}: {e.message}",
                metadata=e.metadata,
                retry_after=e.retry_after,
            ) from None
        except Unavailable as e:
            refused = refused_role(e.message, "controller")
            if refused is not None:
                raise Unavailable(
                    f"refusing the server at {self.address}: {refused}; it is not this "
                    "cluster's controller"
                ) from None
            raise Unavailable(
                f"cannot reach the controller at {self.address}: {e.message}"
            ) from None
        except OrkaError as e:
            if e.message == "Deadline Exceeded":
                raise Unavailable(
                    f"the controller at {self.address} did not answer within "
                    f"{timeout or self.timeout:g}s"
                ) from None
            raise

    async def create_workload(self, spec: WorkloadSpec) -> Workload:
        msg = await self._call(
            "CreateWorkload", pb.CreateWorkloadRequest(spec=convert.spec_to_pb(spec))
        )
        return convert.workload_from_pb(msg)

    async def update_workload(self, spec: WorkloadSpec, etag: str = "") -> Workload:
        """`etag`: change the workload only if it still has this one (else Aborted)."""
        msg = await self._call(
            "UpdateWorkload", pb.UpdateWorkloadRequest(spec=convert.spec_to_pb(spec), etag=etag)
        )
        return convert.workload_from_pb(msg)

    async def get_workload(self, name: str) -> Workload:
        msg = await self._call("GetWorkload", pb.GetWorkloadRequest(name=name))
        return convert.workload_from_pb(msg)

    async def _list(
        self, name: str, request: Req, field: str, timeout: float | None = None
    ) -> list[object]:
        """Every page of List RPC `name` (each page through `_call`, so a page whose leader
        moved is asked again of the new one; the token is valid there too)."""

        async def page(req: Req) -> object:
            return await self._call(name, req, timeout)

        items, _ = await list_all(page, request, field)
        return items

    async def list_at(
        self, kind: str, workload: str = "", node: str = "", phase: InstancePhase | None = None
    ) -> tuple[list[tuple[int, Change]], int]:
        """Every object of `kind` (workloads, instances, nodes) with its revision, and the
        revision to watch from (the first page's, see proto/controller.proto)."""

        async def page(req: Req) -> object:
            return await self._call(rpc, req)

        if kind == "workloads":
            rpc, req, field, conv = (
                "ListWorkloads",
                pb.ListWorkloadsRequest(),
                "workloads",
                convert.workload_from_pb,
            )
        elif kind == "instances":
            req = pb.ListInstancesRequest(workload=workload, node=node)
            if phase is not None:
                req.phase = convert.phase_to_pb(phase)
            rpc, field, conv = "ListInstances", "instances", convert.instance_from_pb
        else:
            req = pb.ListNodesRequest()
            rpc, field, conv = "ListNodes", "nodes", convert.node_from_pb
        items, revision = await list_all(page, req, field)
        return [(m.revision, conv(m)) for m in items], revision

    async def list_activities(self, kind: str, name: str) -> list[Activity]:
        """The object's recent activity, newest first; `kind` workload, instance or node."""
        req = pb.ListActivitiesRequest(object=f"{kind}/{name}")
        items = await self._list("ListActivities", req, "activities")
        return [activity_from_pb(a) for a in items]  # type: ignore[arg-type]

    async def watch(self, since_revision: int, workload: str = "") -> AsyncIterator[WatchedChange]:
        """WatchEvents from `since_revision` (0: from now), as domain types; runs until the
        stream ends. A failure raises the OrkaError the server sent (OutOfRange: list again)."""
        stream = self.stub.WatchEvents(
            pb.WatchEventsRequest(workload=workload, since_revision=since_revision)
        )
        try:
            async for ev in stream:
                change = change_from_pb(ev)
                if change is not None:
                    yield change
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        finally:
            stream.cancel()

    async def list_workloads(self) -> list[Workload]:
        items = await self._list("ListWorkloads", pb.ListWorkloadsRequest(), "workloads")
        return [convert.workload_from_pb(w) for w in items]  # type: ignore[arg-type]

    async def delete_workload(
        self, name: str, etag: str = "", with_volumes: bool = False
    ) -> Workload | None:
        req = pb.DeleteWorkloadRequest(name=name, etag=etag, with_volumes=with_volumes)
        resp = await self._call("DeleteWorkload", req)
        return convert.workload_from_pb(resp.workload) if resp.HasField("workload") else None

    # ---- volumes ----

    async def create_volume(self, spec: VolumeSpec) -> Volume:
        req = pb.CreateVolumeRequest(spec=convert_volumes.spec_to_pb(spec))
        return convert_volumes.volume_from_pb(await self._call("CreateVolume", req))

    async def get_volume(self, name: str) -> Volume:
        msg = await self._call("GetVolume", pb.GetVolumeRequest(name=name))
        return convert_volumes.volume_from_pb(msg)

    async def list_volumes(self, node: str = "", workload: str = "") -> list[Volume]:
        req = pb.ListVolumesRequest(node=node, workload=workload)
        items = await self._list("ListVolumes", req, "volumes")
        return [convert_volumes.volume_from_pb(v) for v in items]  # type: ignore[arg-type]

    async def delete_volume(self, name: str, etag: str = "") -> Volume:
        msg = await self._call("DeleteVolume", pb.DeleteVolumeRequest(name=name, etag=etag))
        return convert_volumes.volume_from_pb(msg)

    async def list_instances(
        self, workload: str = "", node: str = "", phase: InstancePhase | None = None
    ) -> list[Instance]:
        req = pb.ListInstancesRequest(workload=workload, node=node)
        if phase is not None:
            req.phase = convert.phase_to_pb(phase)
        items = await self._list("ListInstances", req, "instances")
        return [convert.instance_from_pb(i) for i in items]  # type: ignore[arg-type]

    async def list_endpoints(self, workload: str) -> list[Endpoint]:
        req = pb.ListEndpointsRequest(workload=workload)
        items = await self._list("ListEndpoints", req, "endpoints")
        return [convert.endpoint_from_pb(e) for e in items]  # type: ignore[arg-type]

    async def get_instance(self, name: str) -> Instance:
        msg = await self._call("GetInstance", pb.GetInstanceRequest(name=name))
        return convert.instance_from_pb(msg)

    async def list_nodes(self, timeout: float | None = None) -> list[Node]:
        items = await self._list("ListNodes", pb.ListNodesRequest(), "nodes", timeout)
        return [convert.node_from_pb(n) for n in items]  # type: ignore[arg-type]

    async def get_node(self, name: str) -> Node:
        return convert.node_from_pb(await self._call("GetNode", pb.GetNodeRequest(name=name)))

    async def cordon(self, name: str, etag: str = "") -> Node:
        req = pb.CordonNodeRequest(name=name, etag=etag)
        return convert.node_from_pb(await self._call("CordonNode", req))

    async def uncordon(self, name: str, etag: str = "") -> Node:
        req = pb.UncordonNodeRequest(name=name, etag=etag)
        return convert.node_from_pb(await self._call("UncordonNode", req))

    async def drain(self, name: str, etag: str = "") -> Node:
        req = pb.DrainNodeRequest(name=name, etag=etag)
        return convert.node_from_pb(await self._call("DrainNode", req))

    # ---- rollout ----

    async def list_revisions(self, name: str) -> list[Revision]:
        resp = await self._call("ListWorkloadRevisions", pb.ListWorkloadRevisionsRequest(name=name))
        return [convert.revision_from_pb(r) for r in resp.revisions]

    async def rollback(self, name: str, revision: int = 0, etag: str = "") -> Workload:
        req = pb.RollbackWorkloadRequest(name=name, revision=revision, etag=etag)
        return convert.workload_from_pb(await self._call("RollbackWorkload", req))

    async def rollout_action(self, action: str, name: str) -> Workload:
        """`action`: Pause, Resume or Promote."""
        req = getattr(pb, f"{action}RolloutRequest")(name=name)
        return convert.workload_from_pb(await self._call(f"{action}Rollout", req))
