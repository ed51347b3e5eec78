"""Client plumbing: mutual-TLS channels and the one place gRPC codes become OrkaError again."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from orka.errors import Invalid, from_status
from orka.rpc.server import grpc_options
from orka.security.tls import TlsFiles, channel_credentials

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def split_targets(value: str, flag: str) -> list[str]:
    targets = [t.strip() for t in value.split(",") if t.strip()]
    if not targets:
        raise Invalid(f"{flag}: at least one HOST:PORT is required")
    for t in targets:
        host, sep, port = t.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise Invalid(f"{flag}: {t!r} is not HOST:PORT")
    return targets


def secure_channel(target: str, tls: TlsFiles, bulk: bool = False) -> grpc.aio.Channel:
    """A mutual-TLS channel; `bulk` for a client that downloads large replies (see
    `grpc_options`)."""
    return grpc.aio.secure_channel(
        target, channel_credentials(tls), options=grpc_options(bulk=bulk)
    )


async def call(
    method: Callable[..., Awaitable[Resp]], request: Req, timeout: float | None = 30.0
) -> Resp:
    """Invoke a unary RPC; a failure comes back as the matching OrkaError subclass."""
    try:
        return await method(request, timeout=timeout)
    except grpc.aio.AioRpcError as err:
        raise from_status(err.code(), err.details() or "") from None
