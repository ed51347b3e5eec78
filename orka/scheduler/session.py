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

    async def request(self, msg: apb.SchedulerMessage, key: str, timeout: float) -> Reply:
        """Send and wait for the reply carrying `key` (an offer or command id)."""
        if self.closed:
            return Reply(False, "agent disconnected", answered=False)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.waiting[key] = fut
        self.send(msg)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            return Reply(False, "timed out", answered=False)
        finally:
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
                fut.set_result(Reply(False, "agent disconnected", answered=False))
        self.outbox.put_nowait(None)
