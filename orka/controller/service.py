"""The controller process: store, reconciler, placement queue, scheduler link, public API.

Several controllers may share one etcd store; they elect a leader (leadership.py). The API
server runs on every controller; the store's cache, the reconciler, the placement queue and
the scheduler feed exist only on the leader, built afresh for each term it leads. On SQLite or
memory the election always wins at once, so a lone controller behaves as it always did.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health

from orka import metrics
from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller.activity import ActivityLog
from orka.controller.api import ControllerApi, Quotas
from orka.controller.audit import AuditLog
from orka.controller.commands import ClusterUpdate, NodeSynced
from orka.controller.events import EventHub
from orka.controller.link import SchedulerLink
from orka.controller.placement import PlacementConfig, PlacementQueue
from orka.controller.reconciler import History, Reconciler
from orka.controller.repo import Repo
from orka.controller.volumes import VolumeKeeper
from orka.errors import Invalid, Unavailable
from orka.filemodes import private_dir
from orka.leadership import Leadership, default_advertise
from orka.rpc.server import set_serving, start_server
from orka.security.tls import TlsFiles
from orka.store.base import Fenced
from orka.store.election import Election, election_for
from orka.store.factory import open_configured
from orka.supervision import PartFailed, describe

log = structlog.get_logger("orka.controller")

SERVICE_NAME = "orka.v1.Controller"
ELECTION = "controller"
# The largest request the public API takes: a spec is at most 1 MiB (orka.validation), so
# anything past a few MiB is no request of ours and is refused before it is parsed.
API_MAX_RECEIVE = 4 << 20


@dataclass
class ControllerConfig:
    listen: str = "127.0.0.1:7443"
    schedulers: list[str] = field(default_factory=lambda: ["127.0.0.1:7444"])
    store_url: str = ""
    data_dir: Path = field(default_factory=lambda: Path.home() / ".orka")
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    # The API address other controllers name to clients when this one leads; empty: derived
    # from `listen` (wildcard host -> 127.0.0.1, port 0 -> the bound port).
    advertise: str = ""
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    # The leader's lease; a dead leader is replaced within about this many seconds.
    election_ttl: int = 5
    # Where the audit log's JSON lines go (None: through structlog only); reads too if asked.
    audit_log: Path | None = None
    audit_reads: bool = False
    # Cluster-wide quotas (per tenant later): workloads, and replicas over all workloads.
    quotas: Quotas = field(default_factory=Quotas)
    # Finished instances kept per workload, and for how long.
    history: History = field(default_factory=History)

    def __post_init__(self) -> None:
        if not self.schedulers:
            raise Invalid("--scheduler: at least one HOST:PORT is required")


class Controller:
    def __init__(self, config: ControllerConfig, tls: TlsFiles) -> None:
        self.config = config
        self.tls = tls
        self.store = open_configured(config)
        self.repo = Repo(self.store)
        self.repo.writable = False  # until elected
        self.events = EventHub(lambda: self.repo.revision)
        self.repo.listeners.append(self.events.on_change)
        self.repo.listeners.append(metrics.on_change)  # placements, restarts
        self.repo.on_reload.append(self.events.reset)
        self.repo.on_fenced.append(self._fenced)
        # Recent activity per object, for `orka describe`: in memory, written only by the
        # leader (a follower's repo makes no writes), so a new leader starts with none.
        self.activity = ActivityLog()
        self.repo.listeners.append(self.activity.on_change)
        self._build()
        self.api = ControllerApi(
            self.repo, self.reconciler, self.link, self.events, self._gate, config.quotas
        )
        self.audit = AuditLog(config.audit_log, reads=config.audit_reads)
        self.api.auditor = self.audit
        self.api.activity = self.activity
        self.api.volume_keeper = self.volumes
        self.election: Election | None = None
        self.leadership: Leadership | None = None
        self._health: health.aio.HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the current term's leader-only tasks
        self._leadership_task: asyncio.Task[None] | None = None
        self._fresh = True  # the components built in __init__ have not led a term yet
        self._stopped = asyncio.Event()
        self._failed: BaseException | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.port = 0
        # Set once start() has returned: serving, and (leadership.settled) knowing its role.
        self.listening = asyncio.Event()

    def _build(self) -> None:
        """Fresh leader-only parts: a new term must not inherit the last one's queue, backoffs
        or command timers, which describe a cache that has since been reloaded."""
        self.link = SchedulerLink(
            self.config.schedulers, self.tls, self._on_updates, on_connect=self._feed_connected
        )
        self.queue = PlacementQueue(self.repo, self.link, self.config.placement)
        self.reconciler = Reconciler(self.repo, self.link, self.queue, self.config.history)
        self.queue.activity = self.reconciler.activity = self.activity
        self.volumes = VolumeKeeper(self.repo, self.link)

    async def _on_updates(self, updates: Sequence[ClusterUpdate]) -> None:
        await self.reconciler.on_updates(updates)
        await self.volumes.on_updates(updates)
        # An agent (re-)registering is a node joining as far as placement is concerned: after
        # a scheduler restart its node record is unchanged, so the reconciler would not say so.
        if any(isinstance(u, NodeSynced) for u in updates):
            self.queue.cluster_changed()

    def _feed_connected(self) -> None:
        self.queue.cluster_changed()
        self.reconciler.kick()

    async def _gate(self) -> None:
        if self.leadership is None:
            raise Unavailable("the controller is starting")
        await self.leadership.require()

    @property
    def is_leader(self) -> bool:
        return self.leadership is not None and self.leadership.is_leader

    async def start(self) -> int:
        private_dir(self.config.data_dir)  # the store holds specs, with their secrets
        await self.store.open()
        try:
            self._server, self.port, self._health = await start_server(
                self.config.listen,
                self.tls,
                [lambda s: pb_grpc.add_ControllerServicer_to_server(self.api, s)],
                [SERVICE_NAME],
                max_receive=API_MAX_RECEIVE,
                on_revoked=self._fail,
            )
        except BaseException:
            # Refused to serve (a revoked certificate, a port in use): the store's and the
            # audit file's threads would keep the process alive after the error.
            await self.store.close()
            await asyncio.to_thread(self.audit.close)
            raise
        # Not serving the API until elected and loaded; the gate answers UNAVAILABLE meanwhile.
        await self._set_serving(False)
        advertise = self.config.advertise or default_advertise(self.config.listen, self.port)
        self.election = election_for(
            self.store,
            ELECTION,
            advertise,
            ttl=self.config.election_ttl,
            info={"address": advertise},
        )
        # The repo stops writing when the lease is known lost, not when step_down gets its turn.
        self.election.on_lost.append(self._stop_writing)
        self.leadership = Leadership(self.election, self._lead, self._step_down)
        task = asyncio.create_task(self.leadership.run(), name="leadership")
        task.add_done_callback(self._child_done)
        self._leadership_task = task
        # Return knowing our role, if it is known soon: leading (a lone controller always is),
        # or following a live leader. A race lost to a peer just leaves us campaigning.
        settled = asyncio.create_task(self.leadership.settled.wait())
        done, _ = await asyncio.wait(
            {settled, task},
            timeout=2 * self.config.election_ttl,
            return_when=asyncio.FIRST_COMPLETED,
        )
        settled.cancel()
        if task in done and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        log.info(
            "controller listening",
            port=self.port,
            advertise=advertise,
            leader=self.is_leader,
            schedulers=self.config.schedulers,
        )
        self.listening.set()
        return self.port

    async def _set_serving(self, serving: bool) -> None:
        await set_serving(self._health, SERVICE_NAME, serving)

    async def _lead(self) -> None:
        """A term begins: resume from the store, then start the leader-only parts."""
        if not self._fresh:
            self._build()
            self.api.reconciler, self.api.link = self.reconciler, self.link
            self.api.volume_keeper = self.volumes
        self._fresh = False
        await self.repo.load()
        log.info(
            "store loaded",
            workloads=len(self.repo.workloads),
            instances=len(self.repo.instances),
            nodes=len(self.repo.nodes),
        )
        # Every write of this term carries it: a successor's key makes them fail as a whole.
        assert self.election is not None
        self.repo.fence = self.election.fence()
        # The same term fences its orders to nodes, at the scheduler.
        self.link.term = 0 if self.repo.fence is None else self.repo.fence.revision
        self.repo.writable = True
        self.link.start()
        for coro, name in (
            (self.reconciler.run(), "reconciler"),
            (self.queue.run(), "placement"),
            (self.volumes.run(), "volumes"),
        ):
            task = asyncio.create_task(coro, name=name)
            task.add_done_callback(self._child_done)
            self._tasks.append(task)
        await self._set_serving(True)

    def _stop_writing(self) -> None:
        self.repo.writable = False
        self.repo.fence = None

    async def _step_down(self) -> None:
        """A term ends (lease lost, or shutdown): stop writing at once, then stop the rest."""
        self._stop_writing()
        await self._set_serving(False)
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.queue.close()
        await self.link.close()
        # Watchers reconnect to whoever leads next; the cache is not ours to answer from.
        self.events.close()
        self.repo.reset()

    def _fenced(self, err: Fenced) -> None:
        """A write failed its fence: our election key is gone (the lease ran out) or another
        controller's. End the term now: the lease may still look alive to us, as it does to a
        leader that was paused or starved past its TTL."""
        log.error("write fenced: this controller no longer leads; stepping down", error=err.message)
        if self.election is not None:
            self.election.fenced()

    def _fail(self, exc: BaseException) -> None:
        """End the service with `exc`: run() stops everything, then raises it."""
        if self._failed is None:
            self._failed = exc
        self._stopped.set()

    def _child_done(self, task: asyncio.Task[None]) -> None:
        if self._stopped.is_set() or task not in self._tasks:
            return  # stopping, or the term ended: its parts end by design
        # A leader part that ends while the term runs (fails, returns, or is cancelled by
        # anything but step-down) would leave a leader that answers but no longer acts: the
        # first such end starts a graceful shutdown of the whole service.
        error = (
            asyncio.CancelledError("cancelled while leading")
            if task.cancelled()
            else task.exception()
        )
        log.error("controller task failed", task=task.get_name(), error=describe(error))
        self._failed = PartFailed("controller", task.get_name(), error)
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
        if self._leadership_task is not None:
            # Its cancellation runs _step_down (leader parts stopped) before it ends.
            self._leadership_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._leadership_task
        else:
            await self._step_down()
        if self.leadership is not None:
            # Resign so a standby takes over now rather than when our lease expires.
            await self.leadership.close()
        await self.store.close()
        # Last: the server has stopped, so every call has been recorded.
        await asyncio.to_thread(self.audit.close)

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
