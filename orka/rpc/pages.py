"""Following page tokens (AIP-158) on the client side: every page of a List, as one list."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

Req = TypeVar("Req")

# A listing that has not ended after this many pages is a server that keeps answering with
# tokens: a client bug or a hostile server, not a cluster (1,000 x 1,000 objects).
MAX_PAGES = 1000


async def list_all(
    call: Callable[[Req], Awaitable[Any]], request: Req, field: str
) -> tuple[list[Any], int]:
    """Every object of a paged List, in order, and the FIRST page's revision (the one to
    watch from, see proto/controller.proto). `call` sends one request; `request` holds the
    filters and the page size, and is not changed."""
    req = type(request)()
    req.CopyFrom(request)
    items: list[Any] = []
    revision = 0
    for n in range(MAX_PAGES):
        resp = await call(req)
        if n == 0:
            revision = getattr(resp, "revision", 0)  # ListActivities has none
        items.extend(getattr(resp, field))
        if not resp.next_page_token:
            return items, revision
        req.page_token = resp.next_page_token
    raise RuntimeError(f"{type(request).__name__}: no last page after {MAX_PAGES} pages")
