"""Which of its configured servers a client dials next, following NOT_LEADER answers.

Agents and the controller's scheduler link hold a list of scheduler addresses. Only one of them
(the active scheduler) serves; the others answer every call with NotLeader (orka.errors), naming
the active one in the ErrorInfo metadata `leader` when they know it. The rule, the same for
every client:

* a NOT_LEADER naming an address IN THE CLIENT'S OWN LIST (other than the one just asked): go
  there next, at once. Once only: what that one answers is handled by the rules below, never
  by another jump at once, so two servers that each name the other (a moment of disagreement)
  cannot make a client spin;
* a NOT_LEADER naming the address just asked: that server has just become the leader (a
  standby holds a client whose leader could not be reached until it takes over, then says
  so): ask it again at once, once;
* a NOT_LEADER naming an address outside the list is treated as naming none: a standby, or
  anyone holding a scheduler certificate, must not be able to send a node elsewhere;
* a NOT_LEADER without a usable address: the next address of the list after a short pause (the
  server is alive and answered; only nobody leads yet, or it does not know who);
* moving down the list skips an address that could not be reached within the last DOWN_FOR
  seconds while another may still answer: during a failover the standby is asked again and
  again (it is about to be elected), not the dead server, whose refusal would cost a backoff;
* any other failure (refused, reset, timed out): the next address after the caller's backoff,
  but at most FAILOVER_PAUSE when that address was the leader a NOT_LEADER just named: the
  active server is then likely dead and a standby about to take over (its lease expires within
  the election TTL), so the client asks again soon instead of waiting out a growing backoff.

The backoff itself stays the caller's (it differs per client); this only chooses the address
and whether the backoff applies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from orka.errors import NotLeader, OrkaError, from_rpc_error

# The pause before asking the next server after a NOT_LEADER that names no usable leader.
NOT_LEADER_PAUSE = 0.25
# The longest wait after the leader a NOT_LEADER named could not be reached. Longer than
# NOT_LEADER_PAUSE: every client of a dead server does this until the standby takes over.
FAILOVER_PAUSE = 1.0
# How long an address that could not be reached is passed over when moving down the list.
DOWN_FOR = 5.0


@dataclass(frozen=True)
class Hint:
    """What one failure said about where to go: `leader` when it was a NOT_LEADER naming an
    address (whether or not it is in the list), `not_leader` for any NOT_LEADER."""

    not_leader: bool = False
    leader: str | None = None


def hint_of(error: BaseException | None) -> Hint:
    """The redirect a failed call carries, read from its structured details, never its prose."""
    err: OrkaError | None = None
    if isinstance(error, OrkaError):
        err = error
    elif isinstance(error, grpc.aio.AioRpcError):
        err = from_rpc_error(error)
    if not isinstance(err, NotLeader):
        return Hint()
    return Hint(not_leader=True, leader=err.leader)


class Targets:
    """The client's configured addresses and which one is `current`.

    `failed(error, backoff)` moves on after a failure of `current` and returns how long to wait
    before dialing the new `current`; `connected()` after a success."""

    def __init__(
        self,
        addresses: Sequence[str],
        pause: float = NOT_LEADER_PAUSE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses:
            raise ValueError("at least one address is required")
        self.addresses = list(addresses)
        self.pause = pause
        self.clock = clock
        self._index = 0
        # True while `current` was chosen by following a leader hint at once.
        self._followed = False
        # Address -> when it last could not be reached (no answer, or not the server's own).
        self._down: dict[str, float] = {}

    @property
    def current(self) -> str:
        return self.addresses[self._index]

    def connected(self) -> None:
        self._followed = False
        self._down.pop(self.current, None)

    def failed(self, error: BaseException | None, backoff: float) -> float:
        """After `current` failed with `error`: choose the next address, return the delay."""
        hint = hint_of(error)
        followed, self._followed = self._followed, False
        now = self.clock()
        if not hint.not_leader:
            self._down[self.current] = now
        if hint.leader is not None and hint.leader == self.current and not followed:
            # It names itself: a standby that held this client until it took over.
            self._followed = True
            return 0.0
        if (
            hint.leader is not None
            and hint.leader != self.current
            and hint.leader in self.addresses
            and not followed
        ):
            # Fresh word from a live server (read from the election): followed even to an
            # address that was down a moment ago (it may have restarted and been elected).
            self._index = self.addresses.index(hint.leader)
            self._followed = True
            return 0.0
        self._index = self._next(now)
        if hint.not_leader:
            return self.pause
        return min(backoff, FAILOVER_PAUSE) if followed else backoff

    def failed_at(self, address: str) -> float | None:
        """When `address` last could not be reached (this object's clock), None if it has been
        reached since, or never failed."""
        return self._down.get(address)

    def unreachable(self) -> list[str]:
        """The addresses that could not be reached within the last DOWN_FOR seconds (told to
        a standby, which then holds the client rather than send it back to them)."""
        now = self.clock()
        return [a for a, at in self._down.items() if now - at < DOWN_FOR]

    def _next(self, now: float) -> int:
        """The next address down the list (wrapping) not down lately; the current one if it
        is the only such; simply the next when all are down."""
        count = len(self.addresses)
        for step in range(1, count + 1):
            i = (self._index + step) % count
            at = self._down.get(self.addresses[i])
            if at is None or now - at >= DOWN_FOR:
                return i
        return (self._index + 1) % count
