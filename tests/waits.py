"""Waiting on a condition in an async test, not on a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait for `check()` to be truthy, letting the event loop run in between."""
    deadline = time.monotonic() + timeout
    # Polled: the conditions tests wait on are plain attributes, which signal nothing.
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)
