"""Entity tags for optimistic concurrency (AIP-154): what `orka apply` sends back so that it
changes a workload or node only as it read it.

An etag changes exactly when something a user wrote changes, never for what the system keeps
updating (status, heartbeats, usage): otherwise every `orka apply` racing the reconciler would
fail for nothing.

- A workload's etag is a random token stored with it, drawn anew by every user write that
  changes it (Create, an Update that changes the spec, Delete). A token, not a hash of the spec:
  the spec holds secret values, and a hash of them would let readers test guesses.
- A node's etag is a digest of the fields users write (schedulable, draining): cordon, uncordon
  and drain change it, heartbeats and state changes do not.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Protocol

from orka.errors import Aborted


class _NodeFields(Protocol):
    """What users write of a node (a `Node` model, or the scheduler's record of one)."""

    schedulable: bool
    draining: bool


# 16 random bytes as hex: no two writes of a workload's life draw the same token.
_TOKEN_BYTES = 16


def new_workload_etag() -> str:
    return secrets.token_hex(_TOKEN_BYTES)


def _digest(schedulable: bool, draining: bool) -> str:
    text = f"schedulable={schedulable};draining={draining}"
    return hashlib.blake2b(text.encode(), digest_size=_TOKEN_BYTES).hexdigest()


# Four possible values, computed once: node messages are built for every heartbeat.
_NODE_ETAGS = {(s, d): _digest(s, d) for s in (False, True) for d in (False, True)}


def node_etag(node: _NodeFields) -> str:
    return _NODE_ETAGS[(node.schedulable, node.draining)]


def check_etag(sent: str, current: str, what: str) -> None:
    """An empty `sent` asks for no check; any other value must match the current etag."""
    if sent and sent != current:
        raise Aborted(
            f"{what} was changed since it was read (etag {sent!r} is stale, now {current!r});"
            " re-read it and apply your change again"
        )
