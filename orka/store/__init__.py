"""The controller's source of truth: JSON documents with etcd-like revisions."""

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
from orka.store.etcd import EtcdStore
from orka.store.factory import open_store
from orka.store.memory import MemoryStore
from orka.store.sqlite import SqliteStore

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
