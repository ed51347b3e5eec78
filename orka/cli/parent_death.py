"""Children that die with their parent: the kernel's parent-death signal, set by `setpriv`.

`orka up` runs its services as child processes. Whatever ends `orka up` (Ctrl-C, a closed
terminal, SIGKILL, an OOM kill), the kernel then sends each child the signal set here, so no
cluster is left behind holding the ports.

util-linux's `setpriv --pdeathsig` sets the signal and execs the command, so no Python runs in
the child between fork and exec. A `preexec_fn` would: CPython then runs the at-fork handlers
of the parent's libraries, and gRPC's start its poller again in the child, where it meets the
descriptors closed before exec and now and then kills the child before it becomes a service.
"""

from __future__ import annotations

import functools
import shutil
import signal
import sys


def die_with_parent(sig: signal.Signals) -> list[str]:
    """The argv prefix that makes a command receive `sig` when its parent dies.

    The kernel sends the signal when the *thread* that forked the child exits, so fork from a
    thread that lives as long as the process (asyncio's subprocesses fork in the loop's thread,
    the main one under `asyncio.run`). A parent that dies before `setpriv` has set the signal,
    microseconds after the fork, leaves the command running. Empty where there is no
    `setpriv` (not Linux, or no util-linux): the command then outlives its parent, and the
    caller says so.
    """
    setpriv = _setpriv()
    if setpriv is None:
        return []
    return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--"]


@functools.cache
def _setpriv() -> str | None:
    # Looked up once: `orka up` asks for every child it starts, on its event loop.
    return shutil.which("setpriv") if sys.platform.startswith("linux") else None
