"""The store interface: JSON documents addressed by (kind, name), with global revisions.

Semantics follow etcd so that an etcd backend can pass the same conformance suite:

* one global revision counter; every successful non-empty commit bumps it exactly once and every
  key written by that commit carries the new revision (etcd's mod_revision);
* a commit is a transaction: all of its ops apply or none do;
* a key may appear at most once per commit (etcd rejects duplicate keys in one txn), so every
  op's precondition is checked against the state before the commit;
* a `Require` op writes nothing: it is a condition on another key (a leader's election key)
  checked in the same transaction, so a writer that lost its leadership lands nothing; when it
  fails, `Fenced` is raised ahead of any other op's error.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self

from orka.errors import AlreadyExists, Conflict, Invalid, NotFound, NotLeader

_KIND_RE = re.compile(r"[a-z_]+")


@dataclass(frozen=True, slots=True)
class JsonText:
    """A value already encoded as one JSON object, written as is: what pydantic's
    `model_dump_json` gives, in a quarter of the time of `model_dump` and `json.dumps` (the
    controller writes every instance three times on its way to RUNNING). Only checked to be
    an object, so the producer must write valid JSON, as pydantic does (NaN and infinity
    become null); readers get `json.loads` of the text."""

    text: str


Value = dict[str, Any] | JsonText


@dataclass(frozen=True, slots=True)
class Item:
    kind: str
    name: str
    revision: int
    value: dict[str, Any]


@dataclass(frozen=True)
class Create:
    """Write a new key; AlreadyExists if it is there.

    `lease` (0: none) ties the key to a lease from `Store.grant_lease`: the key is deleted when
    the lease expires or is revoked. Only stores with `supports_leases` accept it.
    """

    kind: str
    name: str
    value: Value
    lease: int = 0


@dataclass(frozen=True)
class Update:
    """Overwrite an existing key; NotFound if missing, Conflict if its revision is not
    `expected_revision` (no check when None)."""

    kind: str
    name: str
    value: Value
    expected_revision: int | None


@dataclass(frozen=True)
class Delete:
    """Remove an existing key; NotFound if missing, Conflict on a revision mismatch."""

    kind: str
    name: str
    expected_revision: int | None = None


@dataclass(frozen=True)
class Put:
    """Create or overwrite, unconditionally; `lease` as for Create."""

    kind: str
    name: str
    value: Value
    lease: int = 0


@dataclass(frozen=True)
class Require:
    """Write nothing; the commit applies only if the key exists at exactly `revision` (its
    last write's revision). A leader adds `Require(leader, <election>, <its key's revision>)`
    to every commit: once its lease has expired and a successor holds the key, the revision
    differs and the whole commit fails with `Fenced`, in the same round trip as the write."""

    kind: str
    name: str
    revision: int


Op = Create | Update | Delete | Put | Require
WRITE_OPS = (Create, Update, Delete, Put)


class Fenced(NotLeader):
    """A commit's `Require` failed: the writer no longer holds what it required (another
    controller leads now). Nothing was written. Unlike a Conflict, re-reading and retrying
    cannot help: the writer must stop writing and step down. On the wire it is a NotLeader."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by `Store.watch`: a write (value set) or a delete (value None).

    `revision` is the revision of the commit that made the change; events arrive in revision
    order, and the writes of one commit arrive together with the same revision.
    """

    kind: str
    name: str
    revision: int
    value: dict[str, Any] | None

    @property
    def deleted(self) -> bool:
        return self.value is None


class Unsupported(NotImplementedError):
    """An optional store capability (watch, leases) that this backend does not have.

    Not an OrkaError: asking for it is a programming error, to be avoided by checking
    `Store.supports_watch` / `Store.supports_leases` first, never a client-facing condition.
    """


def ref(kind: str, name: str) -> str:
    """How errors name a key; repr because names may hold spaces, slashes or anything else."""
    return f"{kind} {name!r}"


def validate_kind(kind: str) -> None:
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise Invalid(f"kind {kind!r}: must be a non-empty string of [a-z_]")


def validate_key(kind: str, name: str) -> None:
    validate_kind(kind)
    if not isinstance(name, str) or not name:
        raise Invalid(f"{kind} name {name!r}: must be a non-empty string")
    if "\x00" in name:
        raise Invalid(f"{kind} name {name!r}: must not contain NUL")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Lone surrogates cannot be stored by any backend (SQLite and etcd keys are UTF-8).
        raise Invalid(f"{kind} name {name!r}: not valid unicode") from exc


def encode_value(kind: str, name: str, value: Any) -> str:
    if isinstance(value, JsonText):
        if not value.text.startswith("{"):
            raise Invalid(f"{ref(kind, name)}: value must be a JSON object")
        return value.text
    if not isinstance(value, dict):
        raise Invalid(f"{ref(kind, name)}: value must be a JSON object, got {type(value).__name__}")
    try:
        # allow_nan=False: NaN/Infinity are not JSON and another backend's reader may reject them.
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise Invalid(f"{ref(kind, name)}: value is not JSON-serializable: {exc}") from exc


def decode_value(text: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(text)
    return value


@dataclass(frozen=True, slots=True)
class PreparedOp:
    """An op that passed validation, with its value already encoded (None for Delete)."""

    op: Op
    encoded: str | None


def prepare_batch(ops: Sequence[Op], *, leases: bool = False) -> list[PreparedOp]:
    """Validate a whole batch before touching any state, so a malformed batch never half-runs.

    `leases`: whether the backend can honour `lease` on Create/Put; if not, a leased op is
    refused rather than silently written as a key that never expires.
    """
    prepared: list[PreparedOp] = []
    seen: set[tuple[str, str]] = set()
    for op in ops:
        if not isinstance(op, Create | Update | Delete | Put | Require):
            raise Invalid(f"unsupported store op {op!r}")
        validate_key(op.kind, op.name)
        key = (op.kind, op.name)
        if key in seen:
            raise Invalid(f"{ref(*key)}: appears more than once in one commit")
        seen.add(key)
        expected = getattr(op, "expected_revision", None)
        if expected is not None and (
            isinstance(expected, bool) or not isinstance(expected, int) or expected < 0
        ):
            raise Invalid(f"{ref(*key)}: expected_revision must be a non-negative integer")
        lease = getattr(op, "lease", 0)
        if isinstance(lease, bool) or not isinstance(lease, int) or lease < 0:
            raise Invalid(f"{ref(*key)}: lease must be a non-negative integer")
        if lease and not leases:
            raise Unsupported(f"{ref(*key)}: this store has no leases")
        if isinstance(op, Require):
            revision = op.revision
            if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
                raise Invalid(f"{ref(*key)}: required revision must be a positive integer")
            prepared.append(PreparedOp(op, None))
            continue
        encoded = None if isinstance(op, Delete) else encode_value(op.kind, op.name, op.value)
        prepared.append(PreparedOp(op, encoded))
    return prepared


def check_precondition(op: Op, current: int | None) -> None:
    """Raise the error `op` meets against a key whose revision is `current` (None: absent)."""
    if isinstance(op, Require):
        if current != op.revision:
            now = "absent" if current is None else f"at revision {current}"
            raise Fenced(
                f"fenced: {ref(op.kind, op.name)} is {now}, not at revision {op.revision} "
                "as this writer's commit requires; nothing was written"
            )
    elif isinstance(op, Create):
        if current is not None:
            raise AlreadyExists(f"{ref(op.kind, op.name)} already exists")
    elif isinstance(op, Update | Delete):
        if current is None:
            raise NotFound(f"{ref(op.kind, op.name)} not found")
        if op.expected_revision is not None and op.expected_revision != current:
            raise Conflict(
                f"{ref(op.kind, op.name)}: expected revision {op.expected_revision}, "
                f"current is {current}"
            )


def requirements_first(ops: Sequence[Op]) -> list[Op]:
    """`ops` in the order their preconditions are checked: every `Require` first, so that a
    fenced writer learns it is fenced rather than meeting a Conflict and retrying."""
    return [op for op in ops if isinstance(op, Require)] + [
        op for op in ops if not isinstance(op, Require)
    ]


def writes_nothing(prepared: Sequence[PreparedOp]) -> bool:
    """Whether a batch is only requirements: it then leaves the revision where it is."""
    return all(isinstance(p.op, Require) for p in prepared)


class LeaseKeeper(Protocol):
    """Refreshes leases of a store from a thread of its own (`Store.lease_keeper`)."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def keepalive_lease(self, lease_id: int) -> int:
        """As Store.keepalive_lease: the TTL granted; NotFound if the lease has expired."""
        ...

    async def revoke_lease(self, lease_id: int) -> None:
        """As Store.revoke_lease."""
        ...


class Store(ABC):
    """A transactional map (kind, name) -> JSON object with etcd-like revisions.

    Backends implement open/close/get/list/commit/revision; the single-op helpers are built on
    commit() here so every backend gets identical semantics for them.

    Watch and leases are optional capabilities (etcd has them; the single-node stores do not
    need them, since there is nobody to elect or notify). A backend that has them sets
    `supports_watch` / `supports_leases` and overrides the methods below; the defaults raise
    Unsupported.
    """

    supports_watch: bool = False
    supports_leases: bool = False

    @abstractmethod
    async def open(self) -> None:
        """Connect / create storage. Idempotent."""

    @abstractmethod
    async def close(self) -> None:
        """Release resources. Idempotent; waits for an in-flight commit."""

    @abstractmethod
    async def get(self, kind: str, name: str) -> Item | None: ...

    @abstractmethod
    async def list(self, kind: str, prefix: str = "") -> list[Item]:
        """Items of `kind` whose name starts with `prefix`, sorted by name (code point order)."""

    @abstractmethod
    async def commit(self, ops: Sequence[Op]) -> list[int]:
        """Apply `ops` atomically; return the new revision per op (0 for Delete and Require).

        Raises Invalid for a malformed batch, then Fenced if a Require fails, otherwise the
        first failing op's AlreadyExists, NotFound or Conflict; on any error the store is left
        unchanged. An empty batch, or one of requirements only, does not bump the revision.
        """

    @abstractmethod
    async def revision(self) -> int:
        """The current global revision (0 for an empty, never-written store)."""

    def watch(
        self, kind: str, prefix: str = "", start_revision: int = 0
    ) -> AsyncIterator[WatchEvent]:
        """Changes to keys of `kind` whose name starts with `prefix`, in revision order.

        `start_revision` 0 means "changes after now", now being when iteration starts (the
        first `anext`); otherwise every change with a revision
        >= start_revision (Conflict if the store has compacted that history away). The iterator
        runs until the caller stops consuming it (aclose / break).
        """
        raise Unsupported(f"{type(self).__name__} has no watch")

    def lease_keeper(self) -> LeaseKeeper | None:
        """Something that refreshes this store's leases from another thread's event loop,
        independent of the store's own connections (orka/store/election.py), or None."""
        return None

    async def grant_lease(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; returns its id (non-zero)."""
        raise Unsupported(f"{type(self).__name__} has no leases")

    async def keepalive_lease(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL in seconds. NotFound if it has expired."""
        raise Unsupported(f"{type(self).__name__} has no leases")

    async def revoke_lease(self, lease_id: int) -> None:
        """End a lease now, deleting its keys. Idempotent: a gone lease is not an error."""
        raise Unsupported(f"{type(self).__name__} has no leases")

    async def create(self, kind: str, name: str, value: dict[str, Any]) -> int:
        (revision,) = await self.commit([Create(kind, name, value)])
        return revision

    async def update(
        self, kind: str, name: str, value: dict[str, Any], expected_revision: int | None
    ) -> int:
        (revision,) = await self.commit([Update(kind, name, value, expected_revision)])
        return revision

    async def put(self, kind: str, name: str, value: dict[str, Any]) -> int:
        (revision,) = await self.commit([Put(kind, name, value)])
        return revision

    async def delete(self, kind: str, name: str, expected_revision: int | None = None) -> None:
        await self.commit([Delete(kind, name, expected_revision)])

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
