"""Python's cyclic garbage collector, set for a long-running service.

With the default thresholds (a young collection every 700 net allocations) the collector ran
about 1,400 times in the controller during the placement benchmark, 3.3 s of CPU in all, and
every full collection walked each long-lived object (tens of thousands of models, messages
and records) to free nothing: it stalls the event loop while it does. Orka's objects are
freed by reference counting; cycles are rare. Collections 70 times less often cut the
collector's CPU to 0.3 s in the controller and 0.08 s in the scheduler over the same run
(bench/RESULTS.md), and what cyclic garbage there is waits a little longer to be freed:
at most tens of thousands of objects, a few MiB.
"""

from __future__ import annotations

import gc

# A young collection after this many net allocations (Python's default: 700) ...
YOUNG = 50_000
# ... a middle one every this many young ones (default 10), and a full one every this many
# middle ones, when the objects new since the last full one are a quarter of the old ones
# (Python's rule; default 10).
MIDDLE = 20
FULL = 10


def tune() -> None:
    """For the services (controller, scheduler, agent); not for the short-lived CLI."""
    gc.set_threshold(YOUNG, MIDDLE, FULL)
