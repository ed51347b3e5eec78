"""Reconnect pauses (orka/rpc/backoff.py), against real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from orka.rpc import backoff


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_delay_doubles_up_to_the_cap_with_jitter_below_the_full_step() -> None:
    top = lambda lo, hi: hi  # noqa: E731 - the jitter's upper end
    low = lambda lo, hi: lo  # noqa: E731
    assert [backoff.delay(n, 0.2, 5.0, top) for n in (1, 2, 3, 4, 5, 6)] == [
        0.4,
        0.8,
        1.6,
        3.2,
        5.0,
        5.0,
    ]
    assert backoff.delay(3, 0.2, 5.0, low) == 0.8
    assert backoff.delay(10**6, 0.1, 3.0, top) == 3.0  # no overflow on a long outage
    assert 0.1 <= backoff.delay(1, 0.1, 3.0) < 0.2


async def _serve(port: int) -> asyncio.Server:
    return await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)


async def test_reachable_tells_a_listening_port_from_a_closed_one() -> None:
    port = free_port()
    assert not await backoff.reachable(f"127.0.0.1:{port}")
    server = await _serve(port)
    try:
        assert await backoff.reachable(f"127.0.0.1:{port}")
    finally:
        server.close()
    assert not await backoff.reachable("no-port-here")


async def test_a_pause_ends_soon_after_a_refusing_peer_starts_listening() -> None:
    port = free_port()
    start = time.monotonic()
    waiter = asyncio.create_task(backoff.pause(30.0, f"127.0.0.1:{port}", probe_every=0.1))
    await asyncio.sleep(0.5)
    assert not waiter.done()  # still refused: still waiting
    server = await _serve(port)
    try:
        async with asyncio.timeout(5):
            assert await waiter is False  # not "still refusing": dial now
    finally:
        server.close()
    assert time.monotonic() - start < 2.0


async def test_a_pause_is_served_in_full_when_the_peer_accepts_connections() -> None:
    # It answered and then failed the call: the backoff is what protects it.
    port = free_port()
    server = await _serve(port)
    try:
        start = time.monotonic()
        assert await backoff.pause(0.6, f"127.0.0.1:{port}", probe_every=0.05) is False
        assert time.monotonic() - start >= 0.6
    finally:
        server.close()


async def test_a_pause_on_a_peer_that_stays_down_lasts_its_full_time() -> None:
    port = free_port()
    start = time.monotonic()
    # Refused to the end: the caller may leave its dial out.
    assert await backoff.pause(0.5, f"127.0.0.1:{port}", probe_every=0.05) is True
    assert 0.5 <= time.monotonic() - start < 2.0


async def test_a_probe_tells_refused_from_accepted_from_no_answer() -> None:
    port = free_port()
    assert await backoff.probe(f"127.0.0.1:{port}") is False
    server = await _serve(port)
    try:
        assert await backoff.probe(f"127.0.0.1:{port}") is True
    finally:
        server.close()
    assert await backoff.probe("no-port-here") is None
    # A port nobody answers on within the timeout (a full listen backlog would do; a
    # non-routable address would leave loopback): 0 s is "no answer" before any reply.
    assert await backoff.probe(f"127.0.0.1:{port}", timeout=0) is None


def test_delay_starts_at_the_base_for_attempt_zero_and_below() -> None:
    top = lambda lo, hi: hi  # noqa: E731
    assert [backoff.delay(n, 0.2, 5.0, top) for n in (-3, 0, 1)] == [0.2, 0.2, 0.4]


@pytest.mark.parametrize(
    ("target", "address"),
    [
        ("10.0.0.1:7444", ("10.0.0.1", 7444)),
        ("[::1]:7444", ("::1", 7444)),
        ("[fd00::1:2]:80", ("fd00::1:2", 80)),
        (":7444", ("localhost", 7444)),
        ("X1:80", ("X1", 80)),
        ("host:abc", None),
        ("host:", None),
        ("7444", None),
    ],
)
def test_host_port_splits_at_the_last_colon_and_unbrackets(
    target: str, address: tuple[str, int] | None
) -> None:
    assert backoff.host_port(target) == address


async def test_a_pause_of_nothing_on_a_listening_peer_waits_for_nothing() -> None:
    port = free_port()
    server = await _serve(port)
    try:
        start = time.monotonic()
        assert await backoff.pause(0.0, f"127.0.0.1:{port}") is False
        assert time.monotonic() - start < 0.9  # not rounded up to any minimum
    finally:
        server.close()


async def test_a_pause_probes_at_its_interval_times_the_jitter() -> None:
    port = free_port()
    asked: list[tuple[float, float]] = []

    def jitter(lo: float, hi: float) -> float:
        asked.append((lo, hi))
        return 4.0  # outside the real range: 0.1 s becomes 0.4 s between probes

    async def listen_soon() -> asyncio.Server:
        await asyncio.sleep(0.15)
        return await _serve(port)

    start = time.monotonic()
    later = asyncio.create_task(listen_soon())
    waited = await backoff.pause(5.0, f"127.0.0.1:{port}", probe_every=0.1, jitter=jitter)
    elapsed = time.monotonic() - start
    (await later).close()
    assert waited is False
    assert elapsed >= 0.4  # found at the probe after 0.4 s, not at one after 0.025 s
    assert asked and set(asked) == {(0.5, 1.5)}


def test_a_blocking_probe_tells_refused_from_accepted_from_no_answer() -> None:
    port = free_port()
    assert backoff.probe_blocking(f"127.0.0.1:{port}") is False
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert backoff.probe_blocking(f"127.0.0.1:{port}") is True
        # A timeout of 0 makes the socket non-blocking: the connect cannot complete at once.
        assert backoff.probe_blocking(f"127.0.0.1:{port}", timeout=0) is None
    assert backoff.probe_blocking("no-port-here") is None


async def test_reachable_passes_its_timeout_on() -> None:
    port = free_port()
    server = await _serve(port)
    try:
        # A zero timeout ends the probe before its connection completes.
        assert await backoff.reachable(f"127.0.0.1:{port}", timeout=0) is False
        assert await backoff.reachable(f"127.0.0.1:{port}") is True
    finally:
        server.close()
