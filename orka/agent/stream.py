"""The agent's stream to the scheduler: registering, heartbeats, events, and reconnecting."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc
import structlog
from google.rpc import status_pb2

from orka.agent.supervisor import Supervised
from orka.agent.volumes import VolumeManager
from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.errors import Invalid, from_rpc_error
from orka.models import TERMINAL_PHASES, Resources
from orka.rpc import backoff, convert
from orka.rpc.client import refused_role, secure_channel
from orka.rpc.frames import drain
from orka.rpc.targets import Targets, hint_of
from orka.runtime.base import Driver
from orka.security.tls import TlsFiles

log = structlog.get_logger("orka.agent")

VERSION = "0.1.0"

# Heartbeats carry every instance's status once in this many beats (changes go as events).
FULL_STATUS_EVERY = 10
# Usage is read from the drivers once in this many intervals.
USAGE_EVERY = 5
# A heartbeat due within this share of an interval leaves early with a frame being sent anyway.
EARLY_BEAT = 0.5
# Seconds between two looks at the channels kept warm to the other schedulers (jittered by
# 0.5-1.5), and the backoff of one that could not connect: WARM_BACKOFF after its first
# failure, doubling up to WARM_MAX (each jittered by 0.5-1).
WARM_EVERY = 5.0
WARM_BACKOFF = 10.0
WARM_MAX = 60.0
# At most this many dials in a row are left out while a scheduler's port refuses connections.
MAX_SKIPPED_DIALS = 10
# The heartbeat intervals a scheduler may set (Registered, Pace); anything else is ignored.
MIN_INTERVAL = 0.05
MAX_INTERVAL = 600.0


def _interval(seconds: float) -> float | None:
    return seconds if MIN_INTERVAL <= seconds <= MAX_INTERVAL else None


def _wake(asleep: asyncio.Future[None]) -> None:
    if not asleep.done():
        asleep.set_result(None)


async def _ended(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError | None:
    """The error an ended stream finished with, as its own read would raise it (None: OK)."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return None
    return grpc.aio.AioRpcError(
        code,
        await call.initial_metadata(),
        await call.trailing_metadata(),
        await call.details(),
    )


def _status_of(inst: Supervised) -> apb.InstanceStatus:
    return convert.instance_status_to_pb(inst, inst.resources, inst.generation)


_TERMINAL_PB = frozenset(convert.phase_to_pb(p) for p in TERMINAL_PHASES)


@dataclass
class _Warm:
    """What `Stream._keep_warm` knows of one address: failures to connect in a row, when it
    may be dialled again, and the connect loop's last failure there already counted."""

    failures: int = 0
    after: float = 0.0
    counted: float | None = None


class Stream:
    """Keeps one stream to a scheduler open (`run()`: connect, register, serve, and on any
    end reconnect with backoff, trying each scheduler in turn). While connected it sends a
    heartbeat per interval and each instance change as an event at once; messages queued
    together leave in one frame. What the scheduler sends goes to `on_message`."""

    # Called when a registered stream ends (the sessions on it end too: orka/agent/sessions.py).
    on_disconnect: Callable[[], None] = staticmethod(lambda: None)

    def __init__(
        self,
        schedulers: list[str],
        tls: TlsFiles,
        capacity: Resources,
        labels: dict[str, str],
        healthy: Mapping[str, Driver],
        instances: Mapping[str, Supervised],
        heartbeat_interval: float,
        reconnect_max: float,
        on_message: Callable[[apb.SchedulerMessage], None],
        allocated: Callable[[], Resources],
        usage: Callable[[], Awaitable[Resources]],
        leaving: Callable[[], bool],
        pool: str = "",
        volumes: VolumeManager | None = None,
    ) -> None:
        self.targets = Targets(schedulers)
        self.pool = pool
        self.volumes = volumes
        self.tls = tls
        self.capacity = capacity
        self.labels = labels
        self.healthy = healthy
        self.instances = instances
        self.interval = heartbeat_interval
        self.reconnect_max = reconnect_max
        self.on_message = on_message
        self.allocated = allocated
        self.usage = usage
        self.leaving = leaving
        self.connected = asyncio.Event()
        # The heartbeat schedule (event loop time of the next beat), shared with the writer.
        self._next_beat = float("inf")
        self._beat = 0
        self._usage_now = Resources()
        # What the heartbeat loop sleeps on until its next beat (`repace` may end it early).
        self._asleep: asyncio.Future[None] | None = None
        self.outbox: asyncio.Queue[apb.AgentMessage | None] | None = None
        # instance -> its event message still in the outbox, so a newer state replaces it.
        self._unsent_events: dict[str, apb.AgentMessage] = {}
        # One channel per scheduler address, kept while that scheduler answers, and with
        # several schedulers kept connected to each of them (`_keep_warm`): a failover then
        # costs no TLS handshake. A channel is dropped after any failure other than a
        # NOT_LEADER answer, so a dead or restarted scheduler is dialled afresh.
        self._channels: dict[str, grpc.aio.Channel] = {}
        # `_keep_warm`'s record of each address it keeps.
        self._warm: dict[str, _Warm] = {}

    # ---- what is sent ----

    def repace(self, pace: apb.Pace) -> None:
        """The scheduler changed the heartbeat interval (orka/scheduler/pace.py). A shorter
        one starts with a beat now: the scheduler judges this node by it from its next
        heartbeat on, which must not wait out the longer interval."""
        seconds = pace.heartbeat_interval.ToNanoseconds() / 1e9
        interval = _interval(seconds)
        if interval is None:
            log.warning("heartbeat interval out of range; ignored", seconds=seconds)
            return
        shorter = interval < self.interval
        self.interval = interval
        if shorter and self._asleep is not None and not self._asleep.done():
            self._next_beat = asyncio.get_running_loop().time()
            self._asleep.set_result(None)

    def send(self, msg: apb.AgentMessage) -> None:
        if self.outbox is not None:
            self.outbox.put_nowait(msg)

    def ack(self, command_id: str, status: status_pb2.Status) -> None:
        self.send(apb.AgentMessage(ack=apb.CommandAck(command_id=command_id, status=status)))

    def leave(self) -> None:
        self.send(apb.AgentMessage(leave=apb.Leave(reason="agent shutting down")))

    def instance_changed(self, inst: Supervised) -> None:
        if self.outbox is None:
            return  # registering sends every status
        unsent = self._unsent_events.get(inst.name)
        if unsent is not None and unsent.instance_status.phase not in _TERMINAL_PB:
            # Its previous state has not left yet (STARTING, when a driver reports RUNNING
            # at once): send the newest in its place. Terminal states are never replaced, so
            # an exit code or failure reason always reaches the scheduler.
            unsent.instance_status.CopyFrom(_status_of(inst))
            return
        msg = apb.AgentMessage(instance_status=_status_of(inst))
        self._unsent_events[inst.name] = msg
        self.send(msg)

    def register_message(self) -> apb.AgentMessage:
        reg = apb.Register(
            node=apb.NodeInfo(
                capacity=convert.resources_to_pb(self.capacity),
                allocatable=convert.resources_to_pb(self.capacity),
                # orka.io/node is the scheduler's to set, from our certificate.
                labels=self.labels,
                drivers=sorted(self.healthy),
                version=VERSION,
                pool=self.pool,
            )
        )
        if self.volumes is not None:
            reg.node.volume_backends.extend(self.volumes.backend_names())
            reg.node.volume_capacity_bytes = self.volumes.capacity_bytes()
            reg.volumes.extend(self.volumes.statuses())
        reg.instances.extend(_status_of(inst) for inst in self.instances.values())
        reg.unreachable.extend(self.targets.unreachable())
        reg.heartbeat_interval.FromNanoseconds(round(self.interval * 1e9))
        reg.registers_again = True
        return apb.AgentMessage(register=reg)

    def heartbeat_message(self) -> apb.AgentMessage:
        hb = apb.Heartbeat(
            usage=convert.resources_to_pb(self._usage_now),
            allocated=convert.resources_to_pb(self.allocated()),
            sent_at=time.time(),
        )
        if self._beat % FULL_STATUS_EVERY == FULL_STATUS_EVERY - 1:
            hb.instances.extend(_status_of(inst) for inst in self.instances.values())
        self._beat += 1
        return apb.AgentMessage(heartbeat=hb)

    # ---- the connection ----

    async def run(self) -> None:
        several = len(self.targets.addresses) > 1
        warm = [asyncio.create_task(self._keep_warm())] if several else []
        try:
            await self._connect_loop()
        finally:
            for task in warm:
                task.cancel()
            await asyncio.gather(*warm, return_exceptions=True)
            channels, self._channels = list(self._channels.values()), {}
            for channel in channels:
                await channel.close()

    async def _keep_warm(self) -> None:
        """Keep a connection open to every other scheduler, whether or not this agent is
        registered there. A standby's mutual-TLS handshake with every agent is otherwise
        paid all at once when it takes over: at 5,000 agents that was seconds of CPU on
        both sides (gRPC core's threads) before the first registration. Held open, a
        failover opens only a stream.

        The current scheduler's channel is the connect loop's. Another one that lost its
        connection (IDLE) is asked to connect again; one that cannot connect (TRANSIENT_
        FAILURE: refused, unreachable) is closed, ending gRPC's own retries, and tried again
        after a backoff that doubles up to WARM_MAX, so a dead standby costs its agents a
        dial a minute, not one a second. An address the connect loop could not reach (a dead
        active scheduler, just left) starts on that backoff too."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WARM_EVERY * random.uniform(0.5, 1.5))
            for target in self.targets.addresses:
                if target == self.targets.current:
                    continue
                try:
                    await self._keep(target, loop.time())
                except Exception as err:  # e.g. certificate files mid-rotation: next round
                    log.warning(
                        "could not keep a scheduler connection", target=target, error=repr(err)
                    )

    async def _keep(self, target: str, now: float) -> None:
        """One look at the channel to `target` (`_keep_warm`)."""
        record = self._warm.setdefault(target, _Warm())
        state = self._state(target)
        failed_at = self.targets.failed_at(target)
        # A failure of the connect loop there not counted yet (None: none since it answered).
        missed = failed_at is not None and failed_at != record.counted
        if failed_at is not None:
            record.counted = failed_at
        if state == grpc.ChannelConnectivity.READY:
            record.failures = 0
        elif state == grpc.ChannelConnectivity.TRANSIENT_FAILURE or missed:
            await self._drop_channel(target)
            record.failures += 1
            record.after = now + backoff.delay(record.failures, WARM_BACKOFF / 2, WARM_MAX)
        elif state in (None, grpc.ChannelConnectivity.IDLE) and now >= record.after:
            self._channel(target).get_state(try_to_connect=True)

    def _state(self, target: str) -> grpc.ChannelConnectivity | None:
        """The state of this agent's channel to `target`; None without one."""
        channel = self._channels.get(target)
        return None if channel is None else channel.get_state()

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = secure_channel(target, self.tls, "scheduler")
        return channel

    async def _drop_channel(self, target: str) -> None:
        channel = self._channels.pop(target, None)
        if channel is not None:
            await channel.close()

    async def _connect_loop(self) -> None:
        attempt = 0
        # The last pause ended with the next scheduler's port refusing connections; how many
        # dials in a row were left out for that.
        refusing = False
        skipped = 0
        while True:
            target = self.targets.current
            failure: BaseException | None
            if refusing and skipped < MAX_SKIPPED_DIALS and await backoff.probe(target) is False:
                # Nothing listens there yet: no channel, handshake or log line is spent on a
                # dial bound to fail (thousands of agents of a restarting scheduler doing that
                # kept the cores from the new process starting up); another pause follows.
                # Now and then it dials anyway, should a plain TCP probe mislead (a proxy).
                skipped += 1
                failure = ConnectionRefusedError(f"{target} refuses connections")
            else:
                skipped = 0
                registered, failure = await self._attempt(target)
                if registered:
                    attempt = 0
            self.connected.clear()
            self.outbox = None
            if not hint_of(failure).not_leader:
                await self._drop_channel(target)
            attempt += 1
            # Which scheduler next, and how long first (a NOT_LEADER naming one: at once);
            # a pause ends early when a scheduler that refused connections starts listening.
            delay = self.targets.failed(failure, backoff.delay(attempt, 0.2, self.reconnect_max))
            refusing = False
            if delay > 0 and self._state(self.targets.current) == grpc.ChannelConnectivity.READY:
                await asyncio.sleep(delay)  # connected: no port to watch
            elif delay > 0:
                refusing = await backoff.pause(delay, self.targets.current)

    async def _attempt(self, target: str) -> tuple[bool, BaseException | None]:
        """One session with `target`: whether it registered (the backoff starts over after a
        stream that did, however it ended), and the error it ended with (None for a clean end
        or an unexpected error, which is logged)."""
        try:
            await self.session(target)
            return True, None
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            refused = refused_role(err.details() or "", "scheduler")
            if refused is not None:
                # Registering with such a peer would let it command this node.
                log.error("refusing the scheduler", target=target, reason=refused)
            else:
                log.warning(
                    "scheduler stream ended",
                    target=target,
                    code=err.code().name,
                    error_reason=from_rpc_error(err).reason,
                    details=err.details(),
                )
            return self.connected.is_set(), err
        except Exception:
            log.exception("scheduler stream failed", target=target)
            return self.connected.is_set(), None

    async def session(self, target: str) -> None:
        """One stream, from registering until it ends. Its reader, writer and heartbeats end
        together: the first of them to end (or fail) ends the session, so a stream never
        goes on without heartbeats."""
        if self._state(target) == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # A kept-warm channel waiting out gRPC's reconnect backoff fails a call at once,
            # even when the scheduler listens again now: dial afresh.
            await self._drop_channel(target)
        call = apb_grpc.SchedulerStub(self._channel(target)).Connect()
        try:
            await self._serve(target, call)
        finally:
            # The channel may outlive the call (kept for the next attempt): end it here.
            call.cancel()

    async def _serve(self, target: str, call: grpc.aio.StreamStreamCall) -> None:
        outbox: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
        self._unsent_events.clear()
        await call.write(self.register_message())
        first = await call.read()
        if first is not grpc.aio.EOF and first.WhichOneof("body") == "register_again":
            # A standby held this stream while the active scheduler was gone, and leads now:
            # it wants what this node holds now, not what it held when the stream opened.
            await call.write(self.register_message())
            first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "registered":
            raise Invalid("scheduler did not acknowledge the registration")
        self.interval = _interval(first.registered.heartbeat_interval) or self.interval
        self.outbox = outbox
        self.connected.set()
        self.targets.connected()
        log.info("registered", scheduler=target, node=first.registered.node)
        if self.leaving():
            self.leave()
        jobs = [
            asyncio.create_task(self._reader(call)),
            asyncio.create_task(self.writer(call, outbox)),
            asyncio.create_task(self._heartbeats()),
        ]
        try:
            done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            self.outbox = None
            self.on_disconnect()
        for job in done:
            if job.cancelled() or job.exception() is None:
                continue
            err = job.exception()
            if isinstance(err, asyncio.InvalidStateError):
                # A write met the stream just ended (its scheduler gone, or a standby's
                # answer): not a fault of this agent's. How it ended is the call's status,
                # NOT_LEADER details and all (an OK one is a clean end, as the reader's EOF).
                ended = await _ended(call)
                if ended is None:
                    return
                raise ended from None
            raise err  # type: ignore[misc]

    async def _reader(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            self.on_message(msg)

    async def writer(
        self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[apb.AgentMessage | None]
    ) -> None:
        unsent = self._unsent_events
        loop = asyncio.get_running_loop()
        while True:
            msg = await outbox.get()
            if msg is None:
                return
            items, closed = drain(msg, outbox)
            has_beat = False
            for item in items:
                body = item.WhichOneof("body")
                if body == "instance_status" and unsent.get(item.instance_status.name) is item:
                    # Leaving now: later changes need a new message.
                    del unsent[item.instance_status.name]
                has_beat = has_beat or body == "heartbeat"
            now = loop.time()
            if not has_beat and now >= self._next_beat - self.interval * EARLY_BEAT:
                # The next heartbeat is due soon: it rides in this frame rather than costing
                # a write (and the scheduler a read) of its own a moment later.
                items.append(self.heartbeat_message())
                self._next_beat = now + self.interval
            if len(items) == 1:
                await call.write(msg)
            else:
                await call.write(apb.AgentMessage(batch=apb.AgentBatch(messages=items)))
            if closed:  # the close marker came right behind what was just sent
                return

    async def _heartbeats(self) -> None:
        """One heartbeat per interval, on a fixed schedule.

        Every state change already goes out at once as an event, and registering sends the
        full list, so a heartbeat carries the instance statuses only every
        FULL_STATUS_EVERY beats (a safety net, cheap for the scheduler when nothing changed).
        The schedule does not drift: a beat that was late (a busy loop) does not push the
        next one back by the same amount, which is what would turn a node NOT_READY.
        A beat may also leave early, in a frame the writer is sending anyway (`writer`);
        the schedule then starts again from that beat.

        The first beat is due an interval after registering, not at once: the registration
        said all it would but the usage, and after a failover a beat right behind every
        registration would double what the scheduler taking them all at once reads.
        """
        loop = asyncio.get_running_loop()
        self._next_beat = loop.time() + self.interval
        usage_at = -1e9
        while True:
            now = loop.time()
            if now >= self._next_beat:
                if now - usage_at >= USAGE_EVERY * self.interval:
                    usage_at = now
                    self._usage_now = await self.usage()
                self.send(self.heartbeat_message())
                now = loop.time()
                self._next_beat += self.interval
                if self._next_beat < now:
                    self._next_beat = now  # far behind: the next one at once, but no burst
            asleep = self._asleep = loop.create_future()
            timer = loop.call_later(max(0.0, self._next_beat - now), _wake, asleep)
            try:
                await asleep
            finally:
                timer.cancel()
                self._asleep = None
