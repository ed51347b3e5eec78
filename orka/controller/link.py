"""The controller's connection to the scheduler: placement, commands and the cluster feed."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import structlog

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.errors import OrkaError, Unavailable, from_rpc_error
from orka.rpc.client import call, refused_role, secure_channel
from orka.security.tls import TlsFiles

log = structlog.get_logger("orka.controller.link")

UpdatesHandler = Callable[[Sequence[apb.ClusterUpdate]], Awaitable[None]]


class SchedulerLink:
    """Talks to the first scheduler that answers; fails over down the list."""

    def __init__(
        self,
        targets: list[str],
        tls: TlsFiles,
        on_updates: UpdatesHandler,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self.targets = targets
        self.tls = tls
        self.on_updates = on_updates
        # Called each time the feed (re)connects: placement waiting out a backoff because the
        # scheduler was away should resume now, not when its backoff happens to end.
        self.on_connect = on_connect
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: apb_grpc.SchedulerStub | None = None
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _ensure(self) -> apb_grpc.SchedulerStub:
        if self._stub is None:
            target = self.targets[self._index % len(self.targets)]
            self._channel = secure_channel(target, self.tls, "scheduler")
            self._stub = apb_grpc.SchedulerStub(self._channel)
        return self._stub

    async def _rotate(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None
        self._index += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch_loop(), name="scheduler-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def _watch_loop(self) -> None:
        attempt = 0
        while True:
            try:
                stub = self._ensure()
                first = True
                async for updates in _merged(stub.Watch(apb.WatchClusterRequest())):
                    if first:
                        log.info("scheduler feed connected", target=self.current)
                        self.connected.set()
                        first = False
                        attempt = 0
                        if self.on_connect is not None:
                            self.on_connect()
                    await self.on_updates(updates)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as err:
                refused = refused_role(err.details() or "", "scheduler")
                if refused is not None:
                    log.error("refusing the scheduler", target=self.current, reason=refused)
                else:
                    log.warning(
                        "scheduler feed lost",
                        target=self.current,
                        code=err.code().name,
                        error_reason=from_rpc_error(err).reason,
                        details=err.details(),
                    )
            except Exception:
                log.exception("scheduler feed failed")
            self.connected.clear()
            await self._rotate()
            attempt += 1
            await asyncio.sleep(min(0.1 * 2 ** min(attempt, 6), 3.0) * random.uniform(0.5, 1.0))

    @property
    def current(self) -> str:
        return self.targets[self._index % len(self.targets)]

    async def _call(self, name: str, request: object, timeout: float) -> object:
        if not self.connected.is_set():
            raise Unavailable(f"scheduler {self.current} is not connected")
        stub = self._ensure()
        try:
            return await call(getattr(stub, name), request, timeout=timeout)
        except OrkaError:
            raise

    async def place(self, items: list[apb.Assignment], timeout: float = 120.0) -> apb.PlaceResponse:
        resp = await self._call("Place", apb.PlaceRequest(items=items), timeout)
        assert isinstance(resp, apb.PlaceResponse)
        return resp

    async def command(self, commands: list[apb.NodeCommand]) -> apb.CommandResponse:
        resp = await self._call("Command", apb.CommandRequest(commands=commands), 60.0)
        assert isinstance(resp, apb.CommandResponse)
        return resp

    async def set_node(
        self, name: str, schedulable: bool | None = None, draining: bool | None = None
    ) -> pb.Node:
        req = apb.SetNodeRequest(name=name)
        if schedulable is not None:
            req.schedulable = schedulable
        if draining is not None:
            req.draining = draining
        resp = await self._call("SetNode", req, 10.0)
        assert isinstance(resp, pb.Node)
        return resp


# Updates handed over in one call at most; the store commits them in chunks anyway.
MAX_MERGED = 5000


async def _merged(
    stream: AsyncIterator[apb.ClusterUpdates],
) -> AsyncIterator[list[apb.ClusterUpdate]]:
    """The feed's messages, with those that arrived while the previous ones were being handled
    joined into one list, in order: a controller that falls behind catches up in a few large
    commits instead of many small ones."""
    arrived: asyncio.Queue[apb.ClusterUpdates | BaseException | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for batch in stream:
                arrived.put_nowait(batch)
        except Exception as err:  # handed to the consumer, which raises it in order
            arrived.put_nowait(err)
        else:
            arrived.put_nowait(None)

    reader = asyncio.create_task(read(), name="scheduler-feed-reader")
    try:
        while True:
            item = await arrived.get()
            updates: list[apb.ClusterUpdate] = []
            while True:
                if item is None:
                    if updates:
                        yield updates
                    return
                if isinstance(item, BaseException):
                    if updates:
                        yield updates
                    raise item
                updates.extend(item.updates)
                if len(updates) >= MAX_MERGED or arrived.empty():
                    break
                item = arrived.get_nowait()
            yield updates
    finally:
        reader.cancel()
