"""Which of several controllers (or schedulers) on one store leads, and what the others tell
callers. Written for the controller, whose terms are described here; the scheduler's standby
mode (orka/scheduler/service.py) runs its terms the same way.

Only the leader runs the reconciler, the placement queue and the scheduler feed, and only it
writes. A follower keeps no cache at all: it answers every `orka.v1.Controller` RPC with
UNAVAILABLE naming the leader's address, and its health service reports NOT_SERVING for
`orka.v1.Controller`, so load balancers and the CLI find the leader. (Answering reads from a
store re-read would halve nothing that matters here and invite stale answers; redirecting keeps
one source of truth per moment.)

A term runs: campaign → `lead()` (reload from the store, start the leader-only parts) → wait
until the election's lease is lost → `step_down()` (stop them, drop the caches) → campaign
again. Two controllers never write as leaders at once: a leader that has not yet noticed its
lease expired (paused, cut off) still carries its term's fence in every write (a `Require` on
its own election key, in the same transaction), so its writes fail once a successor holds the
key, and that failure (`Fenced`) ends its term at once through `election.fenced()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable

import structlog

from orka.errors import NotLeader, OrkaError
from orka.store.election import Election, address_of

log = structlog.get_logger("orka.leadership")

# How long a follower trusts the leader address it last read before reading it again.
LEADER_CACHE_SECONDS = 1.0


def default_advertise(listen: str, port: int) -> str:
    """The API address other processes should use: the listen address with a wildcard host made
    loopback and a port 0 replaced by the bound port."""
    host, _, listen_port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port if listen_port in ('', '0') else listen_port}"


class Leadership:
    def __init__(
        self,
        election: Election,
        lead: Callable[[], Awaitable[None]],
        step_down: Callable[[], Awaitable[None]],
    ) -> None:
        self.election = election
        self._lead = lead
        self._step_down = step_down
        self.leading = asyncio.Event()
        # Set once the first round has an outcome (leading, or another leader seen), so that
        # start() returns a controller that knows its role.
        self.settled = asyncio.Event()
        self.terms = 0
        self.elected_at: float | None = None
        self._leader_cache: tuple[float, str | None] = (0.0, None)

    @property
    def is_leader(self) -> bool:
        # Both: `leading` only once the term is set up, `is_leader` drops the instant the lease
        # is known lost (before step_down has finished).
        return self.leading.is_set() and self.election.is_leader

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self._round()
                failures = 0
            except asyncio.CancelledError:
                raise
            except OrkaError as err:
                # Typically the store is unreachable; campaign again after a pause.
                failures += 1
                delay = min(0.2 * 2**failures, 5.0) * random.uniform(0.5, 1.0)
                log.warning("leadership round failed", error=err.message, retry_in=round(delay, 2))
                with contextlib.suppress(OrkaError):
                    await self.election.resign()
                await asyncio.sleep(delay)

    async def _round(self) -> None:
        if not self.settled.is_set():
            current = await self.election.leader()
            if current is not None and current != self.election.identity:
                log.info("following", leader=current)
                self.settled.set()
        await self.election.campaign()
        try:
            await self._lead()
            self.terms += 1
            self.elected_at = time.monotonic()
            self.leading.set()
            self.settled.set()
            log.info("leading", identity=self.election.identity, term=self.terms)
            await self.election.lost.wait()
            log.warning("lease lost; stepping down", identity=self.election.identity)
        finally:
            self.leading.clear()
            # Shielded: a stop that cancels us mid-step-down must still stop the leader parts.
            await asyncio.shield(self._step_down())
        # Release what is left of the old lease before campaigning with a new one.
        await self.election.resign()

    async def leader_address(self) -> str | None:
        at, cached = self._leader_cache
        if time.monotonic() - at < LEADER_CACHE_SECONDS:
            return cached
        try:
            record = await self.election.leader_info()
        except OrkaError:
            return cached
        address = None if record is None else address_of(record)
        self._leader_cache = (time.monotonic(), address)
        return address

    async def require(self) -> None:
        """Raise NotLeader (UNAVAILABLE, reason NOT_LEADER) unless this controller leads right
        now; it carries the leader's address in its ErrorInfo metadata when one is known."""
        if self.is_leader:
            return
        address = await self.leader_address()
        if address is None or address == self.election.identity:
            raise NotLeader("not the leader; no leader is elected yet, retry shortly")
        raise NotLeader(f"not the leader; the leader is at {address}", leader=address)

    async def close(self) -> None:
        """Give leadership up cleanly, so a standby takes over without waiting for the TTL."""
        with contextlib.suppress(OrkaError):
            await self.election.resign()
