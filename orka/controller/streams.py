"""The streaming RPCs that reach into instances: logs (and exec, console), relayed through
the scheduler to the agent of the instance's node (orka/scheduler/streams.py).

The controller finds the instance and its node, refuses at once what cannot work (an unknown
instance, NOT_FOUND; one not placed yet, FAILED_PRECONDITION; one whose node is lost or gone,
UNAVAILABLE), and opens a session with the scheduler's `Session` call. The agent's end status
becomes this call's status; the client going away cancels the scheduler call, which cancels
the session on the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Conflict, Invalid, NotFound, Unavailable, from_rpc_error, from_status
from orka.models import Instance, NodeState
from orka.security.identity import Identity
from orka.validation import quote

if TYPE_CHECKING:
    from orka.controller.api import ControllerApi

_CODES = {c.value[0]: c for c in grpc.StatusCode}
MAX_TAIL_LINES = 1_000_000


def _instance(api: ControllerApi, name: str, field: str = "instance") -> tuple[Instance, str]:
    """The instance and its node, if a session can reach it now."""
    if not name:
        raise Invalid.at(field, "is required")
    inst = api.repo.instances.get(name)
    if inst is None:
        raise NotFound(f"instance {quote(name)} not found")
    if not inst.node:
        raise Conflict(f"instance {quote(name)} is not on a node yet (phase {inst.phase.value})")
    node = api.repo.nodes.get(inst.node)
    if node is None or node.state in (NodeState.LOST, NodeState.LEFT):
        state = node.state.value if node is not None else "gone"
        raise Unavailable(
            f"instance {quote(name)} is on node {inst.node}, which is {state}:"
            " its agent cannot be reached"
        )
    return inst, inst.node


async def relay(
    api: ControllerApi, node: str, opening: apb.SessionOpen, inputs: AsyncIterator[apb.SessionInput]
) -> AsyncIterator[apb.SessionOutput]:
    """One session: its outputs until the agent's end (OK returns, otherwise raises it)."""
    stub = api.link.stub()
    queue: asyncio.Queue[apb.SessionRequest | None] = asyncio.Queue(4)
    await queue.put(apb.SessionRequest(node=node, open=opening))

    async def feed() -> None:
        async for inp in inputs:
            await queue.put(apb.SessionRequest(input=inp))

    async def requests() -> AsyncIterator[apb.SessionRequest]:
        while (req := await queue.get()) is not None:
            yield req

    feeder = asyncio.create_task(feed())
    call = stub.Session(requests())
    try:
        async for resp in call:
            out = resp.output
            if out.WhichOneof("body") == "end":
                if out.end.code:
                    code = _CODES.get(out.end.code, grpc.StatusCode.UNKNOWN)
                    raise from_status(code, out.end.message, out.end)
                return
            yield out
        raise Unavailable(f"the session with node {node} ended without an answer")
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None
    finally:
        call.cancel()
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await feeder


async def _nothing() -> AsyncIterator[apb.SessionInput]:
    return
    yield  # pragma: no cover


async def read_logs(
    api: ControllerApi, request: pb.ReadLogsRequest, who: Identity
) -> AsyncIterator[pb.LogChunk]:
    await api.gate()
    if request.tail_lines < 0 or request.tail_lines > MAX_TAIL_LINES:
        raise Invalid.at("tail_lines", f"must be between 0 and {MAX_TAIL_LINES}")
    if request.stream not in pb.LogChunk.Stream.values():
        raise Invalid.at("stream", f"unknown stream {request.stream}")
    if request.HasField("since_time") and request.since_time.seconds < 0:
        raise Invalid.at("since_time", "must be after 1970")
    _, node = _instance(api, request.instance)
    async for out in relay(api, node, apb.SessionOpen(logs=request), _nothing()):
        yield out.log
