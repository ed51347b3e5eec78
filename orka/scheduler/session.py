"""One connected agent: its outbound queue and the replies the scheduler is waiting for."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from orka.api import agent_pb2 as apb

_ids = itertools.count(1)


def next_id(prefix: str) -> str:
    return f"{prefix}{next(_ids)}"


@dataclass(frozen=True, slots=True)
class Reply:
    ok: bool
    reason: str
    # False when no answer came: the agent may or may not have acted on the message.
    answered: bool = True


DISCONNECTED = Reply(False, "agent disconnected", answered=False)
TIMED_OUT = Reply(False, "timed out", answered=False)


async def replies(
    pending: list[tuple[AgentSession, str, asyncio.Future[Reply]]], timeout: float
) -> list[Reply]:
    """The replies to many `expect`ed messages under one deadline: a batch waits once,
    without a task or a timer per message."""
    waiting = [fut for _, _, fut in pending if not fut.done()]
    if waiting:
        await asyncio.wait(waiting, timeout=timeout)
    out = []
    for session, key, fut in pending:
        session.forget(key)
        out.append(fut.result() if fut.done() else TIMED_OUT)
    return out


class AgentSession:
    def __init__(self, node: str) -> None:
        self.node = node
        self.outbox: asyncio.Queue[apb.SchedulerMessage | None] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Future[Reply]] = {}
        self.closed = False
        self.left = False
        # Why the agent's input was refused; the stream ends with INVALID_ARGUMENT and this.
        self.error = ""

    def send(self, msg: apb.SchedulerMessage) -> None:
        if not self.closed:
            self.outbox.put_nowait(msg)

    def expect(self, msg: apb.SchedulerMessage, key: str) -> asyncio.Future[Reply]:
        """Send, and return the future of the reply carrying `key` (an offer or command id).
        The caller waits for it under its own deadline, then calls `forget(key)`."""
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_result(DISCONNECTED)
        else:
            self.waiting[key] = fut
            self.send(msg)
        return fut

    def forget(self, key: str) -> None:
        self.waiting.pop(key, None)

    def resolve(self, key: str, ok: bool, reason: str) -> None:
        fut = self.waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_result(Reply(ok, reason))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_result(DISCONNECTED)
        self.outbox.put_nowait(None)
