"""One connected agent: its outbound queue and the replies the scheduler is waiting for."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from google.rpc import code_pb2, status_pb2

from orka.api import agent_pb2 as apb
from orka.errors import Invalid, OrkaError
from orka.rpc import convert

_ids = itertools.count(1)
# A deadline moves on by at most this many times its length while the scheduler is behind.
MAX_EXCUSE = 4


def next_id(prefix: str) -> str:
    return f"{prefix}{next(_ids)}"


@dataclass(frozen=True, slots=True)
class Reply:
    """The agent's answer (its google.rpc.Status), or what stood in for one."""

    status: status_pb2.Status
    # False when no answer came: the agent may or may not have acted on the message.
    answered: bool = True

    @property
    def ok(self) -> bool:
        return convert.status_ok(self.status)

    @property
    def reason(self) -> str:
        return self.status.message


DISCONNECTED = Reply(
    convert.error_status(code_pb2.UNAVAILABLE, "agent disconnected"), answered=False
)
TIMED_OUT = Reply(convert.error_status(code_pb2.DEADLINE_EXCEEDED, "timed out"), answered=False)


@dataclass(frozen=True, slots=True)
class Expected:
    """A message sent with `AgentSession.expect`, whose reply is awaited through `replies`."""

    session: AgentSession
    key: str
    reply: asyncio.Future[Reply]


async def replies(
    pending: list[Expected], timeout: float, behind: Callable[[], float] | None = None
) -> list[Reply]:
    """The replies to many `expect`ed messages under one deadline: a batch waits once,
    without a task or a timer per message.

    `behind()`: how many seconds late this scheduler reads its agents' streams now (0 when
    it keeps up). While it is behind, a reply not in yet may be waiting unread in its own
    buffers, so the deadline moves on by that much, up to MAX_EXCUSE timeouts in all: an
    offer counted as unanswered is offered to another node, more work for a scheduler
    already behind, which then reads even later (liveness excuses silence the same way)."""
    waiting = [e.reply for e in pending if not e.reply.done()]
    if waiting:
        _, left = await asyncio.wait(waiting, timeout=timeout)
        excused = 0.0
        while left and behind is not None and excused < MAX_EXCUSE * timeout:
            lag = min(behind(), MAX_EXCUSE * timeout - excused)
            if lag <= 0:
                break
            excused += lag
            _, left = await asyncio.wait(left, timeout=lag)
    out = []
    for e in pending:
        e.session.forget(e.key)
        out.append(e.reply.result() if e.reply.done() else TIMED_OUT)
    return out


class AgentSession:
    def __init__(self, node: str) -> None:
        self.node = node
        self.outbox: asyncio.Queue[apb.SchedulerMessage | None] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Future[Reply]] = {}
        self.closed = False
        self.left = False
        # Why the agent's input was refused; the stream ends with `error_type`'s code (an
        # OrkaError class: INVALID_ARGUMENT, or PERMISSION_DENIED for a reserved label) and this.
        self.error = ""
        self.error_type: type[OrkaError] = Invalid

    def send(self, msg: apb.SchedulerMessage) -> None:
        if not self.closed:
            self.outbox.put_nowait(msg)

    def expect(self, msg: apb.SchedulerMessage, key: str, send: bool = True) -> Expected:
        """Send a message whose reply carries `key` (an offer or command id); wait for the
        reply with `replies`, which also forgets the key. `send=False`: the caller sends
        `msg` itself, later (a reply cannot come before it)."""
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_result(DISCONNECTED)
        else:
            self.waiting[key] = fut
            if send:
                self.send(msg)
        return Expected(self, key, fut)

    def forget(self, key: str) -> None:
        self.waiting.pop(key, None)

    def resolve(self, key: str, status: status_pb2.Status) -> None:
        fut = self.waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_result(Reply(status))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_result(DISCONNECTED)
        self.outbox.put_nowait(None)
