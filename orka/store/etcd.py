"""The store on etcd v3: the controller's truth for a real (multi-controller) cluster.

Layout: one key per item, `<prefix>/<kind>/<name>` (e.g. `/orka/workloads/web`,
`/orka/instances/web-abc123`), the value its JSON text. An item's revision is the key's etcd
`mod_revision`; etcd's revision is global and bumped once per transaction, which is exactly the
Store contract (every key written by one commit carries that commit's revision).

`commit()` is ONE etcd Txn: a compare per op (Create: create_revision == 0; Update/Delete:
create_revision > 0, or mod_revision == expected when given; Require: mod_revision ==
required, with no write), then the puts/deletes. Its failure
branch reads every compared key, so when a compare fails we learn which op failed from the very
snapshot the compares saw, without a second round trip that could see later writes.

We talk to etcd's gRPC API with the protobuf stubs that `aetcd` ships (they import fine with
protobuf 7), but over our own grpc.aio channels: aetcd's Client dials one host, insecure only,
and we need TLS to etcd and fail-over across the endpoint list.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from aetcd import rpc

from orka import metrics
from orka.errors import Conflict, Invalid, NotFound, OrkaError, Unavailable
from orka.store.base import (
    Create,
    Delete,
    Item,
    Op,
    PreparedOp,
    Put,
    Require,
    Store,
    Update,
    WatchEvent,
    check_precondition,
    decode_value,
    prepare_batch,
    requirements_first,
    validate_key,
    validate_kind,
)
from orka.store.etcd_lease import GatewayLeases

log = structlog.get_logger("orka.store.etcd")

DEFAULT_PREFIX = "/orka"

# A list() reads in pages so a large cluster never needs one giant response (etcd and gRPC both
# cap message sizes); every page is read at the first page's revision, so a list is a snapshot.
_PAGE = 500

# Codes on which another endpoint may do better. DEADLINE_EXCEEDED only for calls that are safe
# to repeat, or (commit) whose repetition is checked: a timed-out write may have landed.
_FAILOVER = frozenset({grpc.StatusCode.UNAVAILABLE})
_FAILOVER_IDEMPOTENT = _FAILOVER | {grpc.StatusCode.DEADLINE_EXCEEDED}

_CHANNEL_OPTIONS = (
    # A member that comes back is dialled again within about a second, not after grpc's default
    # exponential backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


def prefix_range_end(key: bytes) -> bytes:
    """etcd's range end for "every key starting with `key`": the key with its last byte that is
    not 0xff incremented and the rest dropped; b"\\0" (to the end of the keyspace) if none.

    etcd orders keys bytewise, and UTF-8 bytewise order is code point order, so the range holds
    exactly the names the other backends return for the same prefix.
    """
    trimmed = key.rstrip(b"\xff")
    if not trimmed:
        return b"\0"
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """Client TLS to etcd: `ca` verifies the servers; `cert` + `key` (both or neither) are our
    client certificate when etcd runs with --client-cert-auth."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise Invalid("etcd TLS: client cert and key must be given together")

    @property
    def enabled(self) -> bool:
        return any(p is not None for p in (self.ca, self.cert, self.key))

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


class _Endpoint:
    """One etcd member: its channel and the stubs on it."""

    def __init__(self, address: str, tls: EtcdTls) -> None:
        self.address = address
        if tls.enabled:
            self.channel = grpc.aio.secure_channel(
                address, tls.credentials(), options=_CHANNEL_OPTIONS
            )
        else:
            self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)


class EtcdStore(Store):
    supports_watch = True
    supports_leases = True

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str = DEFAULT_PREFIX,
        *,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise Invalid("etcd store: at least one HOST:PORT endpoint is required")
        self.endpoints = list(endpoints)
        # Keys are `<root><kind>/<name>`; the root always ends with exactly one slash so the
        # prefix "/orka" and "/orka/" mean the same place.
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        self._root = (self.prefix + "/").encode()
        self.tls = EtcdTls(ca, cert, key)
        self.timeout = timeout
        self._conns: list[_Endpoint] = []
        self._current = 0
        # Counters for benchmarks and tests: Txn RPCs sent by commit(), and how many failed
        # their compares (CAS conflicts, AlreadyExists, NotFound).
        self.txn_count = 0
        self.txn_failed = 0
        self.keys_written = 0  # puts + deletes applied by successful commits

    # --- connection ----------------------------------------------------------------------------

    async def open(self) -> None:
        if self._conns:
            return
        # Channels connect lazily, so opening never blocks on an unreachable member; the first
        # call reports UNAVAILABLE if none answers.
        self._conns = [_Endpoint(address, self.tls) for address in self.endpoints]
        self._current = 0
        log.info("etcd store opened", endpoints=self.endpoints, prefix=self.prefix or "/")

    async def close(self) -> None:
        conns, self._conns = self._conns, []
        for conn in conns:
            await conn.channel.close()

    def _check_open(self) -> list[_Endpoint]:
        if not self._conns:
            raise RuntimeError(f"etcd store {','.join(self.endpoints)} is not open")
        return self._conns

    async def _call(
        self, method: str, request: Any, *, idempotent: bool, failed: list[str] | None = None
    ) -> Any:
        """A unary call on the current member, failing over to the next ones in turn.

        `method` is "kv.Range", "lease.LeaseGrant", ...; the member that answers becomes the
        current one, so after a fail-over we stay on the healthy member. Each failed attempt is
        appended to `failed`, so a caller retrying a write knows an earlier try may have landed.
        """
        conns = self._check_open()
        stub_name, rpc_name = method.split(".")
        retry_on = _FAILOVER_IDEMPOTENT if idempotent else _FAILOVER
        last: grpc.aio.AioRpcError | None = None
        start = self._current
        for attempt in range(len(conns)):
            index = (start + attempt) % len(conns)
            conn = conns[index]
            try:
                response = await getattr(getattr(conn, stub_name), rpc_name)(
                    request, timeout=self.timeout
                )
            except grpc.aio.AioRpcError as err:
                if err.code() not in retry_on:
                    raise _translate(err, conn.address) from err
                last = err
                if failed is not None:
                    failed.append(f"{conn.address}: {err.code().name}")
                log.warning(
                    "etcd endpoint failed; trying the next",
                    endpoint=conn.address,
                    code=err.code().name,
                    details=err.details(),
                )
                continue
            if index != self._current:
                log.info("etcd endpoint switched", endpoint=conn.address)
                self._current = index
            return response
        assert last is not None
        raise Unavailable(
            f"etcd: no endpoint answered ({', '.join(self.endpoints)}): {last.details()}"
        ) from last

    # --- keys ----------------------------------------------------------------------------------

    def _key(self, kind: str, name: str) -> bytes:
        return self._root + kind.encode() + b"/" + name.encode("utf-8")

    def _split(self, key: bytes) -> tuple[str, str]:
        kind, _, name = key[len(self._root) :].partition(b"/")
        return kind.decode(), name.decode("utf-8")

    def _item(self, kv: Any) -> Item:
        kind, name = self._split(kv.key)
        return Item(kind, name, kv.mod_revision, decode_value(kv.value.decode("utf-8")))

    # --- reads ---------------------------------------------------------------------------------

    async def get(self, kind: str, name: str) -> Item | None:
        validate_key(kind, name)
        response = await self._call(
            "kv.Range", rpc.RangeRequest(key=self._key(kind, name)), idempotent=True
        )
        return self._item(response.kvs[0]) if response.kvs else None

    async def list(self, kind: str, prefix: str = "") -> list[Item]:
        validate_kind(kind)
        start = self._key(kind, prefix)
        end = prefix_range_end(start)
        items: list[Item] = []
        revision = 0  # 0: latest, for the first page; then pinned to what the first page saw
        while True:
            response = await self._call(
                "kv.Range",
                rpc.RangeRequest(key=start, range_end=end, limit=_PAGE, revision=revision),
                idempotent=True,
            )
            # etcd returns ranges sorted by key (ascending) unless told otherwise.
            items.extend(self._item(kv) for kv in response.kvs)
            if not response.more or not response.kvs:
                return items
            revision = response.header.revision
            start = response.kvs[-1].key + b"\0"

    async def revision(self) -> int:
        # Any linearizable read carries the cluster's current revision in its header.
        response = await self._call(
            "kv.Range", rpc.RangeRequest(key=self._root, count_only=True), idempotent=True
        )
        return int(response.header.revision)

    # --- commit --------------------------------------------------------------------------------

    async def commit(self, ops: Sequence[Op]) -> list[int]:
        self._check_open()
        prepared = prepare_batch(ops, leases=True)
        if not prepared:
            return []
        compares: list[Any] = []
        success: list[Any] = []
        checked: list[tuple[Op, bytes]] = []  # ops with a precondition, to diagnose a failure
        for p in prepared:
            op = p.op
            key = self._key(op.kind, op.name)
            compare = _compare_for(op, key)
            if compare is not None:
                compares.append(compare)
                checked.append((op, key))
            if isinstance(op, Require):
                continue  # a compare only: fencing costs no extra round trip
            if isinstance(op, Delete):
                success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)))
            else:
                assert p.encoded is not None and isinstance(op, Create | Update | Put)
                lease = op.lease if isinstance(op, Create | Put) else 0
                put = rpc.PutRequest(key=key, value=p.encoded.encode("utf-8"), lease=lease)
                success.append(rpc.RequestOp(request_put=put))
        failure = [
            rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=True))
            for _, key in checked
        ]
        request = rpc.TxnRequest(compare=compares, success=success, failure=failure)
        self.txn_count += 1
        # A write may time out, or lose its connection, after etcd applied it (typically while
        # etcd elects a new raft leader), so it is retried on the next member like a read. If
        # a retry then fails its compares, the earlier try may have been ours: _landed() tells.
        failed: list[str] = []
        with metrics.store_commit("etcd"):
            response = await self._call("kv.Txn", request, idempotent=True, failed=failed)
        writes = sum(not isinstance(p.op, Require) for p in prepared)
        if response.succeeded:
            self.keys_written += writes
            revision = int(response.header.revision)
            return [0 if isinstance(p.op, Delete | Require) else revision for p in prepared]
        if failed and writes:
            landed = await self._landed(prepared)
            if landed is not None:
                log.info("etcd commit landed before a fail-over", attempts=failed)
                self.keys_written += writes
                return [0 if isinstance(p.op, Delete | Require) else landed for p in prepared]
        self.txn_failed += 1
        # Replay the preconditions (requirements first, then in op order) against the state
        # the compares saw, so the error is the one the other backends report.
        seen = {
            id(op): result.response_range.kvs
            for (op, _), result in zip(checked, response.responses, strict=True)
        }
        for op in requirements_first([op for op, _ in checked]):
            kvs = seen[id(op)]
            check_precondition(op, kvs[0].mod_revision if kvs else None)
        # Unreachable unless etcd and we disagree on a compare; never pretend it succeeded.
        raise Conflict(f"etcd transaction of {len(prepared)} ops was rejected")

    async def _landed(self, prepared: Sequence[PreparedOp]) -> int | None:
        """The revision at which this exact batch was applied, if the store shows it: every
        written key holds our value at one common revision and every deleted key is gone.
        None if not (or if it cannot be told: a delete-only batch has no revision to show)."""
        # Requirements are left out: they held when the batch landed, whatever they are now.
        prepared = [p for p in prepared if not isinstance(p.op, Require)]
        reads = [
            rpc.RequestOp(request_range=rpc.RangeRequest(key=self._key(p.op.kind, p.op.name)))
            for p in prepared
        ]
        response = await self._call("kv.Txn", rpc.TxnRequest(success=reads), idempotent=True)
        revisions: set[int] = set()
        for p, result in zip(prepared, response.responses, strict=True):
            kvs = result.response_range.kvs
            if p.encoded is None:
                if kvs:
                    return None
                continue
            if not kvs or kvs[0].value != p.encoded.encode("utf-8"):
                return None
            revisions.add(int(kvs[0].mod_revision))
        return revisions.pop() if len(revisions) == 1 else None

    # --- watch ---------------------------------------------------------------------------------

    async def watch(
        self, kind: str, prefix: str = "", start_revision: int = 0
    ) -> AsyncIterator[WatchEvent]:
        validate_kind(kind)
        if isinstance(start_revision, bool) or start_revision < 0:
            raise Invalid("watch: start_revision must be a non-negative integer")
        key = self._key(kind, prefix)
        end = prefix_range_end(key)
        next_revision = start_revision
        failures = 0
        while True:
            conns = self._check_open()
            conn = conns[self._current % len(conns)]
            call = conn.watch.Watch()
            try:
                create = rpc.WatchCreateRequest(
                    key=key, range_end=end, start_revision=next_revision
                )
                await call.write(rpc.WatchRequest(create_request=create))
                async for response in call:
                    failures = 0
                    if response.compact_revision:
                        raise Conflict(
                            f"watch {kind} {prefix!r}: revision {next_revision} was compacted; "
                            f"the oldest kept is {response.compact_revision}"
                        )
                    if response.canceled:
                        raise Unavailable(f"etcd cancelled the watch: {response.cancel_reason}")
                    if response.created and next_revision == 0:
                        # "From now" is pinned at creation so a reconnect resumes, not skips.
                        next_revision = response.header.revision + 1
                    for event in response.events:
                        ev_kind, name = self._split(event.kv.key)
                        deleted = event.type == rpc.Event.DELETE
                        value = None if deleted else decode_value(event.kv.value.decode("utf-8"))
                        next_revision = event.kv.mod_revision + 1
                        yield WatchEvent(ev_kind, name, event.kv.mod_revision, value)
            except grpc.aio.AioRpcError as err:
                if err.code() not in _FAILOVER_IDEMPOTENT:
                    raise _translate(err, conn.address) from err
                failures += 1
                log.warning(
                    "etcd watch broke; resuming on the next endpoint",
                    endpoint=conn.address,
                    code=err.code().name,
                    resume_at=next_revision,
                )
                self._current = (self._current + 1) % len(conns)
                # After a full round of failures, wait a little instead of spinning.
                if failures >= len(conns):
                    await asyncio.sleep(min(0.1 * failures, 1.0))
            finally:
                call.cancel()

    # --- leases --------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0:
            raise Invalid("lease ttl must be a positive number of seconds")
        # Not idempotent: a repeated grant would leave an orphan lease (harmless, it expires),
        # but there is no need to risk it.
        response = await self._call(
            "lease.LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl), idempotent=False
        )
        if response.error:
            raise Unavailable(f"etcd lease grant failed: {response.error}")
        return int(response.ID)

    def lease_keeper(self) -> GatewayLeases:
        # Not this store's gRPC channels: see orka/store/etcd_lease.py.
        tls = self.tls

        def grpc_store() -> EtcdStore:
            return EtcdStore(
                self.endpoints,
                self.prefix,
                ca=tls.ca,
                cert=tls.cert,
                key=tls.key,
                timeout=self.timeout,
            )

        return GatewayLeases(self.endpoints, tls, self.timeout, fallback=grpc_store)

    async def keepalive_lease(self, lease_id: int) -> int:
        conns = self._check_open()
        last: grpc.aio.AioRpcError | None = None
        # The keep-alive RPC is a stream; one request and one answer per refresh keeps the
        # caller in charge of the cadence (and of noticing a refresh that did not happen).
        for attempt in range(len(conns)):
            index = (self._current + attempt) % len(conns)
            call = conns[index].lease.LeaseKeepAlive(timeout=self.timeout)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                response = await call.read()
            except grpc.aio.AioRpcError as err:
                if err.code() not in _FAILOVER_IDEMPOTENT:
                    raise _translate(err, conns[index].address) from err
                last = err
                continue
            finally:
                call.cancel()
            if response is grpc.aio.EOF:
                continue
            self._current = index
            if response.TTL <= 0:
                raise NotFound(f"lease {lease_id:x} has expired")
            return int(response.TTL)
        detail = last.details() if last is not None else "stream closed"
        raise Unavailable(f"etcd: no endpoint refreshed lease {lease_id:x}: {detail}")

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(
                "lease.LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease_id), idempotent=True
            )
        except NotFound:
            pass  # already expired or revoked: the goal is met


def _compare_for(op: Op, key: bytes) -> Any:
    """The etcd compare that holds exactly when `op`'s precondition does (None: no check)."""
    if isinstance(op, Put):
        return None
    if isinstance(op, Require):
        # A missing key has mod_revision 0, and a required revision is positive.
        return rpc.Compare(
            key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=op.revision
        )
    if isinstance(op, Create):
        return rpc.Compare(
            key=key,
            target=rpc.Compare.CREATE,
            result=rpc.Compare.EQUAL,
            create_revision=0,
        )
    expected = op.expected_revision
    if expected is None:
        # A missing key has create_revision 0.
        return rpc.Compare(
            key=key, target=rpc.Compare.CREATE, result=rpc.Compare.GREATER, create_revision=0
        )
    if expected == 0:
        # No existing key has mod_revision 0, but a missing one does: make the compare fail
        # always and let the diagnosis say NotFound or Conflict.
        return rpc.Compare(
            key=key, target=rpc.Compare.CREATE, result=rpc.Compare.LESS, create_revision=0
        )
    # mod_revision == expected > 0 also implies that the key exists.
    return rpc.Compare(
        key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=expected
    )


def _translate(err: grpc.aio.AioRpcError, endpoint: str) -> OrkaError:
    """etcd's gRPC errors as Orka errors, each naming the endpoint."""
    details = err.details() or err.code().name
    code = err.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if "too many operations" in details:
            details += " (raise etcd's --max-txn-ops, or commit smaller batches)"
        return Invalid(f"etcd {endpoint}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"etcd {endpoint}: {details}")
    return Unavailable(f"etcd {endpoint}: {code.name}: {details}")
