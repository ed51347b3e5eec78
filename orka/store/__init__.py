"""The controller's source of truth: JSON documents with etcd-like revisions."""

from orka.store.base import Create, Delete, Item, Op, Put, Store, Update
from orka.store.factory import open_store
from orka.store.memory import MemoryStore
from orka.store.sqlite import SqliteStore

__all__ = [
    "Create",
    "Delete",
    "Item",
    "MemoryStore",
    "Op",
    "Put",
    "SqliteStore",
    "Store",
    "Update",
    "open_store",
]
