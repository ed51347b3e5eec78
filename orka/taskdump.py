"""Every asyncio task's stack, printed on demand: what a service that seems stuck waits on.

The controller and the scheduler print it on SIGUSR1 (Go prints its goroutines on SIGQUIT);
the test suite does the same for a hung test.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO


def dump_tasks(out: TextIO | None = None) -> None:
    """Print each task of the running loop with its stack (nothing outside a loop)."""
    out = out or sys.stderr
    loop = asyncio._get_running_loop()
    if loop is None:
        return
    for task in asyncio.all_tasks(loop):
        try:
            print(f"--- task {task.get_name()}", file=out)
            task.print_stack(file=out)
        except Exception as err:  # frames of compiled code have no line numbers
            print(f"{task!r}: {err!r}", file=out)
    out.flush()
