"""Reconnect pauses: exponential backoff that ends early when a peer that was down comes up.

A client that lost its server (an agent's stream, the controller's feed) waits before dialling
again, longer after each failure, so a server that refuses or fails calls is not hammered. But
a server that is merely restarting (or a standby taking over) refuses connections outright
until it listens, and a pure exponential schedule then keeps its clients asleep for about as
long again after it came back: the outage doubles, and every client dials at the same moment
of its schedule. So the pause watches the port instead: while the next target refuses TCP
connections, a plain connect (no TLS, no gRPC channel: about a tenth of a millisecond) is
tried every PROBE_EVERY seconds, jittered, and the pause ends as soon as one is accepted.
Clients of a restarted server thus arrive within one probe interval of its start, spread over
that interval rather than all at once. A peer that accepts connections (it answered, then
failed the call) gets the whole pause, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

# Seconds between two probes of a target that refuses connections (each jittered by 0.5-1.5).
PROBE_EVERY = 0.5
# A probe that neither connects nor is refused within this time counts as down.
PROBE_TIMEOUT = 1.0
# Exponent bound: keeps 2**attempt small whatever the attempt count.
MAX_DOUBLINGS = 16


def delay(
    attempt: int,
    base: float,
    cap: float,
    jitter: Callable[[float, float], float] = random.uniform,
) -> float:
    """The pause before retry number `attempt` (1 = the first retry): `base` doubled per
    attempt, at most `cap`, times a random factor in [0.5, 1) so clients spread out."""
    full = min(base * 2 ** min(max(attempt, 0), MAX_DOUBLINGS), cap)
    return full * jitter(0.5, 1.0)


def host_port(target: str) -> tuple[str, int] | None:
    """HOST:PORT (a bracketed IPv6 host unbracketed) as a pair, or None if it is not one."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "localhost", int(port)


async def reachable(target: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether `target` (HOST:PORT) accepts a TCP connection now. The connection is closed at
    once without a byte sent: the server sees a client that went away before its handshake."""
    address = host_port(target)
    if address is None:
        return False
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(*address)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def pause(
    seconds: float,
    target: str,
    probe_every: float = PROBE_EVERY,
    jitter: Callable[[float, float], float] = random.uniform,
) -> None:
    """Wait `seconds` before dialling `target` again, or less: if `target` refuses connections
    when the pause begins, it ends as soon as a probe finds the target accepting them."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    if await reachable(target):
        await asyncio.sleep(max(0.0, end - loop.time()))
        return
    while True:
        left = end - loop.time()
        if left <= 0:
            return
        await asyncio.sleep(min(left, probe_every * jitter(0.5, 1.5)))
        if loop.time() < end and await reachable(target):
            return
