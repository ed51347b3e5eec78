"""Coalescing queued stream messages into one frame (the `batch` bodies of agent.proto).

A busy stream pays a write on one side and a read on the other per message; messages that
are already waiting when the writer comes round go out together instead. Nothing waits to
fill a frame: an idle stream still sends each message alone and at once.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

# Frames stay far below gRPC's 4 MiB message limit even with large specs in every offer.
MAX_FRAME = 64

M = TypeVar("M")


def drain(first: M, queue: asyncio.Queue[M | None], limit: int = MAX_FRAME) -> tuple[list[M], bool]:
    """`first` and what else is queued right now (up to `limit`), in order, and whether
    the queue's close marker (None) was among them."""
    items = [first]
    while len(items) < limit and not queue.empty():
        more = queue.get_nowait()
        if more is None:
            return items, True
        items.append(more)
    return items, False
