"""The controller's connection to the scheduler: placement, commands and the cluster feed.

Protobuf stops here. Callers hand in domain commands (orka/controller/commands.py) and get back
domain results; each message has one converter below, each way, so a change of the wire
format touches one function. A result keeps the message it came from (`raw`) for what the
domain value does not carry yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from orka import fit
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.controller.commands import (
    Assignment,
    ClusterUpdate,
    DeleteVolume,
    InstanceReported,
    NodeCommand,
    NodeSeen,
    NodeSynced,
    ProvisionVolume,
    Release,
    Start,
    Stop,
    VolumeReported,
)
from orka.errors import OrkaError, Unavailable, from_rpc_error
from orka.memo import ByIdentity
from orka.models import Node, WorkloadSpec
from orka.rpc import backoff, convert, convert_volumes
from orka.rpc.client import call, refused_role, secure_channel
from orka.rpc.place_reasons import reasons_from_pb
from orka.rpc.targets import Targets
from orka.security.tls import TlsFiles

log = structlog.get_logger("orka.controller.link")

UpdatesHandler = Callable[[Sequence[ClusterUpdate]], Awaitable[None]]


@dataclass(frozen=True)
class PlaceResult:
    """Where the scheduler placed one instance: `node` when an agent accepted it, else
    `reasons` (why no node took it) and the refusals per node."""

    instance: str
    node: str = ""
    reasons: list[fit.ReasonCount] = field(default_factory=list)
    refusals: dict[str, str] = field(default_factory=dict)
    raw: apb.PlaceResult | None = field(default=None, compare=False, repr=False)
    # With `node`: why the filters left the other nodes out, when the scheduler counted it.
    passed_over: list[fit.ReasonCount] = field(default_factory=list)


@dataclass(frozen=True)
class CommandResult:
    """A node's answer to one command. `unconfirmed`: no answer (not connected, timed out),
    so it may or may not have acted."""

    ok: bool
    error: str = ""
    unconfirmed: bool = False
    raw: apb.CommandResult | None = field(default=None, compare=False, repr=False)


class SchedulerLink:
    """Talks to the first scheduler that answers; fails over down the list."""

    def __init__(
        self,
        targets: list[str],
        tls: TlsFiles,
        on_updates: UpdatesHandler,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self.tls = tls
        self.on_updates = on_updates
        # Called each time the feed (re)connects: placement waiting out a backoff because the
        # scheduler was away should resume now, not when its backoff happens to end.
        self.on_connect = on_connect
        self.targets = Targets(targets)
        self._channel: grpc.aio.Channel | None = None
        self._stub: apb_grpc.SchedulerStub | None = None
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # This controller's leadership term, sent with every order (orka/scheduler/terms.py).
        self.term = 0

    def _ensure(self) -> apb_grpc.SchedulerStub:
        if self._stub is None:
            target = self.targets.current
            self._channel = secure_channel(target, self.tls, "scheduler")
            self._stub = apb_grpc.SchedulerStub(self._channel)
        return self._stub

    async def _drop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

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
            failure: BaseException | None = None
            try:
                stub = self._ensure()
                first = True
                async for updates in _merged(
                    stub.Watch(apb.WatchClusterRequest(leader_term=self.term))
                ):
                    if first:
                        log.info("scheduler feed connected", target=self.current)
                        self.connected.set()
                        self.targets.connected()
                        first = False
                        attempt = 0
                        if self.on_connect is not None:
                            self.on_connect()
                    await self.on_updates(updates_from_pb(updates))
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as err:
                failure = err
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
            await self._drop()
            attempt += 1
            # Which scheduler next, and how long first (a NOT_LEADER naming one: at once);
            # a pause ends early when a scheduler that refused connections starts listening.
            delay = self.targets.failed(failure, backoff.delay(attempt, 0.1, 3.0))
            if delay > 0:
                await backoff.pause(delay, self.targets.current)

    def stub(self) -> apb_grpc.SchedulerStub:
        """The connected scheduler's stub, for calls of its own (orka/controller/streams.py)."""
        if not self.connected.is_set():
            raise Unavailable(f"scheduler {self.current} is not connected")
        return self._ensure()

    @property
    def current(self) -> str:
        return self.targets.current

    async def _call(self, name: str, request: object, timeout: float) -> object:
        if not self.connected.is_set():
            raise Unavailable(f"scheduler {self.current} is not connected")
        stub = self._ensure()
        try:
            return await call(getattr(stub, name), request, timeout=timeout)
        except OrkaError:
            raise

    async def place(self, items: list[Assignment], timeout: float = 120.0) -> list[PlaceResult]:
        """One result per item, in the order of `items`."""
        req = apb.PlaceRequest(items=[assignment_to_pb(a) for a in items], leader_term=self.term)
        resp = await self._call("Place", req, timeout)
        assert isinstance(resp, apb.PlaceResponse)
        return [place_result_from_pb(r) for r in resp.results]

    async def command(self, commands: Sequence[NodeCommand]) -> list[CommandResult]:
        """One result per command, in the order of `commands`."""
        req = apb.CommandRequest(
            commands=[command_to_pb(c) for c in commands], leader_term=self.term
        )
        resp = await self._call("Command", req, 60.0)
        assert isinstance(resp, apb.CommandResponse)
        return [command_result_from_pb(r) for r in resp.results]

    async def set_node(
        self, name: str, schedulable: bool | None = None, draining: bool | None = None
    ) -> Node:
        req = apb.SetNodeRequest(name=name, leader_term=self.term)
        if schedulable is not None:
            req.schedulable = schedulable
        if draining is not None:
            req.draining = draining
        resp = await self._call("SetNode", req, 10.0)
        assert isinstance(resp, pb.Node)
        return convert.node_from_pb(resp)


# ---- converters: one per message, each way ----

# A spec is converted once, not once per instance: a workload's replicas share it. The
# messages are shared, so they are only ever copied from (as the Assignment constructor does).
_spec_msg: ByIdentity[WorkloadSpec, pb.WorkloadSpec] = ByIdentity(
    convert.spec_to_pb, weigh=lambda msg: msg.ByteSize(), max_weight=32 << 20
)
_spec_bytes: ByIdentity[WorkloadSpec, int] = ByIdentity(
    lambda spec: _spec_msg(spec).ByteSize(), weigh=lambda size: size, max_weight=32 << 20
)
# What an assignment adds to a request besides its spec and instance name: fields and framing.
_ASSIGNMENT_OVERHEAD = 64


def assignment_bytes(a: Assignment) -> int:
    """About what one assignment adds to a Place or Command request (within a few bytes): what
    keeps a batch under the gRPC message limit."""
    return (
        _spec_bytes(a.spec)
        + len(a.instance)
        + _ASSIGNMENT_OVERHEAD
        + sum(_VOLUME_OVERHEAD + len(v.name) + len(v.mount_path) for v in a.volumes)
    )


# What one volume attachment adds besides its name and mount path (node, pool, backend ...).
_VOLUME_OVERHEAD = 160


def assignment_to_pb(a: Assignment) -> apb.Assignment:
    msg = apb.Assignment()
    _fill_assignment(msg, a)
    return msg


def _fill_assignment(msg: apb.Assignment, a: Assignment) -> None:
    """Fills `msg` in place: a built assignment handed to another message's constructor is
    copied, spec and all (a start command would copy it twice, for every start)."""
    msg.instance = a.instance
    msg.generation = a.generation
    msg.spec.CopyFrom(_spec_msg(a.spec))
    if a.ordinal:
        msg.ordinal = a.ordinal
    if a.volumes:
        msg.volumes.extend(convert_volumes.attachment_to_pb(v) for v in a.volumes)


def command_to_pb(c: NodeCommand) -> apb.NodeCommand:
    match c:
        case Start():
            cmd = apb.NodeCommand(node=c.node)
            _fill_assignment(cmd.start.assignment, c.assignment)
            return cmd
        case Stop():
            return apb.NodeCommand(
                node=c.node,
                stop=apb.StopInstance(instance=c.instance, remove=True, reason=c.reason),
            )
        case Release():
            return apb.NodeCommand(node=c.node, release=apb.ReleaseOffer(instance=c.instance))
        case ProvisionVolume():
            return apb.NodeCommand(
                node=c.node,
                provision_volume=apb.ProvisionVolume(
                    volume=convert_volumes.attachment_to_pb(c.volume)
                ),
            )
        case DeleteVolume():
            return apb.NodeCommand(node=c.node, delete_volume=apb.DeleteVolume(volume=c.volume))


def place_result_from_pb(r: apb.PlaceResult) -> PlaceResult:
    return PlaceResult(
        instance=r.instance,
        node=r.node,
        # A taken offer (most of them) carries no reasons.
        reasons=reasons_from_pb(r) if r.reasons else [],
        refusals=dict(r.refusals) if r.refusals else {},
        raw=r,
        passed_over=reasons_from_pb(r, "passed_over") if r.passed_over else [],
    )


def command_result_from_pb(r: apb.CommandResult) -> CommandResult:
    ok = convert.status_ok(r.status)
    return CommandResult(
        ok=ok, error="" if ok else r.status.message, unconfirmed=r.unconfirmed, raw=r
    )


def update_from_pb(u: apb.ClusterUpdate) -> ClusterUpdate | None:
    """Scheduler input, validated here (orka.rpc.convert raises Invalid for a bad one)."""
    which = u.WhichOneof("body")
    if which == "node":
        return NodeSeen(convert.node_from_pb(u.node))
    if which == "instance":
        return InstanceReported(convert.report_from_pb(u.instance.status, u.instance.node))
    if which == "sync":
        return NodeSynced(
            node=u.sync.node,
            reports=[convert.report_from_pb(s, u.sync.node) for s in u.sync.instances],
            volumes=convert_volumes.reports_from_pb(u.sync.volumes, f"node {u.sync.node}"),
        )
    if which == "volume":
        return VolumeReported(u.volume.node, convert_volumes.report_from_pb(u.volume.status))
    return None  # a kind of update this controller does not know yet


def updates_from_pb(updates: Iterable[apb.ClusterUpdate]) -> list[ClusterUpdate]:
    """The feed's updates as domain values; a bad one is logged and skipped, never fatal: one
    malformed message must not stop the controller hearing about the whole cluster."""
    out: list[ClusterUpdate] = []
    for u in updates:
        try:
            update = update_from_pb(u)
        except OrkaError as err:
            log.warning("bad update from scheduler", error=err.message)
            continue
        if update is not None:
            out.append(update)
    return out


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
