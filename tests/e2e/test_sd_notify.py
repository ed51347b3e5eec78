"""sd_notify from the real `orka scheduler` and `orka agent` processes, each with a datagram
socket of its own as NOTIFY_SOCKET (what systemd gives a Type=notify unit): READY=1 only once the
service serves (the agent: once registered), WATCHDOG=1 meanwhile, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.procs import free_port

pytestmark = pytest.mark.e2e

WATCHDOG = "WATCHDOG=1"


class Unit:
    """One service process and the socket systemd would read its notifications from."""

    def __init__(self, tmp: Path, name: str, args: list[str]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        address = tmp / f"{name}.notify"
        self.sock.bind(str(address))
        self.log = open(tmp / f"{name}.log", "wb")
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(address),
            "WATCHDOG_USEC": "600000",  # a ping every 0.3 s
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orka.cli.main", *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pings = 0

    def next(self, timeout: float = 15.0) -> str:
        """The next message other than a watchdog ping (those are counted)."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                raise AssertionError(f"no message within {timeout:g}s") from None
            if message != WATCHDOG:
                return message
            self.pings += 1

    def quiet_for(self, seconds: float) -> None:
        """Only watchdog pings for `seconds`."""
        with pytest.raises(AssertionError, match="no message"):
            extra = self.next(seconds)
            pytest.fail(f"unexpected {extra!r}")

    def only_pings(self, count: int, timeout: float = 30.0) -> None:
        """`count` watchdog pings arrive, and nothing else before them (a loaded machine may
        take seconds to start the process: the wait is on the pings, not on a clock)."""
        deadline = time.monotonic() + timeout
        start = self.pings
        while self.pings - start < count:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                raise AssertionError(
                    f"{self.pings - start} of {count} pings in {timeout:g}s"
                ) from None
            assert message == WATCHDOG, f"unexpected {message!r} before {count} pings"
            self.pings += 1

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.sock.close()
        self.log.close()


@pytest.fixture
def units() -> Iterator[list[Unit]]:
    started: list[Unit] = []
    yield started
    for unit in started:
        unit.close()


def test_ready_only_when_serving_then_stopping(
    units: list[Unit], certs_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    common = ["--certs", str(certs_dir), "--log-level", "info"]
    agent_flags = ["--name", "node-1", "--scheduler", f"127.0.0.1:{port}", "--runtime", "fake"]
    agent = Unit(
        tmp_path, "agent", ["agent", *agent_flags, "--data-dir", str(tmp_path / "a"), *common]
    )
    units.append(agent)
    # No scheduler yet: the agent is alive (pinging) but not ready.
    agent.only_pings(3)

    scheduler = Unit(
        tmp_path,
        "scheduler",
        ["scheduler", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "s"), *common],
    )
    units.append(scheduler)
    assert scheduler.next() == f"READY=1\nSTATUS=serving agents on port {port}"
    assert agent.next() == "READY=1\nSTATUS=registered with the scheduler as node node-1"

    agent.proc.send_signal(signal.SIGTERM)
    assert agent.next() == "STOPPING=1\nSTATUS=leaving: moving instances to other nodes"
    assert agent.proc.wait(30) == 0
    scheduler.proc.send_signal(signal.SIGTERM)
    assert scheduler.next() == "STOPPING=1\nSTATUS=stopping"
    assert scheduler.proc.wait(30) == 0
    # Nothing after STOPPING but the pings of a loop still turning while it shut down.
    for unit in (agent, scheduler):
        unit.quiet_for(0.1)
    assert scheduler.pings >= 1
