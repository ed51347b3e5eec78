"""Server interceptors that wrap each method's behaviour (the revocation check, RPC metrics):
gRPC looks the handler up on every call, so the wrapped copy is made once per method and kept."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
# Methods are few; a generic handler could make more, so the cache stops growing here.
MAX_WRAPPED = 4096


def replace_behaviour(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """The handler with its behaviour (whichever of the four kinds it is) wrapped."""
    kind = next(k for k in _KINDS if getattr(handler, k, None) is not None)
    # RpcMethodHandler is a namedtuple in grpc; _replace keeps the (de)serialisers.
    return handler._replace(**{kind: wrap(getattr(handler, kind))})  # type: ignore[attr-defined]


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Calls `wrap(handler, path)` once per method (path `/package.Service/Method`) and hands
    out the copy afterwards. Unknown methods pass through: gRPC answers UNIMPLEMENTED."""

    def __init__(self) -> None:
        # Path -> (the handler gRPC found, its wrapped copy).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    @abstractmethod
    def wrap(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler: ...

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        path = handler_call_details.method
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, path)
        if len(self._wrapped) < MAX_WRAPPED:
            self._wrapped[path] = (handler, wrapped)
        return wrapped
