"""The channel factory: the server role is explicit and decides the name the handshake checks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orka.errors import Invalid, Unavailable
from orka.rpc.client import call, refused_role, secure_channel
from orka.security.issue import init_certs
from orka.security.tls import TlsFiles


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    d = tmp_path_factory.mktemp("certs")
    init_certs(d, ["node-1"])
    return TlsFiles.for_service(d, "agent", "node-1")


def test_server_role_is_required(tls: TlsFiles) -> None:
    with pytest.raises(TypeError):
        secure_channel("127.0.0.1:1", tls)  # type: ignore[call-arg]


@pytest.mark.parametrize("role", ["agent", "admin", "viewer", "", "*"])
async def test_only_a_serving_role_can_be_expected(tls: TlsFiles, role: str) -> None:
    with pytest.raises(Invalid, match=r"^role: .* does not serve"):
        secure_channel("127.0.0.1:1", tls, role)


def test_refused_role_explains_the_handshake_failures() -> None:
    hostname = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom "
        "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."
    )
    assert refused_role(hostname, "scheduler") == (
        "the server's certificate does not name role scheduler (scheduler.orka)"
    )
    purpose = "Tls handshake failed: CERTIFICATE_VERIFY_FAILED: unsupported certificate purpose"
    assert refused_role(purpose, "controller") == (
        "the server's certificate is not for serving (no serverAuth)"
    )
    assert refused_role("failed to connect to all addresses; Connection refused", "x") is None


async def _hanging_call(closing: bool) -> BaseException:
    """A unary call to a real grpc.aio server that never answers, ended by closing the client's
    channel (`closing`) or by cancelling the calling task; what `call()` raises."""

    async def never(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(60)
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "t.S", {"M": grpc.unary_unary_rpc_method_handler(never)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    entered = asyncio.Event()

    async def caller() -> None:
        method = channel.unary_unary("/t.S/M")

        async def send(request: bytes, timeout: float | None) -> bytes:
            entered.set()
            return await method(request, timeout=timeout)

        await call(send, b"", timeout=30)

    task = asyncio.create_task(caller())
    try:
        await entered.wait()
        await asyncio.sleep(0.2)  # the call is on the wire
        if closing:
            await channel.close()
        else:
            task.cancel()
        try:
            await task
        except BaseException as err:  # what it raised is the result
            return err
        raise AssertionError("the call returned")
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_channel_closed_under_a_call_is_unavailable_not_a_cancellation() -> None:
    # grpc.aio cancels the calls of a closed channel; a task ended by that as "cancelled"
    # vanishes without a trace (a controller's reconciler did, in the chaos soak).
    err = await _hanging_call(closing=True)
    assert isinstance(err, Unavailable)
    assert err.message == "the connection closed during the call; retry"


async def test_cancelling_the_caller_still_cancels() -> None:
    err = await _hanging_call(closing=False)
    assert isinstance(err, asyncio.CancelledError)
