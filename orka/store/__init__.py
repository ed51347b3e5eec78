"""The controller's source of truth: JSON documents with etcd-like revisions."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from orka.store.base import (
    Create,
    Delete,
    Fenced,
    Item,
    Op,
    Put,
    Require,
    Store,
    Unsupported,
    Update,
    WatchEvent,
)

if TYPE_CHECKING:
    from orka.store.etcd import EtcdStore
    from orka.store.factory import open_store
    from orka.store.memory import MemoryStore
    from orka.store.sqlite import SqliteStore

# Loaded on first use: a process that imports one of this package's modules (a scheduler
# running alone takes only its election's) does not load etcd's client and SQLite too.
_LAZY = {
    "EtcdStore": "orka.store.etcd",
    "MemoryStore": "orka.store.memory",
    "SqliteStore": "orka.store.sqlite",
    "open_store": "orka.store.factory",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Create",
    "Delete",
    "EtcdStore",
    "Fenced",
    "Item",
    "MemoryStore",
    "Op",
    "Put",
    "Require",
    "SqliteStore",
    "Store",
    "Unsupported",
    "Update",
    "WatchEvent",
    "open_store",
]
