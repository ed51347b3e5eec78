"""Refusing a revoked peer on every RPC a server has, its own and the standard ones.

Orka's RPCs check the peer when they read its identity (`identity.peer_identity`); the
standard health service and server reflection never do. This interceptor wraps every method
handler so that the peer's serial is checked before the handler runs, whatever the handler.
A grpc.aio interceptor sees no call context, only the method's name: it returns a handler
whose behaviour (the function gRPC calls with the request and the context) checks first.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from orka.errors import Unauthenticated
from orka.rpc.wrapping import WrappingInterceptor, replace_behaviour
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


def checked_handler(
    handler: grpc.RpcMethodHandler, registry: Revocations = REVOCATIONS
) -> grpc.RpcMethodHandler:
    return replace_behaviour(handler, lambda behaviour: _checked(behaviour, registry))


class RevocationInterceptor(WrappingInterceptor):
    """Installed by `start_server` on every Orka server."""

    def __init__(self, registry: Revocations = REVOCATIONS) -> None:
        super().__init__()
        self.registry = registry

    def wrap(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        return checked_handler(handler, self.registry)
