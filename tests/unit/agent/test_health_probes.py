"""Health probes in detail, on real loopback sockets: the request an HTTP check sends, status
lines that come in pieces or never end, what is and is not an HTTP status line, the bounds
of the range, errors named plainly, IPv6 loopback; and the checker's own failures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from structlog.testing import capture_logs

from orka.agent import health
from orka.agent.health import Checker, http_probe, target, tcp_probe
from orka.models import HealthCheck, HealthState

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(handle: Handler, host: str = "127.0.0.1") -> AsyncIterator[int]:
    srv = await asyncio.start_server(handle, host, 0)
    async with srv:
        yield srv.sockets[0].getsockname()[1]


def answering(*pieces: bytes, close: bool = True) -> tuple[Handler, list[bytes]]:
    """A server that reads the request, then writes `pieces` one at a time."""
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        for piece in pieces:
            writer.write(piece)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(0.01)
        if close:
            writer.close()
        else:
            await asyncio.sleep(30)  # holds the connection open

    return handle, requests


async def probe(*pieces: bytes, low: int = 200, high: int = 299, close: bool = True) -> str | None:
    handle, _ = answering(*pieces, close=close)
    async with server(handle) as port:
        async with asyncio.timeout(10):
            got = await http_probe("127.0.0.1", port, "/", low, high)
    prefix = f"http GET / on 127.0.0.1:{port}: "
    return got if got is None else got.removeprefix(prefix)


async def test_the_request_is_a_plain_http_1_0_get_naming_the_checker() -> None:
    handle, requests = answering(b"HTTP/1.1 200 OK\r\n\r\n")
    async with server(handle) as port:
        assert await http_probe("127.0.0.1", port, "/healthz", 200, 299) is None
    assert requests == [
        f"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
        "User-Agent: orka-health-check\r\nConnection: close\r\n\r\n".encode()
    ]


async def test_a_status_line_in_pieces_is_put_together() -> None:
    assert await probe(b"HT", b"TP/1.1 2", b"00 OK", b"\r\n\r\n") is None
    assert await probe(b"HTTP/1.1 5", b"03 Busy\r\n") == "status 503 (want 200-299)"


async def test_the_status_line_is_enough_the_rest_is_not_waited_for() -> None:
    assert await probe(b"HTTP/1.1 200 OK\r\n", close=False) is None


@pytest.mark.parametrize(
    ("status", "passes"), [(199, False), (200, True), (299, True), (300, False)]
)
async def test_the_range_includes_both_bounds(status: int, passes: bool) -> None:
    got = await probe(f"HTTP/1.1 {status} X\r\n".encode())
    assert got == (None if passes else f"status {status} (want 200-299)")


async def test_a_status_line_without_a_reason_phrase_passes() -> None:
    assert await probe(b"HTTP/1.1 200\r\n") is None


@pytest.mark.parametrize(
    ("line", "failure"),
    [
        # The first line only, whatever follows it.
        (b"SSH-2.0-OpenSSH\r\nmore lines\r\n", "not an HTTP response ('SSH-2.0-OpenSSH')"),
        # A number in the right place, but not HTTP.
        (b"SMTP 220 ready\r\n", "not an HTTP response ('SMTP 220 ready')"),
        # Bytes that are not ASCII are replaced, not an error of the checker.
        (b"\xff\xfe garbage\r\n", "not an HTTP response ('\ufffd\ufffd garbage')"),
        # At most 80 characters of it.
        (b"y" * 100 + b"\r\n", f"not an HTTP response ('{'y' * 80}')"),
    ],
)
async def test_what_is_not_an_http_status_line_is_quoted_short(line: bytes, failure: str) -> None:
    assert await probe(line) == failure


async def test_a_refused_or_reset_connection_is_named_plainly() -> None:
    async with server(lambda r, w: asyncio.sleep(0)) as closed:
        pass
    got = await http_probe("127.0.0.1", closed, "/", 200, 299)
    assert got == f"http GET / on 127.0.0.1:{closed}: Connection refused"

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        sock = writer.get_extra_info("socket")
        # Linger 0: close sends a reset, not an orderly end.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async with server(reset) as port:
        got = await http_probe("127.0.0.1", port, "/", 200, 299)
    assert got == f"http GET / on 127.0.0.1:{port}: Connection reset by peer"


def test_an_error_without_an_errno_is_named_by_its_text_or_its_type() -> None:
    assert health._why(OSError("no route today")) == "no route today"
    assert health._why(ConnectionError()) == "ConnectionError"
    assert health._why(OSError(111, "ignored")) == "Connection refused"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_ipv6_loopback_is_probed_and_written_in_brackets() -> None:
    handle, requests = answering(b"HTTP/1.1 200 OK\r\n\r\n")
    async with server(handle, "::1") as port:
        assert await tcp_probe("::1", port) is None
        assert await http_probe("::1", port, "/", 200, 299) is None
    assert f"Host: [::1]:{port}\r\n".encode() in requests[-1]
    assert await tcp_probe("::1", port) == f"tcp connect to [::1]:{port}: Connection refused"


@pytest.mark.parametrize(
    ("port", "host_ip", "expected"),
    [
        # A port by number on the host's network: at the node's address.
        ("9000", "192.0.2.1", ("192.0.2.1", 9000)),
        # A node address that is a name, not an IP: used as it is.
        ("9000", "node-1.lan", ("node-1.lan", 9000)),
    ],
)
def test_target_on_the_host_network(port: str, host_ip: str, expected: object) -> None:
    assert target(port, "", host_ip, []) == expected


async def test_a_checker_that_breaks_says_so_with_the_instance_and_stops() -> None:
    def verdict(health_: HealthState, message: str) -> None:
        raise RuntimeError("bug in the verdict")

    async def passes() -> str | None:
        return None

    check = HealthCheck.model_validate({"tcp": {"port": "1"}, "initial_delay": 0})
    checker = Checker("web-1", check, passes, verdict, jitter=lambda: 0.0)
    with capture_logs() as logs:
        checker.start()
        assert checker._task is not None and checker._task.get_name() == "health-web-1"
        async with asyncio.timeout(10):
            await checker._task
    assert [(e["event"], e["instance"], e["exc_info"]) for e in logs] == [
        ("health checker failed", "web-1", True)
    ]
    assert not checker.running
