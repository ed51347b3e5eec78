"""Client plumbing: mutual-TLS channels and the one place a failed call becomes OrkaError again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from orka.errors import Invalid, Unavailable, from_rpc_error
from orka.rpc.server import MAX_MESSAGE_BYTES, grpc_options
from orka.security.ca import role_dns_name
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


def secure_channel(
    target: str,
    tls: TlsFiles,
    server_role: str,
    bulk: bool = False,
    max_receive: int | None = MAX_MESSAGE_BYTES,
) -> grpc.aio.Channel:
    """A mutual-TLS channel to a server that must prove it holds a `server_role` certificate.

    The handshake verifies the server against the role's reserved DNS name (`scheduler.orka`,
    `controller.orka`) instead of the dialled host, so a peer with any other Orka certificate
    (an agent's, an admin's, the wrong service's) fails the handshake before a byte of the
    call is sent. The role is required: no default accepts any server. `bulk` is for a client
    that downloads many pages, `max_receive` None gRPC's default limit for the public API
    (see `grpc_options`).
    """
    options = [
        *grpc_options(bulk=bulk, max_receive=max_receive),
        # The override also becomes each call's :authority, which Orka's servers ignore. Not
        # setting `grpc.default_authority` back to `target` is deliberate: gRPC then checks
        # per call that the server certificate names that host too ("call host does not
        # match SSL server name"), which would tie the role check to host names again.
        ("grpc.ssl_target_name_override", role_dns_name(server_role)),
    ]
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=options)


def refused_role(details: str, server_role: str) -> str | None:
    """Why the handshake refused the server, when it did so for not proving `server_role`.

    `details` is an UNAVAILABLE status's text; gRPC words these failures as TLS internals.
    """
    if "Hostname Verification" in details:
        return (
            f"the server's certificate does not name role {server_role} "
            f"({role_dns_name(server_role)})"
        )
    if "unsupported certificate purpose" in details:
        return "the server's certificate is not for serving (no serverAuth)"
    return None


async def call(
    method: Callable[..., Awaitable[Resp]], request: Req, timeout: float | None = 30.0
) -> Resp:
    """Invoke a unary RPC; a failure comes back as the exact OrkaError class the server raised
    (from the status' ErrorInfo reason), with its field violations, metadata and retry delay."""
    try:
        return await method(request, timeout=timeout)
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None
    except asyncio.CancelledError:
        # grpc.aio cancels the calls in flight on a channel that is closed under them (a
        # client dropping a connection it found broken). For the caller that is the server
        # gone, not a request to stop: as CancelledError it would end the calling task as if
        # cancelled, silently (a controller's reconciler did just that in the chaos soak).
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise Unavailable("the connection closed during the call; retry") from None
