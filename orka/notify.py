"""systemd's service notifications (sd_notify): READY, WATCHDOG, STOPPING and STATUS.

Under a `Type=notify` unit systemd passes a datagram socket in NOTIFY_SOCKET and, with
`WatchdogSec=`, the watchdog period in WATCHDOG_USEC. Everything here is a no-op without
NOTIFY_SOCKET (a terminal, `orka up`, compose), so the services call it unconditionally.

The wire protocol is sdnotify's (a well-kept, dependency-free implementation); this module adds
what the services need around it: the watchdog period, a loop that pings it, and sending
STOPPING once however many paths stop the service.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping

import sdnotify
import structlog

log = structlog.get_logger(__name__)

# Read once, then removed from the environment: children (the agent's process instances) must
# not inherit them and talk to systemd as if they were the service (sd_notify's
# unset_environment).
NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between two WATCHDOG=1: half the period systemd asked for (sd_watchdog_enabled),
    or None when it asked for none, or asked another process of the unit (WATCHDOG_PID)."""
    usec = environ.get("WATCHDOG_USEC", "")
    owner = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and owner != str(pid):
        return None
    return int(usec) / 1e6 / 2


class Notifier:
    """The service's line to systemd. Build it once, early (it consumes the variables)."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self.watchdog_interval = (
            watchdog_interval(os.environ, os.getpid()) if self.enabled else None
        )
        # sdnotify connects to $NOTIFY_SOCKET (an abstract "@name" too) at construction.
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None
        for name in NOTIFY_VARIABLES:
            os.environ.pop(name, None)
        self._stopping = False

    def send(self, *fields: str) -> None:
        """One datagram of newline-separated KEY=VALUE fields; systemd reads them together."""
        if self._notifier is not None:
            self._notifier.notify("\n".join(fields))

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self, status: str = "stopping") -> None:
        """Once only: a signal handler and the service's own end may both report it."""
        if not self._stopping:
            self._stopping = True
            self.send("STOPPING=1", f"STATUS={status}")

    async def watchdog(self) -> None:
        """Ping systemd from the event loop until cancelled: a loop that stops turning stops
        the pings, and systemd kills and restarts the service after WatchdogSec."""
        if self.watchdog_interval is None:
            return
        log.debug("systemd watchdog", interval=self.watchdog_interval)
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
