"""The soak's users: workloads created, scaled and deleted one request at a time, every answer
recorded, so the invariant checker knows what the cluster acknowledged.

A request ends one of three ways: `ok` (acknowledged: it must not be lost), `failed` (a definite
refusal: NotFound, AlreadyExists, a follower's NOT_LEADER: nothing happened) or `unknown` (a
timeout or a lost connection: it may or may not have landed, now or later).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.errors import NotLeader, from_rpc_error
from orka.rpc.client import secure_channel
from orka.security.tls import TlsFiles

# Codes that say the request was refused as a whole (nothing stored).
DEFINITE = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
ABSENT = -1  # the "replicas" of a deleted (or never created) workload
WAIT_SECONDS = 8  # max_disconnect of the workloads that wait for a lost node


@dataclass
class Op:
    name: str
    kind: str  # create | scale | delete
    replicas: int  # ABSENT for a delete
    started: float
    ended: float = 0.0
    outcome: str = "pending"  # ok | failed | unknown
    error: str = ""


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)

    def of(self, name: str) -> list[Op]:
        return [op for op in self.ops if op.name == name]

    def names(self) -> set[str]:
        return {op.name for op in self.ops}

    def candidates(self, name: str, at: float | None = None) -> set[int]:
        """What the store may hold for `name` at `at` (default: now): the state of its last
        acknowledged request before then, or that of any request after it whose outcome is
        unknown (it may have landed, even later)."""
        state, maybe = {ABSENT}, set[int]()
        for op in self.of(name):
            if at is not None and op.started > at:
                break
            if op.outcome == "ok" and (at is None or op.ended <= at):
                state, maybe = {op.replicas}, set()
            elif op.outcome in ("unknown", "pending") or (
                op.outcome == "ok" and at is not None and op.ended > at
            ):
                maybe.add(op.replicas)
        return state | maybe

    def allowed(self, name: str, now: float, grace: float) -> int:
        """The most copies `name` may run at `now`: any state it could have had within the
        last `grace` seconds (a scale-down takes a moment to stop what it removes)."""
        most = max(self.candidates(name, now - grace))
        for op in self.of(name):
            if now - grace <= op.started <= now:
                most = max(most, op.replicas)
        return max(most, 0)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.outcome] = out.get(op.outcome, 0) + 1
        return out


def spec(name: str, replicas: int) -> pb.WorkloadSpec:
    """Every other workload waits out a lost node (`on_node_lost: wait`) for a few seconds,
    so partitions and pauses hit both policies."""
    out = pb.WorkloadSpec(
        name=name, kind=pb.WorkloadSpec.PROCESS, command=["sleep", "3600"], replicas=replicas
    )
    if int(name.rsplit("-", 1)[-1]) % 2:
        out.on_node_lost = pb.WorkloadSpec.ON_NODE_LOST_WAIT
        out.max_disconnect.FromSeconds(WAIT_SECONDS)
    return out


class Client:
    """Talks to whichever controller leads: a follower's NOT_LEADER names it."""

    def __init__(self, certs: Path, controllers: list[str]) -> None:
        self.tls = TlsFiles.for_service(certs, "admin", "admin")
        self.controllers = controllers
        self.current = controllers[0]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str | None = None) -> pb_grpc.ControllerStub:
        address = address or self.current
        if address not in self._channels:
            self._channels[address] = secure_channel(address, self.tls, "controller")
        return pb_grpc.ControllerStub(self._channels[address])

    def follow(self, err: grpc.aio.AioRpcError) -> None:
        error = from_rpc_error(err)
        leader = error.metadata.get("leader") if isinstance(error, NotLeader) else None
        if leader in self.controllers:
            self.current = leader
        else:
            others = [c for c in self.controllers if c != self.current]
            self.current = random.choice(others or self.controllers)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class Load:
    """Sends one request at a time to random workloads of `names` until stopped."""

    def __init__(self, client: Client, names: list[str], seed: int, timeout: float = 4.0) -> None:
        self.client = client
        self.names = names
        self.random = random.Random(seed)
        self.timeout = timeout
        self.history = History()
        self.stopping = asyncio.Event()
        # What the user last learnt of each workload (an answer, a NotFound, an AlreadyExists;
        # an unknown outcome counts as landed): what the next request is chosen by. Not the
        # checker's `candidates`, which must keep every state that may still land: choosing by
        # those, a user whose create timed out would scale a missing workload forever.
        self.exists: dict[str, bool] = {}

    def _next(self) -> Op:
        name = self.random.choice(self.names)
        exists = self.exists.get(name, False)
        now = time.monotonic()
        if not exists:
            return Op(name, "create", self.random.randint(1, 3), now)
        if self.random.random() < 0.25:
            return Op(name, "delete", ABSENT, now)
        return Op(name, "scale", self.random.randint(0, 4), now)

    async def _send(self, op: Op) -> None:
        api = self.client.stub()
        if op.kind == "create":
            req = pb.CreateWorkloadRequest(spec=spec(op.name, op.replicas))
            await api.CreateWorkload(req, timeout=self.timeout)
        elif op.kind == "scale":
            current = await api.GetWorkload(
                pb.GetWorkloadRequest(name=op.name), timeout=self.timeout
            )
            new = pb.WorkloadSpec()
            new.CopyFrom(current.spec)
            new.replicas = op.replicas
            await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=new), timeout=self.timeout)
        else:
            await api.DeleteWorkload(pb.DeleteWorkloadRequest(name=op.name), timeout=self.timeout)

    async def one(self) -> Op:
        op = self._next()
        self.history.ops.append(op)
        try:
            await self._send(op)
            op.outcome = "ok"
            self.exists[op.name] = op.kind != "delete"
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err)
            op.error = f"{err.code().name}: {error.message}"[:200]
            if err.code() in DEFINITE or isinstance(error, NotLeader):
                op.outcome = "failed"
            else:
                op.outcome = "unknown"
                self.exists[op.name] = op.kind != "delete"
            if err.code() == grpc.StatusCode.NOT_FOUND:
                self.exists[op.name] = False
            elif err.code() == grpc.StatusCode.ALREADY_EXISTS:
                self.exists[op.name] = True
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.client.follow(err)
        op.ended = time.monotonic()
        return op

    async def run(self, pace: float = 0.3) -> None:
        while not self.stopping.is_set():
            op = await self.one()
            if op.outcome != "ok":
                await asyncio.sleep(0.2)
            await asyncio.sleep(self.random.uniform(0, 2 * pace))
