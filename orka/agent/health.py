"""Health checks the agent runs against its running instances (the spec's `health_check`).

Each checked instance gets one `Checker`: one asyncio task that sleeps between probes, no
thread, so a node with 1,000 checked instances keeps 1,000 sleeping tasks and a timer each
(bench/bench_health.py measures what that costs). The first probe waits `initial_delay` plus a
random part of a second or two (FIRST_PROBE_SPREAD), so instances that start together do not
probe in lockstep.

`CheckState` is the verdict alone: `failure_threshold` failures in a row make the instance
UNHEALTHY, `success_threshold` passes in a row HEALTHY; anything in between keeps the last
verdict (UNKNOWN until the first). The supervisor acts on a verdict (orka/agent/supervisor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable

import structlog

from orka.models import HealthCheck, HealthState, PortBinding

log = structlog.get_logger("orka.agent.health")

# A probe: None when the check passed, else why it failed (what the user reads).
Probe = Callable[[], Awaitable[str | None]]
Verdict = Callable[[HealthState, str], None]

# An HTTP check reads the status line only, and at most this much of it.
MAX_STATUS_LINE = 4096
# The first probe comes up to this much (or one interval, if shorter) after initial_delay, at
# random: instances started together (an agent re-adopting hundreds) do not probe in lockstep,
# and a new instance is not kept from HEALTHY (a rollout's next step) for a whole interval.
FIRST_PROBE_SPREAD = 2.0
# A failure message reported to the controller is cut to this many characters.
MAX_FAILURE_MESSAGE = 512


class CheckState:
    """The verdict of a run of probe results (no I/O, no clock: the unit tests drive it)."""

    def __init__(self, check: HealthCheck) -> None:
        self.check = check
        self.health = HealthState.UNKNOWN
        self.successes = 0
        self.failures = 0
        self.last_failure = ""

    def record(self, failure: str | None) -> HealthState | None:
        """One probe's result; the new health when it changes, else None."""
        if failure is None:
            self.successes += 1
            self.failures = 0
            if self.health is not HealthState.HEALTHY and (
                self.successes >= self.check.success_threshold
            ):
                self.health = HealthState.HEALTHY
                return self.health
            return None
        self.failures += 1
        self.successes = 0
        self.last_failure = failure[:MAX_FAILURE_MESSAGE]
        if self.health is not HealthState.UNHEALTHY and (
            self.failures >= self.check.failure_threshold
        ):
            self.health = HealthState.UNHEALTHY
            return self.health
        return None


class Checker:
    """Runs one instance's probe every `interval` and reports each change of verdict."""

    def __init__(
        self,
        name: str,
        check: HealthCheck,
        probe: Probe,
        on_verdict: Verdict,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self.check = check
        self.state = CheckState(check)
        self._probe = probe
        self._on_verdict = on_verdict
        self._sleep = sleep
        self._clock = clock
        self._jitter = jitter
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"health-{self.name}")

    def stop(self) -> None:
        """Idempotent; a probe under way is cancelled with it (an exec probe kills its
        command)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def probe_once(self) -> str | None:
        """One probe within the timeout; why it failed, or None."""
        timeout = self.check.timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._probe()
        except TimeoutError:
            return f"{self.check.mode} check timed out after {timeout:g}s"
        except OSError as err:
            return f"{self.check.mode} check: {_why(err)}"

    async def _run(self) -> None:
        check = self.check
        try:
            spread = min(check.interval, FIRST_PROBE_SPREAD)
            await self._sleep(check.initial_delay + self._jitter() * spread)
            while True:
                began = self._clock()
                failure = await self.probe_once()
                health = self.state.record(failure)
                if health is not None:
                    message = self.state.last_failure if health is HealthState.UNHEALTHY else ""
                    self._on_verdict(health, message)
                # Every `interval` from one start to the next; a slow probe does not add up.
                await self._sleep(max(0.0, check.interval - (self._clock() - began)))
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here must not kill the agent nor stay silent; the instance keeps its
            # last verdict.
            log.exception("health checker failed", instance=self.name)


def target(
    port: str, address: str, host_ip: str, ports: list[PortBinding]
) -> tuple[str, int] | str:
    """Where a tcp or http check connects: an instance with an address of its own (a bridged
    process, a container, a VM) at its address and its own port; any other on its node's host
    port at the node's address (loopback when that is empty or a wildcard). A str: why the
    port cannot be reached."""
    if port.isdigit():
        return _host(address, host_ip), int(port)
    binding = next((b for b in ports if b.name == port), None)
    if binding is None:
        return f"the instance has no port named {port!r}"
    number = binding.port if address and binding.port else binding.host_port
    if not number:
        return f"port {port!r} has no number yet"
    return _host(address, host_ip), number


def _host(address: str, host_ip: str) -> str:
    if address:
        return address
    if not host_ip:
        return "127.0.0.1"
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host_ip)
        if ip.is_unspecified:
            return "::1" if ip.version == 6 else "127.0.0.1"
    return host_ip


def _why(err: OSError) -> str:
    """The error's own words: asyncio's connect errors carry the address again in strerror
    ("Connect call failed ('127.0.0.1', 80)"); errno says it plainly ("Connection refused")."""
    if err.errno:
        return os.strerror(err.errno)
    return str(err) or type(err).__name__


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _connect(host: str, port: int) -> socket.socket:
    # A bare non-blocking socket on the loop: no transport, protocol nor stream objects per
    # probe, which at 1,000 probes a second is most of the agent's share (bench_health.py).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def tcp_probe(host: str, port: int) -> str | None:
    """Connect and close at once; the connection's refusal is the failure."""
    try:
        sock = await _connect(host, port)
    except OSError as err:
        return f"tcp connect to {_where(host, port)}: {_why(err)}"
    sock.close()
    return None


async def http_probe(
    host: str, port: int, path: str, status_min: int, status_max: int
) -> str | None:
    """GET `path` over HTTP/1.0 and read the status line only (at most MAX_STATUS_LINE
    bytes): a status in [status_min, status_max] passes."""
    where = f"http GET {path} on {_where(host, port)}"
    loop = asyncio.get_running_loop()
    try:
        sock = await _connect(host, port)
    except OSError as err:
        return f"{where}: {_why(err)}"
    try:
        request = (
            f"GET {path} HTTP/1.0\r\nHost: {_where(host, port)}\r\n"
            "User-Agent: orka-health-check\r\nConnection: close\r\n\r\n"
        )
        await loop.sock_sendall(sock, request.encode("ascii"))
        data = b""
        while b"\n" not in data:
            if len(data) >= MAX_STATUS_LINE:
                return f"{where}: status line longer than {MAX_STATUS_LINE} bytes"
            chunk = await loop.sock_recv(sock, MAX_STATUS_LINE - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as err:
        return f"{where}: {_why(err)}"
    finally:
        sock.close()
    line = data.split(b"\n", 1)[0]
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        text = line[:80].decode("ascii", "replace").strip()
        return f"{where}: not an HTTP response ({text!r})" if text else f"{where}: no response"
    status = int(parts[1])
    if not status_min <= status <= status_max:
        return f"{where}: status {status} (want {status_min}-{status_max})"
    return None
