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
failed the call) gets the whole pause, as before. A pause that runs out with the target
still refusing says so, and the agent then leaves its dial out (orka/agent/stream.py): a
dial there would cost a TLS channel and a refusal, by the thousand while a scheduler restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
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


async def probe(target: str, timeout: float = PROBE_TIMEOUT) -> bool | None:
    """Dial `target` (HOST:PORT) once over plain TCP: True if it accepts the connection, False
    if it refuses it (the host answered: nothing listens on that port), None if neither
    within `timeout` (or `target` is no HOST:PORT). The connection is closed at once without
    a byte sent: the server sees a client that went away before its handshake."""
    address = host_port(target)
    if address is None:
        return None
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(*address)
    except ConnectionRefusedError:
        return False
    except (OSError, TimeoutError):
        return None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def probe_blocking(target: str, timeout: float = PROBE_TIMEOUT) -> bool | None:
    """`probe`, blocking the calling thread: for a caller that dials from a worker thread
    because its own event loop may be too busy to see a refusal in time (takeover.py)."""
    address = host_port(target)
    if address is None:
        return None
    try:
        connection = socket.create_connection(address, timeout=timeout)
    except ConnectionRefusedError:
        return False
    except OSError:
        return None
    connection.close()
    return True


async def reachable(target: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether `target` (HOST:PORT) accepts a TCP connection now."""
    return await probe(target, timeout) is True


async def pause(
    seconds: float,
    target: str,
    probe_every: float = PROBE_EVERY,
    jitter: Callable[[float, float], float] = random.uniform,
) -> bool:
    """Wait `seconds` before dialling `target` again, or less: if `target` refuses connections
    when the pause begins, it ends as soon as a probe finds the target accepting them.
    True when the pause ran out with the target's last probe refused (nothing listened there
    a moment ago), False otherwise."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    last = await probe(target)
    if last:
        await asyncio.sleep(max(0.0, end - loop.time()))
        return False
    while True:
        left = end - loop.time()
        if left <= 0:
            return last is False
        await asyncio.sleep(min(left, probe_every * jitter(0.5, 1.5)))
        if loop.time() < end:
            last = await probe(target)
            if last:
                return False
