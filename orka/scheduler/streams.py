"""The session relay: the controller's logs, exec and console sessions, carried over the
agent's own Connect stream.

A controller's `Session` call opens one session on the agent of a node (a fresh id, so one
node's sessions never mix with another's, and the agent's outputs are only taken for sessions
opened on its own stream). Flow control is credit: the agent may send `WINDOW` outputs ahead;
each output the controller has taken gives one back (granted in halves of the window), so at
most a window of outputs is queued here per session however slow the reader, and an agent
that sends past its credit ends the session with RESOURCE_EXHAUSTED. The agent's heartbeats
never wait behind a session: this side never stops reading the agent's stream.

The call ends with the session: after the agent's `end` (relayed as the last response), when
the agent's stream goes away (an UNAVAILABLE end), or when the controller cancels the call (the
agent is told to cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog
from google.rpc import code_pb2

from orka.api import agent_pb2 as apb
from orka.errors import Invalid, Unavailable
from orka.rpc import convert
from orka.scheduler.registry import Registry
from orka.scheduler.session import AgentSession, next_id

log = structlog.get_logger("orka.scheduler")

WINDOW = 16
MAX_INPUT_BYTES = 32 << 10
OPEN_TIMEOUT = 10.0


@dataclass
class _Relayed:
    agent: AgentSession
    outputs: asyncio.Queue[apb.SessionOutput] = field(default_factory=asyncio.Queue)
    ended: bool = False

    def finish(self, out: apb.SessionOutput) -> None:
        if not self.ended:
            self.ended = True
            self.outputs.put_nowait(out)


def _end(sid: str, code: int, message: str) -> apb.SessionOutput:
    return apb.SessionOutput(session=sid, end=convert.error_status(code, message))


class SessionRelay:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._open: dict[str, _Relayed] = {}

    def __len__(self) -> int:
        return len(self._open)

    # ---- from the agents (the gateway calls these) ----

    def on_output(self, agent: AgentSession, out: apb.SessionOutput) -> None:
        relayed = self._open.get(out.session)
        if relayed is None or relayed.agent is not agent or relayed.ended:
            return  # ended, cancelled, or not this agent's session
        if out.WhichOneof("body") == "end":
            relayed.finish(out)
        elif relayed.outputs.qsize() >= WINDOW:
            agent.send(_input(out.session, cancel=True))
            relayed.finish(
                _end(out.session, code_pb2.RESOURCE_EXHAUSTED, "the agent sent past its credit")
            )
        else:
            relayed.outputs.put_nowait(out)

    def agent_gone(self, agent: AgentSession) -> None:
        for sid, relayed in list(self._open.items()):
            if relayed.agent is agent:
                relayed.finish(
                    _end(sid, code_pb2.UNAVAILABLE, f"the agent of node {agent.node} went away")
                )

    # ---- the controller's call ----

    async def session(
        self,
        requests: AsyncIterator[apb.SessionRequest],
        admit: Callable[[int], None] = lambda term: None,
    ) -> AsyncIterator[apb.SessionResponse]:
        """Relay one session; `admit` sees the opening request's controller term first (and
        raises to refuse it: a stale controller opens nothing on a node)."""
        iterator = aiter(requests)
        try:
            async with asyncio.timeout(OPEN_TIMEOUT):
                first = await anext(iterator)
        except (StopAsyncIteration, TimeoutError):
            raise Invalid("a session starts with a request naming node and open") from None
        if not first.HasField("open") or not first.node:
            raise Invalid("the first session request must name node and open")
        admit(first.leader_term)
        record = self.registry.get(first.node)
        agent = record.session if record is not None else None
        if agent is None or agent.closed:
            raise Unavailable(f"node {first.node} is not connected to the scheduler")
        sid = next_id("s")
        relayed = _Relayed(agent)
        self._open[sid] = relayed
        opening = apb.SessionOpen()
        opening.CopyFrom(first.open)
        opening.session = sid
        opening.credit = WINDOW
        agent.send(apb.SchedulerMessage(session_open=opening))
        pump = asyncio.create_task(self._pump(iterator, relayed, sid))
        taken = 0
        try:
            while True:
                out = await relayed.outputs.get()
                if out.WhichOneof("body") == "end":
                    relayed.ended = True
                    yield apb.SessionResponse(output=out)
                    return
                yield apb.SessionResponse(output=out)
                taken += 1
                if taken >= WINDOW // 2:
                    agent.send(_input(sid, credit=taken))
                    taken = 0
        finally:
            self._open.pop(sid, None)
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            if not relayed.ended:
                relayed.ended = True
                agent.send(_input(sid, cancel=True))

    async def _pump(
        self, requests: AsyncIterator[apb.SessionRequest], relayed: _Relayed, sid: str
    ) -> None:
        """The controller's inputs (stdin, resize, close, console keys) to the agent."""
        try:
            async for req in requests:
                inp = req.input
                kind = inp.WhichOneof("body")
                if kind not in ("data", "resize", "close_input"):
                    raise Invalid("session input must be data, resize or close_input")
                if len(inp.data) > MAX_INPUT_BYTES:
                    raise Invalid(f"session input data: at most {MAX_INPUT_BYTES} bytes")
                forwarded = apb.SessionInput()
                forwarded.CopyFrom(inp)
                forwarded.session = sid
                relayed.agent.send(apb.SchedulerMessage(session_input=forwarded))
        except Invalid as err:
            relayed.agent.send(_input(sid, cancel=True))
            relayed.finish(_end(sid, code_pb2.INVALID_ARGUMENT, err.message))


def _input(sid: str, credit: int = 0, cancel: bool = False) -> apb.SchedulerMessage:
    if cancel:
        return apb.SchedulerMessage(session_input=apb.SessionInput(session=sid, cancel=True))
    return apb.SchedulerMessage(session_input=apb.SessionInput(session=sid, credit=credit))
