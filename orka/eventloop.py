"""The event loop the controller and the scheduler run on."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop (libuv). Both services are bound by per-message overhead on
    thousands of streams, and gRPC's asyncio stack hands every completion to the loop; the
    cheaper loop is a measured gain there (bench/RESULTS.md).

    Not for a process that starts children (the agent, `orka up`): libuv starts them with a
    plain fork(), which runs gRPC's fork handlers in the child, and those now and then abort
    it before it execs (seen here: an instance exiting with SIGABRT and gRPC's
    "ev_epoll1_linux.cc Check failed: next_worker->state == KICKED"). asyncio's own
    subprocess support does not run them.
    """
    return uvloop.run(main)
