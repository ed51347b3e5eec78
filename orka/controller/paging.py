"""List paging (AIP-158): page sizes, opaque page tokens, and walking an ordered index.

A token is urlsafe base64 of a small JSON object: the sort key of the last object returned
and a fingerprint of the request's filters. Resuming strictly after that key (not at an
offset) is what keeps a listing exact while objects are created and deleted: a key that
existed for the whole listing is neither skipped nor returned twice. The fingerprint makes a
token from another filter an error rather than a silently wrong page.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sortedcontainers import SortedList

from orka.errors import Invalid

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 500
MAX_PAGE_SIZE = 1000
# A page also stops once it holds this many bytes (at least one object goes): workloads carry
# specs of up to 1 MiB, so 1,000 of them would not fit one message, while instances and nodes
# (a few hundred bytes each) never reach it. Below gRPC's default 4 MiB receive limit.
MAX_PAGE_BYTES = 2 << 20
# Tokens are a key of a few names and a number; anything much longer is no token of ours.
MAX_TOKEN_CHARS = 4096

Key = tuple[Any, ...]


def page_size(requested: int) -> int:
    if requested < 0:
        raise Invalid(f"page_size: must be >= 0, got {requested}", field="page_size")
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def fingerprint(*filters: object) -> str:
    """Short digest of what a request filters on; a token only resumes the same listing."""
    text = json.dumps([str(f) for f in filters], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode_token(last: Key, filters: str) -> str:
    body = json.dumps({"k": list(last), "f": filters}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def decode_token(token: str, filters: str, shape: tuple[type, ...]) -> Key | None:
    """The key to resume after; None for the first page. Invalid naming page_token when the
    token is not one of ours or was made for other filters."""
    if not token:
        return None
    if len(token) > MAX_TOKEN_CHARS:
        raise Invalid(
            f"page_token: longer than {MAX_TOKEN_CHARS} characters; not a page token",
            field="page_token",
        )
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        body = json.loads(raw)
        key, made_for = body["k"], body["f"]
    except (binascii.Error, ValueError, TypeError, KeyError):
        raise Invalid(
            "page_token: not a page token this server issued", field="page_token"
        ) from None
    if not isinstance(made_for, str) or not _fits(key, shape):
        raise Invalid("page_token: not a page token this server issued", field="page_token")
    if made_for != filters:
        raise Invalid(
            "page_token: was issued for a listing with other filters; send the same filters"
            " as the first page, or no token to start over",
            field="page_token",
        )
    return tuple(float(k) if t is float else k for k, t in zip(key, shape, strict=True))


def _fits(key: object, shape: tuple[type, ...]) -> bool:
    """Whether a decoded key has the types of the index's keys (a forged token's would make
    the comparison in the index fail)."""
    if not isinstance(key, list) or len(key) != len(shape):
        return False
    for k, t in zip(key, shape, strict=True):
        if isinstance(k, bool):
            return False
        if t is float and not isinstance(k, int | float):
            return False
        if t is not float and not isinstance(k, t):
            return False
    return True


def after(index: SortedList, start: Key | None, lower: Key | None = None) -> Iterator[Key]:
    """Keys of `index` strictly after `start` (or from `lower`, inclusive, on the first page)."""
    if start is None:
        return iter(index.irange(minimum=lower)) if lower is not None else iter(index)
    if lower is not None and start < lower:
        return iter(index.irange(minimum=lower))
    return iter(index.irange(minimum=start, inclusive=(False, True)))


def take_page(
    keys: Iterator[Key],
    size: int,
    pick: Callable[[Key], T | None],
    weigh: Callable[[T], int],
    max_bytes: int = MAX_PAGE_BYTES,
) -> tuple[list[T], Key | None]:
    """Up to `size` objects that `pick` returns (None: filtered out) and `max_bytes` in all,
    and the key to resume after (None: the index is exhausted, no more pages)."""
    out: list[T] = []
    total = 0
    last: Key | None = None
    for key in keys:
        if len(out) >= size:
            return out, last
        item = pick(key)
        if item is None:
            continue
        weight = weigh(item)
        if out and total + weight > max_bytes:
            return out, last
        out.append(item)
        total += weight
        last = key
    return out, None
