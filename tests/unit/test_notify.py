"""sd_notify against a real unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orka.cli.services import GracefulStop, notified
from orka.notify import NOTIFY_VARIABLES, Notifier, watchdog_interval


class Systemd:
    """The receiving end of NOTIFY_SOCKET: one datagram per sd_notify call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def next(self, timeout: float = 5.0) -> str:
        loop = asyncio.get_running_loop()
        data = await asyncio.wait_for(loop.sock_recv(self.sock, 4096), timeout)
        return data.decode()

    async def nothing_more(self, within: float = 0.3) -> None:
        with pytest.raises(TimeoutError):
            extra = await self.next(within)
            pytest.fail(f"unexpected message {extra!r}")


def _bind(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setblocking(False)
    return sock


@pytest.fixture(params=["path", "abstract"])
def systemd(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Systemd]:
    """systemd uses a path; `@name` (an abstract socket) is what nspawn and tests often pass."""
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock, env = _bind(address), address
    else:
        name = f"orka-test-{uuid.uuid4().hex}"
        sock, env = _bind("\0" + name), "@" + name
    monkeypatch.setenv("NOTIFY_SOCKET", env)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield Systemd(sock)
    sock.close()


async def test_ready_watchdog_stopping_in_order(
    systemd: Systemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 s period: one ping at start, the next one not before 1 s, after this test is done.
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier()
    # Consumed: an instance the agent starts must not inherit systemd's socket.
    assert [v for v in NOTIFY_VARIABLES if v in os.environ] == []
    assert notifier.watchdog_interval == 1.0
    serving, stop = asyncio.Event(), asyncio.Event()

    async def ready() -> str:
        await serving.wait()
        return "serving on port 7443"

    task = asyncio.create_task(notified(stop.wait, ready, notifier))
    assert await systemd.next() == "WATCHDOG=1"
    await systemd.nothing_more()  # not ready until the service says so
    serving.set()
    assert await systemd.next() == "READY=1\nSTATUS=serving on port 7443"
    stop.set()
    await task
    assert await systemd.next() == "STOPPING=1\nSTATUS=stopping"
    await systemd.nothing_more()


async def test_watchdog_pings_at_half_the_period(
    systemd: Systemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # 0.4 s: a ping every 0.2 s
    notifier = Notifier()
    loop = asyncio.get_running_loop()
    pinger = asyncio.create_task(notifier.watchdog())
    times = []
    try:
        for _ in range(4):
            assert await systemd.next() == "WATCHDOG=1"
            times.append(loop.time())
    finally:
        pinger.cancel()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(0.15 < gap < 0.35 for gap in gaps), gaps


async def test_a_signal_reports_stopping_once(systemd: Systemd) -> None:
    """The SIGTERM handler says STOPPING at once, while the shutdown is still under way (a
    leave may take a while); the end of run() does not say it again."""

    class Service:
        def __init__(self) -> None:
            self.stopped = asyncio.Event()
            self.release = asyncio.Event()

        async def run(self) -> None:
            await self.stopped.wait()

        async def stop(self) -> None:
            await self.release.wait()  # a slow shutdown
            self.stopped.set()

    service = Service()
    graceful = GracefulStop(service, Notifier())

    async def ready() -> str:
        return "up"

    task = asyncio.create_task(graceful.run(ready))
    assert await systemd.next() == "READY=1\nSTATUS=up"
    graceful.handler()
    assert await systemd.next() == "STOPPING=1\nSTATUS=stopping"
    assert not task.done()
    service.release.set()
    await task
    await systemd.nothing_more()


async def test_no_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "1000")
    notifier = Notifier()
    assert (notifier.enabled, notifier.watchdog_interval) == (False, None)
    notifier.ready("x")
    notifier.stopping()
    await asyncio.wait_for(notifier.watchdog(), 1)  # returns at once: nothing to ping


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "abc"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], interval: float | None) -> None:
    assert watchdog_interval(environ, pid=4242) == interval
