"""The interceptor every Orka server has: a revoked peer's call is refused before its handler
runs, whatever kind of handler it is, with the status details every refusal carries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orka.rpc.revocation_check import RevocationInterceptor, checked_handler
from orka.security.identity import PEER_CERT_KEY
from orka.security.revocation import REVOKED, REVOKED_DETAILS, Revocations
from orka.security.revoke import serial_of

REFUSAL = (grpc.StatusCode.UNAUTHENTICATED, REVOKED, REVOKED_DETAILS)


class Context:
    def __init__(self, pem: bytes | None) -> None:
        self.pem = pem
        self.aborted: list[tuple[grpc.StatusCode, str, object]] = []

    def auth_context(self) -> dict[str, list[bytes]]:
        return {PEER_CERT_KEY: [self.pem]} if self.pem is not None else {}

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()
    ) -> None:
        self.aborted.append((code, details, trailing_metadata))
        raise grpc.aio.AbortError()


async def _answer(request: bytes, context: Any) -> bytes:
    return b"answer to " + request


async def _answers(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for i in range(2):
        yield b"%d" % i


async def _unary(handler: grpc.RpcMethodHandler, context: Context) -> bytes:
    return await handler.unary_unary(b"q", context)  # type: ignore[no-any-return]


async def _stream(handler: grpc.RpcMethodHandler, context: Context) -> list[bytes]:
    return [item async for item in handler.unary_stream(b"q", context)]


@pytest.fixture
def registry(certs: Path) -> Revocations:
    r = Revocations()
    r.update(certs / "crl.pem", frozenset({serial_of(certs, "admin", "admin")}))
    return r


async def test_a_revoked_peer_is_refused_before_a_unary_handler_runs(
    certs: Path, registry: Revocations
) -> None:
    handler = checked_handler(grpc.unary_unary_rpc_method_handler(_answer), registry)
    revoked = Context((certs / "admin.crt").read_bytes())
    with pytest.raises(grpc.aio.AbortError):
        await _unary(handler, revoked)
    assert revoked.aborted == [REFUSAL]
    node = Context((certs / "agent-node-1" / "agent-node-1.crt").read_bytes())
    assert await _unary(handler, node) == b"answer to q"
    assert node.aborted == []


async def test_a_revoked_peer_is_refused_before_a_streaming_handler_yields(
    certs: Path, registry: Revocations
) -> None:
    handler = checked_handler(grpc.unary_stream_rpc_method_handler(_answers), registry)
    revoked = Context((certs / "admin.crt").read_bytes())
    with pytest.raises(grpc.aio.AbortError):
        await _stream(handler, revoked)
    assert revoked.aborted == [REFUSAL]
    node = Context((certs / "agent-node-1" / "agent-node-1.crt").read_bytes())
    assert await _stream(handler, node) == [b"0", b"1"]


async def test_a_call_without_a_client_certificate_is_left_to_its_handler(
    registry: Revocations,
) -> None:
    handler = checked_handler(grpc.unary_unary_rpc_method_handler(_answer), registry)
    anonymous = Context(None)
    assert await _unary(handler, anonymous) == b"answer to q"
    assert anonymous.aborted == []


async def test_the_interceptor_checks_against_its_own_registry(
    certs: Path, registry: Revocations
) -> None:
    wrapped = RevocationInterceptor(registry).wrap(
        grpc.unary_unary_rpc_method_handler(_answer), "/orka.test.Probe/Who"
    )
    revoked = Context((certs / "admin.crt").read_bytes())
    with pytest.raises(grpc.aio.AbortError):
        await _unary(wrapped, revoked)
    assert revoked.aborted == [REFUSAL]
