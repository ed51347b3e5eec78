"""The controller process: store, reconciler, placement queue, scheduler link, public API."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller.api import ControllerApi
from orka.controller.events import EventHub
from orka.controller.link import SchedulerLink
from orka.controller.placement import PlacementConfig, PlacementQueue
from orka.controller.reconciler import Reconciler
from orka.controller.repo import Repo
from orka.errors import Invalid
from orka.rpc.server import start_server
from orka.security.tls import TlsFiles
from orka.store.factory import open_store

log = structlog.get_logger("orka.controller")

SERVICE_NAME = "orka.v1.Controller"


@dataclass
class ControllerConfig:
    listen: str = "127.0.0.1:7443"
    schedulers: list[str] = field(default_factory=lambda: ["127.0.0.1:7444"])
    store_url: str = ""
    data_dir: Path = field(default_factory=lambda: Path.home() / ".orka")
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        if not self.schedulers:
            raise Invalid("--scheduler: at least one HOST:PORT is required")


class Controller:
    def __init__(self, config: ControllerConfig, tls: TlsFiles) -> None:
        self.config = config
        self.tls = tls
        self.store = open_store(config.store_url, config.data_dir)
        self.repo = Repo(self.store)
        self.events = EventHub()
        self.repo.listeners.append(self.events.on_change)
        self.link = SchedulerLink(config.schedulers, tls, self._on_updates)
        self.queue = PlacementQueue(self.repo, self.link, config.placement)
        self.reconciler = Reconciler(self.repo, self.link, self.queue)
        self.api = ControllerApi(self.repo, self.reconciler, self.link, self.events)
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._failed: BaseException | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.port = 0

    async def _on_updates(self, updates: object) -> None:
        await self.reconciler.on_updates(updates)  # type: ignore[arg-type]

    async def start(self) -> int:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        await self.store.open()
        await self.repo.load()
        log.info(
            "store loaded",
            workloads=len(self.repo.workloads),
            instances=len(self.repo.instances),
            nodes=len(self.repo.nodes),
        )
        self.link.start()
        for coro, name in (
            (self.reconciler.run(), "reconciler"),
            (self.queue.run(), "placement"),
        ):
            task = asyncio.create_task(coro, name=name)
            task.add_done_callback(self._child_done)
            self._tasks.append(task)
        self._server, self.port, _ = await start_server(
            self.config.listen,
            self.tls,
            [lambda s: pb_grpc.add_ControllerServicer_to_server(self.api, s)],
            [SERVICE_NAME],
        )
        log.info("controller listening", port=self.port, schedulers=self.config.schedulers)
        return self.port

    def _child_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopped.is_set():
            return
        exc = task.exception()
        if exc is not None:
            # The first failure of a child starts a graceful shutdown of the whole service.
            log.error("controller task failed", task=task.get_name(), error=repr(exc))
            self._failed = exc
            self._stopped.set()

    async def run(self) -> None:
        await self.start()
        try:
            await self._stopped.wait()
        finally:
            await self.stop()
        if self._failed is not None:
            raise self._failed

    async def stop(self) -> None:
        """Idempotent: every caller waits for the one shutdown to finish."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._stopping)

    async def _shutdown(self) -> None:
        self._stopped.set()
        self.events.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.queue.close()
        await self.link.close()
        await self.store.close()

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
