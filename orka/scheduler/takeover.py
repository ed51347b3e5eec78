"""A standby takes over from an active scheduler that is gone, without waiting out its lease.

The lease is how a dead leader is found in general, and it costs up to the election TTL (5 s by
default) with every node waiting. A standby often has better evidence sooner: an agent whose
stream to the active one broke registers with it, naming that address unreachable
(`Register.unreachable`). The standby then checks for itself: when the active one's address
refuses TCP connections PROBES times in a row, PROBE_GAP apart, nothing listens there (the
process is gone: killed, crashed, stopped), and the standby ends that leader's term in the
store (`Election.evict`: the lease of the leader it follows revoked, and the key with it).
Every candidate's campaign sees the key go and one is elected at once.

Only a refused connection counts. An active scheduler that is busy, paused (SIGSTOP) or cut off
still completes the TCP handshake, or does not answer at all, and is left to its lease: an
overloaded active one is never deposed by this path, and an agent's word alone (an agent may
lie, or be the one cut off) never moves leadership. Evicting is safe even when wrong, as losing
a lease is: the old leader's writes are fenced by its key, and its next refresh finds the lease
gone and ends its term.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from orka.rpc.backoff import probe_blocking
from orka.store.election import Election, address_of

log = structlog.get_logger("orka.scheduler.takeover")

# Refusals in a row, PROBE_GAP seconds apart, that make an address dead.
PROBES = 2
PROBE_GAP = 0.2
# A connect that neither succeeds nor is refused within this long is no evidence either way.
PROBE_TIMEOUT = 1.0
# After an address was found alive, agents naming it are not acted on again for this long.
# Short: a process SIGKILLed with thousands of connections open still completes TCP
# handshakes for a few tenths of a second while the kernel tears it down, so the first probe
# of a failover often finds it "alive"; the next agent's word must be checked soon after. A
# live active scheduler named by cut-off agents costs one TCP connect per COOLDOWN.
COOLDOWN = 0.25


async def refuses(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether HOST:PORT refuses a TCP connection now (False if it accepts, or is silent).
    Dialled from a worker thread: the answer of a refused connect comes back at once, and a
    standby whose event loop is busy (agents arriving by the thousand) must not count its own
    lateness as the other's silence."""
    return await asyncio.to_thread(probe_blocking, address, timeout) is False


class Takeover:
    """`suspect(unreachable)` for each agent that arrives naming addresses it could not reach;
    at most one check runs at a time, so thousands of agents arriving at once cost one probe."""

    def __init__(
        self,
        election: Election,
        probe: Callable[[str], Awaitable[bool]] = refuses,
        gap: float = PROBE_GAP,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.election = election
        self.probe = probe
        self.gap = gap
        self.clock = clock
        self.probes = 0
        self.evicted: list[str] = []
        self._task: asyncio.Task[None] | None = None
        # Address -> when it was last found listening (its agents are not acted on for a while).
        self.found_alive: dict[str, float] = {}

    def suspect(self, unreachable: Sequence[str]) -> None:
        """An agent could not reach these addresses: check the active one if among them. The
        active one is who the election follows (read when it began to follow), not a fresh
        read of the store, which a standby swamped by arriving agents may not get through."""
        followed = self.election.followed
        address = None if followed is None else address_of(followed)
        if address is None or address not in unreachable:
            return
        if self.election.is_leader or address == self.election.identity:
            return
        if self._task is not None and not self._task.done():
            return
        seen = self.found_alive.get(address)
        if seen is not None and self.clock() - seen < COOLDOWN:
            return
        self._task = asyncio.create_task(self._check(address), name="scheduler-takeover")

    async def _check(self, address: str) -> None:
        try:
            for attempt in range(PROBES):
                if attempt:
                    await asyncio.sleep(self.gap)
                self.probes += 1
                if not await self.probe(address):
                    self.found_alive[address] = self.clock()
                    return
            if await self.election.evict(address):
                self.evicted.append(address)
                log.warning(
                    "the active scheduler's address refuses connections: ended its term",
                    active=address,
                )
        except Exception as err:  # the store is unreachable: the lease still ends the term
            log.warning(
                "could not end a dead active scheduler's term", active=address, error=repr(err)
            )

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
