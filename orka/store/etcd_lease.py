"""Refreshing an etcd lease without gRPC: etcd's JSON gateway over the standard library's HTTP.

Why not the store's own gRPC channels: every gRPC connection of a process, client or server,
shares gRPC's event-engine threads, and a scheduler taking 5,000 agents' TLS handshakes at once
keeps those threads busy for many seconds. Measured so (bench_recovery.py, 5,000 agents): the
lease refresh from its own thread and event loop still took 3.5-4.9 s per round trip, longer
than the 5 s lease allowed, and the new active scheduler lost its lease again and again while
the agents registered. A plain socket in a thread only competes for the interpreter lock.

etcd serves the gateway on its client port next to gRPC (`/v3/lease/keepalive`, on by default
since 3.4). A keepalive on an unknown or expired lease answers without a TTL. Where the gateway
cannot serve (turned off, or etcd run with --client-cert-auth and a server certificate not
allowed for client use, which its gateway dials its own gRPC with: it answers 503), the keeper
says so once and renews over a gRPC store of its own instead, as before.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from orka.errors import NotFound, Unavailable

if TYPE_CHECKING:
    from orka.store.base import Store
    from orka.store.etcd import EtcdTls

log = structlog.get_logger("orka.store.etcd")

KEEPALIVE_PATH = "/v3/lease/keepalive"
REVOKE_PATH = "/v3/lease/revoke"
GRPC_NOT_FOUND = 5
# The most of an answer read: a keepalive answer is a few hundred bytes.
MAX_ANSWER = 64 * 1024


class NoGateway(Exception):
    """Every endpoint that answered did so with an HTTP error: the gateway cannot serve."""


class GatewayLeases:
    """Lease keepalives on `endpoints` (HOST:PORT, tried in turn from the last that answered),
    each call in a worker thread so the caller's event loop stays free. `fallback` opens the
    gRPC store used instead where the gateway cannot serve."""

    def __init__(
        self,
        endpoints: Sequence[str],
        tls: EtcdTls,
        timeout: float,
        fallback: Callable[[], Store] | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.tls = tls
        self.timeout = timeout
        self.fallback = fallback
        self.grpc: Store | None = None  # the fallback, once in use
        self._context: ssl.SSLContext | None = None  # made on first use, in a worker thread
        self._current = 0

    def _ssl_context(self) -> ssl.SSLContext:
        """Reads the CA and our pair from disk: called from the worker thread, never from
        the caller's event loop."""
        if self._context is None:
            context = ssl.create_default_context(
                cafile=None if self.tls.ca is None else str(self.tls.ca)
            )
            if self.tls.cert is not None and self.tls.key is not None:
                context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
            self._context = context
        return self._context

    async def open(self) -> None:
        """Nothing to open: each keepalive makes its own connection."""

    async def close(self) -> None:
        store, self.grpc = self.grpc, None
        if store is not None:
            await store.close()

    async def keepalive_lease(self, lease_id: int) -> int:
        if self.grpc is None:
            try:
                return await asyncio.to_thread(self._keepalive, lease_id)
            except NoGateway as err:
                await self._fall_back(err)
        assert self.grpc is not None
        return await self.grpc.keepalive_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        """End a lease now (its keys go with it). A gone lease is not an error."""
        if self.grpc is None:
            try:
                await asyncio.to_thread(self._revoke, lease_id)
                return
            except NoGateway as err:
                await self._fall_back(err)
        assert self.grpc is not None
        await self.grpc.revoke_lease(lease_id)

    async def _fall_back(self, err: NoGateway) -> None:
        if self.fallback is None:
            raise Unavailable(f"etcd: {err}") from None
        log.warning("etcd's JSON gateway cannot serve leases; using gRPC", reason=str(err))
        self.grpc = self.fallback()
        await self.grpc.open()

    def _keepalive(self, lease_id: int) -> int:
        answer = self._each_endpoint(KEEPALIVE_PATH, lease_id, "refreshed")
        ttl = _ttl(answer)
        if ttl <= 0:
            raise NotFound(f"lease {lease_id:x} has expired")
        return ttl

    def _revoke(self, lease_id: int) -> None:
        try:
            self._each_endpoint(REVOKE_PATH, lease_id, "revoked")
        except _Gone:
            pass  # expired or revoked already: the goal is met

    def _each_endpoint(self, path: str, lease_id: int, done: str) -> dict[str, Any]:
        """The first answer to `path` for `lease_id`, trying each endpoint from the last that
        answered; NoGateway when every one answered with an HTTP error."""
        errors: list[str] = []
        refusals = 0
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            address = self.endpoints[index]
            try:
                answer = self._post(address, {"ID": str(lease_id)}, path)
            except _Gone:
                self._current = index
                raise
            except _HttpError as err:
                errors.append(f"{address}: {err}")
                refusals += 1
                continue
            except (OSError, http.client.HTTPException, ValueError) as err:
                errors.append(f"{address}: {err}")
                continue
            self._current = index
            return answer
        detail = "; ".join(errors)
        if refusals == len(self.endpoints):
            raise NoGateway(f"no endpoint's gateway {done} lease {lease_id:x}: {detail}")
        raise Unavailable(f"etcd: no endpoint {done} lease {lease_id:x}: {detail}")

    def _post(self, address: str, body: dict[str, str], path: str) -> dict[str, Any]:
        host, _, port = address.rpartition(":")
        connection: http.client.HTTPConnection
        if self.tls.enabled:
            connection = http.client.HTTPSConnection(
                host, int(port), timeout=self.timeout, context=self._ssl_context()
            )
        else:
            connection = http.client.HTTPConnection(host, int(port), timeout=self.timeout)
        try:
            payload = json.dumps(body).encode()
            connection.request(
                "POST",
                path,
                body=payload,
                headers={"Content-Type": "application/json", "Connection": "close"},
            )
            response = connection.getresponse()
            if response.status != 200:
                raise _refusal(response)
            # A streamed answer: one JSON object per line, the first is ours.
            line = response.readline(MAX_ANSWER)
            answer = json.loads(line)
            if not isinstance(answer, dict):
                raise ValueError("the gateway answered something other than an object")
            if "error" in answer:
                raise ValueError(f"etcd: {answer['error']}")
            return answer
        finally:
            connection.close()


class _HttpError(ValueError):
    """The endpoint answered, with an HTTP error status."""


class _Gone(_HttpError):
    """etcd said the lease does not exist (gRPC NOT_FOUND, code 5, through the gateway)."""


def _refusal(response: http.client.HTTPResponse) -> _HttpError:
    """What an HTTP error answer means: etcd's own "lease not found", or the gateway's
    failure (turned off, or unable to reach etcd's gRPC)."""
    text = response.read(MAX_ANSWER)
    try:
        code = json.loads(text).get("code")
    except (ValueError, AttributeError):
        code = None
    if response.status == 404 and code == GRPC_NOT_FOUND:
        return _Gone(f"HTTP 404: {text[:200]!r}")
    return _HttpError(f"HTTP {response.status} {response.reason}")


def _ttl(answer: dict[str, Any]) -> int:
    """The TTL a keepalive answer grants (0: the lease is gone); ValueError if malformed."""
    result = answer.get("result")
    if not isinstance(result, dict):
        raise ValueError("the gateway's answer has no result")
    return int(result.get("TTL", 0))
