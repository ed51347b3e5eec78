"""Refusing a revoked peer on every RPC a server has, its own and the standard ones.

Orka's RPCs check the peer when they read its identity (`identity.peer_identity`); the
standard health service and server reflection never do. This interceptor wraps every method
handler so that the peer's serial is checked before the handler runs, whatever the handler.
A grpc.aio interceptor sees no call context, only the method's name: it returns a handler
whose behaviour (the function gRPC calls with the request and the context) checks first.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from orka.errors import Unauthenticated
from orka.security.identity import PEER_CERT_KEY
from orka.security.revocation import REVOCATIONS, REVOKED, REVOKED_DETAILS, Revocations

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Any]


def _revoked(context: grpc.aio.ServicerContext, registry: Revocations) -> bool:
    # The handshake required a certificate of the cluster CA; without one (not an Orka
    # server) there is nothing to check here, and the handler's own checks still apply.
    certs = context.auth_context().get(PEER_CERT_KEY)
    if not certs:
        return False
    try:
        # Also remembers the call, so a CRL loaded later cuts a health Watch like any stream.
        registry.admit(bytes(certs[0]), context)
    except Unauthenticated:
        return True
    return False


def _checked(behaviour: Behaviour, registry: Revocations) -> Behaviour:
    """`behaviour` behind the revocation check, of the same kind (gRPC tells a streaming
    reply written with context.write from an async generator by the function's kind)."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if _revoked(context, registry):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, REVOKED, trailing_metadata=REVOKED_DETAILS
                )
            async for item in behaviour(request, context):
                yield item

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if _revoked(context, registry):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, REVOKED, trailing_metadata=REVOKED_DETAILS
            )
        result = behaviour(request, context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return call


_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def checked_handler(
    handler: grpc.RpcMethodHandler, registry: Revocations = REVOCATIONS
) -> grpc.RpcMethodHandler:
    kind = next(k for k in _KINDS if getattr(handler, k, None) is not None)
    # RpcMethodHandler is a namedtuple in grpc; _replace keeps the (de)serialisers.
    return handler._replace(**{kind: _checked(getattr(handler, kind), registry)})  # type: ignore[attr-defined]


class RevocationInterceptor(grpc.aio.ServerInterceptor):
    """Installed by `start_server` on every Orka server."""

    def __init__(self, registry: Revocations = REVOCATIONS) -> None:
        self.registry = registry
        # Method -> (the handler gRPC found, its checked copy): handlers are looked up per
        # call, so the wrapping is done once per method, not per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = checked_handler(handler, self.registry)
        if len(self._wrapped) < 4096:  # methods are few; a generic handler could make more
            self._wrapped[method] = (handler, wrapped)
        return wrapped
