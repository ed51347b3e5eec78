"""Children that die with their parent: the kernel's parent-death signal (Linux prctl).

`orka up` runs its services as child processes. Whatever ends `orka up` (Ctrl-C, a closed
terminal, SIGKILL, an OOM kill), the kernel then sends each child the signal set here, so no
cluster is left behind holding the ports. The signal is set in the child between fork and exec
and survives the exec of the Python interpreter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl  # type: ignore[no-any-return]


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive `sig` when this process dies.

    The kernel sends the signal when the *thread* that forked the child exits, so fork from
    a thread that lives as long as the process (asyncio's subprocesses fork in the loop's
    thread, the main one under `asyncio.run`). The parent may die between fork and prctl; the
    child then already has another parent, and exits before it becomes a service.
    """
    prctl = _prctl()
    parent = os.getpid()

    def preexec() -> None:
        # Only async-signal-safe work here: no locks, no allocation-heavy calls.
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
