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
from typing import TYPE_CHECKING, Any

import grpc

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Conflict, Invalid, NotFound, Unavailable, from_rpc_error, from_status
from orka.models import Instance, NodeState, WorkloadKind
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
    await queue.put(apb.SessionRequest(node=node, open=opening, leader_term=api.link.term))

    async def feed() -> None:
        async for inp in inputs:
            await queue.put(apb.SessionRequest(input=inp))

    async def requests() -> AsyncIterator[apb.SessionRequest]:
        while (req := await queue.get()) is not None:
            yield req

    feeder = asyncio.create_task(feed())
    call = stub.Session(requests())
    # Bad input from the client ends the call with what was wrong.
    feeder.add_done_callback(lambda t: t.cancelled() or t.exception() is None or call.cancel())
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
    except asyncio.CancelledError:
        if feeder.done() and not feeder.cancelled() and feeder.exception() is not None:
            raise feeder.exception() from None  # type: ignore[misc]
        raise
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


MAX_COMMAND_ARGS = 1024
MAX_COMMAND_BYTES = 64 << 10
MAX_INPUT_BYTES = 32 << 10
MAX_TERMINAL = 10_000
FIRST_TIMEOUT = 10.0


def _check_size(size: pb.TerminalSize, field: str) -> None:
    if size.rows > MAX_TERMINAL or size.cols > MAX_TERMINAL:
        raise Invalid.at(field, f"rows and cols must be at most {MAX_TERMINAL}")


async def _first(requests: AsyncIterator[Any], what: str) -> Any:
    try:
        async with asyncio.timeout(FIRST_TIMEOUT):
            return await anext(aiter(requests))
    except (StopAsyncIteration, TimeoutError):
        raise Invalid(f"{what}: the first message must come within {FIRST_TIMEOUT:g}s") from None


async def exec_instance(
    api: ControllerApi, requests: AsyncIterator[pb.ExecInstanceRequest], who: Identity
) -> AsyncIterator[pb.ExecResponse]:
    await api.gate()
    first = await _first(requests, "exec")
    if first.WhichOneof("body") != "start":
        raise Invalid.at("start", "the first exec message must be start")
    start = first.start
    if not start.command:
        raise Invalid.at("start.command", "is required")
    if len(start.command) > MAX_COMMAND_ARGS:
        raise Invalid.at("start.command", f"at most {MAX_COMMAND_ARGS} arguments")
    if sum(len(a.encode()) for a in start.command) > MAX_COMMAND_BYTES:
        raise Invalid.at("start.command", f"at most {MAX_COMMAND_BYTES} bytes")
    if not start.command[0]:
        raise Invalid.at("start.command[0]", "must not be empty")
    _check_size(start.size, "start.size")
    _, node = _instance(api, start.instance, "start.instance")

    async def inputs() -> AsyncIterator[apb.SessionInput]:
        async for req in requests:
            kind = req.WhichOneof("body")
            if kind == "stdin":
                if len(req.stdin) > MAX_INPUT_BYTES:
                    raise Invalid.at("stdin", f"at most {MAX_INPUT_BYTES} bytes a message")
                yield apb.SessionInput(data=req.stdin)
            elif kind == "resize":
                _check_size(req.resize, "resize")
                yield apb.SessionInput(resize=req.resize)
            elif kind == "close_stdin":
                yield apb.SessionInput(close_input=True)
            else:
                raise Invalid.at(kind or "body", "only the first exec message may be start")

    async for out in relay(api, node, apb.SessionOpen(exec=start), inputs()):
        yield out.exec


async def attach_console(
    api: ControllerApi, requests: AsyncIterator[pb.AttachConsoleRequest], who: Identity
) -> AsyncIterator[pb.AttachConsoleResponse]:
    await api.gate()
    first = await _first(requests, "console")
    if first.WhichOneof("body") != "instance":
        raise Invalid.at("instance", "the first console message must name the instance")
    inst, node = _instance(api, first.instance)
    workload = api.repo.workloads.get(inst.workload)
    if workload is not None and workload.spec.kind is not WorkloadKind.VM:
        raise Conflict(
            f"instance {quote(inst.name)} is a {workload.spec.kind.value}: only VMs have a"
            " console (use exec)"
        )

    async def inputs() -> AsyncIterator[apb.SessionInput]:
        async for req in requests:
            if req.WhichOneof("body") != "input":
                raise Invalid.at("instance", "only the first console message names the instance")
            if len(req.input) > MAX_INPUT_BYTES:
                raise Invalid.at("input", f"at most {MAX_INPUT_BYTES} bytes a message")
            yield apb.SessionInput(data=req.input)

    async for out in relay(api, node, apb.SessionOpen(console=inst.name), inputs()):
        yield pb.AttachConsoleResponse(output=out.console)
