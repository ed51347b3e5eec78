"""Server plumbing shared by every service: TLS listener, health, reflection, the error boundary."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from orka.errors import Invalid, OrkaError, Unauthenticated, trailing_metadata, wire_message
from orka.rpc import own_cert
from orka.rpc.revocation_check import RevocationInterceptor
from orka.rpc.wrapping import WrappingInterceptor, replace_behaviour
from orka.security import peer_cert
from orka.security.identity import PEER_CERT_KEY, Identity, identity_from_pem, require_role
from orka.security.tls import TlsFiles, server_credentials

log = structlog.get_logger("orka.rpc")

Req = TypeVar("Req")
S = TypeVar("S", bound=type)
Resp = TypeVar("Resp")
# Orka's own links between services carry big messages that are no lists: a frame of up to
# 64 offers or commands each with a spec of up to 1 MiB (agent stream), a Place batch or a
# node feed of thousands of nodes (controller <-> scheduler). Public API answers are paged
# and bounded (orka.controller.paging, events) to stay under gRPC's default 4 MiB, so the
# CLI, grpcurl and any other client work with the default limit.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def split_hostport(value: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise Invalid(f"{flag}: {value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def grpc_options(
    bulk: bool = False, max_receive: int | None = MAX_MESSAGE_BYTES
) -> list[tuple[str, Any]]:
    """Channel and server arguments for Orka's own connections.

    `max_receive` None leaves gRPC's default (4 MiB): a client of the public API only.
    `bulk` keeps gRPC's bandwidth-delay probing, for a client that downloads many pages over
    a slow link (the CLI). Everywhere else the traffic is many small messages on
    long-lived streams: there the probe's PING and window update after received data cost
    more than the messages themselves (scheduler CPU for 1,000 agents at 1 s heartbeats fell
    from 0.29 to 0.17 of a core without it), and a 64 KiB window is plenty.
    """
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Liveness of agents is the heartbeat's job; keepalive only finds dead TCP peers, so
        # it pings rarely and waits long: thousands of streams on a loaded loop must not be
        # cut because a ping answer was late.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if max_receive is not None:
        options.append(("grpc.max_receive_message_length", max_receive))
    if not bulk:
        options.append(("grpc.http2.bdp_probe", 0))
    return options


# Calls gRPC's core has received but the Python server has not yet taken up. Above the soft
# limit core refuses new ones at random (all of them above the hard limit), and an agent sees its
# stream CANCELLED before a byte of it was read. Core's defaults (1,000 and 3,000) are below the
# cluster sizes Orka serves: when a scheduler starts or takes over, every agent opens its stream
# at once, and at 5,000 agents thousands were refused this way, each agent backing off and
# trying again, for a minute. They are served as fast as the event loop takes them instead.
PENDING_CALLS = [
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
]


async def start_server(
    listen: str,
    tls: TlsFiles,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    max_receive: int = MAX_MESSAGE_BYTES,
    on_revoked: Callable[[Invalid], None] | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a mutual-TLS server with health and reflection; returns it and its bound port.

    `max_receive` bounds each request message (gRPC answers RESOURCE_EXHAUSTED above it). It
    refuses to start on a revoked certificate and stops when a CRL revokes it later, then
    calls `on_revoked` with the reason (the service's own shutdown)."""
    host, port = split_hostport(listen)
    # Revoked peers are refused on every method, health and reflection included.
    server = grpc.aio.server(
        options=[*grpc_options(max_receive=max_receive), *PENDING_CALLS],
        interceptors=[MetricsInterceptor(), RevocationInterceptor()],
    )
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    credentials = server_credentials(tls)  # loads the CRL the guard checks against
    own_cert.guard(tls, server, on_revoked)
    bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise Invalid(f"--listen: cannot listen on {listen}")
    await server.start()
    for name in (*service_names, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def set_serving(
    servicer: health.aio.HealthServicer | None, service: str, serving: bool
) -> None:
    """What the health service says of `service`: SERVING for a leader or an active scheduler,
    NOT_SERVING for a follower or a standby (load balancers then find the one that serves)."""
    if servicer is not None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await servicer.set(service, status)


# ---- RPC metrics ----


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """How a call ended: the code it was aborted or set with; OK when it returned; CANCELLED
    when the client went away; UNKNOWN for an exception no boundary mapped (gRPC's answer)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # grpc.aio keeps the cygrpc integer once aborted
        return _CODE_NAMES.get(code, "UNKNOWN")
    if error is None:
        return "OK"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "UNKNOWN"


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _measured(behaviour: Callable[..., Any], service: str, method: str) -> Callable[..., Any]:
    """`behaviour` counted and timed, of the same kind (an async generator stays one: gRPC
    tells how a reply stream is written from the function's kind)."""
    # Imported here: the CLI imports this module for split_hostport, and needs no metrics.
    from orka import metrics

    seconds = metrics.RPC_SECONDS.labels(service, method)
    counters: dict[str, Any] = {}

    def done(context: grpc.aio.ServicerContext, start: float, error: BaseException | None) -> None:
        seconds.observe(time.perf_counter() - start)
        code = _code(context, error)
        counter = counters.get(code)
        if counter is None:
            counter = counters[code] = metrics.RPCS.labels(service, method, code)
        counter.inc()

    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                async for item in behaviour(request, context):
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                done(context, start, error)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            result = behaviour(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except BaseException as exc:
            error = exc
            raise
        finally:
            done(context, start, error)

    return call


class MetricsInterceptor(WrappingInterceptor):
    """RPCs by service, method and code, with their latency (orka.metrics), on every server.
    Outermost, so that calls the revocation check refuses are counted too. Methods the server
    does not have are not counted: the label values stay the server's own methods."""

    def wrap(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        service, _, method = path.lstrip("/").rpartition("/")
        return replace_behaviour(handler, lambda behaviour: _measured(behaviour, service, method))


@dataclass(frozen=True)
class Abort:
    """How a failed call ends on the wire: code, message, and the trailer with the rich
    google.rpc.Status (ErrorInfo, BadRequest, RetryInfo) that `orka.errors` builds."""

    code: grpc.StatusCode
    message: str
    trailer: tuple[tuple[str, bytes], ...] = ()

    async def send(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(self.code, self.message, trailing_metadata=self.trailer)


def _abort_code(err: Exception) -> Abort:
    """The one server boundary: an OrkaError goes out as its class's code with its details;
    anything else is a bug of ours, sent as INTERNAL with no detail of it (it is logged)."""
    if isinstance(err, OrkaError):
        return Abort(err.code, wire_message(err), trailing_metadata(err))
    return Abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}")


# ---- the audit hook ----


@dataclass(frozen=True)
class Caller:
    """Who made a call, as far as their certificate says: refused calls are audited too, so
    the identity is read even when the role is not allowed (None: no usable certificate)."""

    identity: Identity | None
    serial: str  # the certificate's serial number in hex, as `openssl x509 -serial` prints it
    peer: str  # the transport address, e.g. ipv4:127.0.0.1:51234


@dataclass(frozen=True)
class Call:
    """One finished call, for the auditor: what was asked, by whom, and how it ended."""

    method: str
    request: Any
    caller: Caller
    code: grpc.StatusCode
    message: str


class Auditor(Protocol):
    """A servicer opts in to auditing with an `auditor` attribute (orka/controller/audit.py).
    `wants` is asked first so that calls not audited cost a set lookup only."""

    def wants(self, method: str) -> bool: ...

    def record(self, call: Call) -> None: ...


def _serial(pem: bytes) -> str:
    try:
        return format(peer_cert.serial(pem), "X")
    except Unauthenticated:
        return ""


def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    certs = context.auth_context().get(PEER_CERT_KEY) or []
    identity: Identity | None = None
    serial = ""
    if certs:
        pem = bytes(certs[0])
        serial = _serial(pem)
        try:
            identity = identity_from_pem(pem)
        except OrkaError:
            identity = None
    return Caller(identity=identity, serial=serial, peer=context.peer() or "")


class _Audit:
    """One call's audit, when its servicer wants it. The caller is read when the call starts:
    a stream may end after gRPC has let go of its context (a generator closed late), and
    reading a released context's auth data crashes the process."""

    def __init__(
        self, servicer: Any, method: str, request: Any, context: grpc.aio.ServicerContext
    ) -> None:
        auditor: Auditor | None = getattr(servicer, "auditor", None)
        self.auditor = auditor if auditor is not None and auditor.wants(method) else None
        self.method = method
        self.request = request
        self.caller = caller_of(context) if self.auditor is not None else None

    def __call__(self, code: grpc.StatusCode, message: str = "") -> None:
        if self.auditor is None or self.caller is None:
            return
        try:
            self.auditor.record(Call(self.method, self.request, self.caller, code, message))
        except Exception:
            # The call's outcome stands; a broken audit sink is reported, not the caller's.
            log.exception("audit record failed", method=self.method)


def unary(
    roles: Collection[str],
) -> Callable[
    [Callable[[Any, Req, Identity], Awaitable[Resp]]],
    Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
]:
    """The error boundary of a unary RPC: checks the caller's role, maps OrkaError to a code."""

    def wrap(fn: Callable[[Any, Req, Identity], Awaitable[Resp]]) -> Any:
        @functools.wraps(fn)
        async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
            audit = _Audit(self, fn.__name__, request, context)
            try:
                who = require_role(context, roles)
                reply = await fn(self, request, who)
            except asyncio.CancelledError:
                # The client went away; a write may or may not have landed.
                audit(grpc.StatusCode.CANCELLED)
                raise
            except Exception as err:
                abort = _abort_code(err)
                if abort.code is grpc.StatusCode.INTERNAL:
                    log.exception("rpc failed", method=fn.__name__)
                audit(abort.code, abort.message)
                await abort.send(context)
                raise  # unreachable: abort raises
            audit(grpc.StatusCode.OK)
            return reply

        return handler

    return wrap


def stream(
    roles: Collection[str],
) -> Callable[[Callable[..., AsyncIterator[Resp]]], Callable[..., AsyncIterator[Resp]]]:
    """The same boundary for server-streaming and bidirectional RPCs."""

    def wrap(fn: Callable[..., AsyncIterator[Resp]]) -> Any:
        @functools.wraps(fn)
        async def handler(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Resp]:
            # Recorded when the stream ends, with how it ended (the hook exec and logs need).
            audit = _Audit(self, fn.__name__, request, context)
            try:
                who = require_role(context, roles)
                async for item in fn(self, request, who):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                # The client went away: gRPC cancels the task while it waits for the next item,
                # or closes the generator while it waits at a yield.
                audit(grpc.StatusCode.CANCELLED)
                raise
            except Exception as err:
                abort = _abort_code(err)
                if abort.code is grpc.StatusCode.INTERNAL:
                    log.exception("stream failed", method=fn.__name__)
                audit(abort.code, abort.message)
                await abort.send(context)
            else:
                audit(grpc.StatusCode.OK)

        return handler

    return wrap


Wrapper = Callable[[Callable[..., Any]], Any]


def boundaries(**methods: Wrapper | tuple[Wrapper, ...]) -> Callable[[S], S]:
    """Class decorator: the RPC boundary of each handler of a servicer, as one table.

    `Name=unary(roles=...)` (or a tuple, the first wrapping outermost, as stacked decorators
    would) wraps the method `Name`. The class is refused when it overrides an RPC of its
    generated servicer without naming a boundary for it: a handler added without a role check
    would answer anyone holding a certificate of the cluster. A table rather than a decorator
    on each method, because mutation testing (mutmut) skips decorated functions: the handlers'
    own checks are the code it most needs to reach."""

    def apply(cls: S) -> S:
        for name, given in methods.items():
            fn = cls.__dict__.get(name)
            if fn is None:
                raise TypeError(f"{cls.__name__}.{name}: no such method to guard")
            for wrap in reversed(given if isinstance(given, tuple) else (given,)):
                fn = wrap(fn)
            setattr(cls, name, fn)
        rpcs = {
            name
            for base in cls.__mro__[1:]
            if base.__module__.endswith("_pb2_grpc")
            for name, value in vars(base).items()
            if callable(value) and not name.startswith("_")
        }
        open_ = sorted(n for n in rpcs if n in cls.__dict__ and n not in methods)
        if open_:
            raise TypeError(f"{cls.__name__}: RPC handlers without a boundary: {', '.join(open_)}")
        return cls

    return apply
