"""Which controller may give orders: the one with the newest leadership term.

A controller's term is the revision of its election key (orka/store/election.py), so a later
leader always has a higher one. Its store writes are fenced by that key; its orders to nodes go
through the scheduler, which fences them here: a Place, Command, SetNode or Watch carrying a
term below the highest this scheduler has seen comes from a controller that was paused or cut
off past its lease while a successor took over, and is refused before any node hears of it.
Soft state like the rest of the scheduler: after a restart the first controller to call sets
it, which a stale one can only be if its successor has not reached this scheduler yet.
"""

from __future__ import annotations

import structlog

from orka.errors import Conflict

log = structlog.get_logger("orka.scheduler.terms")


class StaleTerm(Conflict):
    """FAILED_PRECONDITION: the calling controller no longer leads; retrying cannot help."""


class LeaderTerms:
    def __init__(self) -> None:
        self.highest = 0

    def admit(self, term: int) -> None:
        """Accept a call of controller term `term`, or raise StaleTerm."""
        if term < self.highest:
            raise StaleTerm(
                f"controller term {term} is stale: a controller of term {self.highest} leads; "
                "this one must not give orders any more"
            )
        if term > self.highest:
            if self.highest:
                log.info("a new controller term", term=term, was=self.highest)
            self.highest = term
