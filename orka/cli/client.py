"""The admin client every user-facing command uses: one mutual-TLS channel to the controller."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.errors import Invalid, OrkaError, Unavailable
from orka.models import Instance, InstancePhase, Node, Workload, WorkloadSpec
from orka.rpc import convert
from orka.rpc.client import call, secure_channel
from orka.security.tls import TlsFiles

Req = TypeVar("Req")
Resp = TypeVar("Resp")

RPC_TIMEOUT = 15.0


def admin_tls(certs: Path) -> TlsFiles:
    try:
        return TlsFiles.for_service(certs, "admin", "admin")
    except Invalid as e:
        raise Invalid(
            f"{e.message} (run `orka up`, or `orka certs init --dir {certs}`, "
            "or point --certs / ORKA_CERTS at your cluster's certs)"
        ) from None


class AdminClient:
    def __init__(self, address: str, certs: Path, timeout: float = RPC_TIMEOUT) -> None:
        self.address = address
        self.certs = certs
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ControllerStub | None = None

    async def __aenter__(self) -> AdminClient:
        self._channel = secure_channel(self.address, admin_tls(self.certs))
        self._stub = pb_grpc.ControllerStub(self._channel)
        return self

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

    async def _call(
        self, method: Callable[..., Awaitable[Resp]], request: Req, timeout: float | None = None
    ) -> Resp:
        try:
            return await call(method, request, timeout=timeout or self.timeout)
        except Unavailable as e:
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
            self.stub.CreateWorkload, pb.CreateWorkloadRequest(spec=convert.spec_to_pb(spec))
        )
        return convert.workload_from_pb(msg)

    async def update_workload(self, spec: WorkloadSpec) -> Workload:
        msg = await self._call(
            self.stub.UpdateWorkload, pb.UpdateWorkloadRequest(spec=convert.spec_to_pb(spec))
        )
        return convert.workload_from_pb(msg)

    async def get_workload(self, name: str) -> Workload:
        msg = await self._call(self.stub.GetWorkload, pb.GetWorkloadRequest(name=name))
        return convert.workload_from_pb(msg)

    async def list_workloads(self) -> list[Workload]:
        resp = await self._call(self.stub.ListWorkloads, pb.ListWorkloadsRequest())
        return [convert.workload_from_pb(w) for w in resp.workloads]

    async def delete_workload(self, name: str) -> Workload | None:
        resp = await self._call(self.stub.DeleteWorkload, pb.DeleteWorkloadRequest(name=name))
        return convert.workload_from_pb(resp.workload) if resp.HasField("workload") else None

    async def list_instances(
        self, workload: str = "", node: str = "", phase: InstancePhase | None = None
    ) -> list[Instance]:
        req = pb.ListInstancesRequest(workload=workload, node=node)
        if phase is not None:
            req.phase = convert.phase_to_pb(phase)
        resp = await self._call(self.stub.ListInstances, req)
        return [convert.instance_from_pb(i) for i in resp.instances]

    async def get_instance(self, name: str) -> Instance:
        msg = await self._call(self.stub.GetInstance, pb.GetInstanceRequest(name=name))
        return convert.instance_from_pb(msg)

    async def list_nodes(self, timeout: float | None = None) -> list[Node]:
        resp = await self._call(self.stub.ListNodes, pb.ListNodesRequest(), timeout=timeout)
        return [convert.node_from_pb(n) for n in resp.nodes]

    async def get_node(self, name: str) -> Node:
        return convert.node_from_pb(
            await self._call(self.stub.GetNode, pb.GetNodeRequest(name=name))
        )

    async def cordon(self, name: str) -> Node:
        return convert.node_from_pb(
            await self._call(self.stub.CordonNode, pb.CordonNodeRequest(name=name))
        )

    async def uncordon(self, name: str) -> Node:
        return convert.node_from_pb(
            await self._call(self.stub.UncordonNode, pb.UncordonNodeRequest(name=name))
        )

    async def drain(self, name: str) -> Node:
        return convert.node_from_pb(
            await self._call(self.stub.DrainNode, pb.DrainNodeRequest(name=name))
        )
