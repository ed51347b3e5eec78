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
        self._context = self._ssl_context() if tls.enabled else None
        self._current = 0

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(
            cafile=None if self.tls.ca is None else str(self.tls.ca)
        )
        if self.tls.cert is not None and self.tls.key is not None:
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return context

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
                if self.fallback is None:
                    raise Unavailable(f"etcd: {err}") from None
                log.warning(
                    "etcd's JSON gateway cannot renew leases; renewing over gRPC", reason=str(err)
                )
                self.grpc = self.fallback()
                await self.grpc.open()
        return await self.grpc.keepalive_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        """End a lease now (its keys go with it). A gone lease is not an error."""
        if self.grpc is not None:
            await self.grpc.revoke_lease(lease_id)
            return
        await asyncio.to_thread(self._revoke, lease_id)

    def _revoke(self, lease_id: int) -> None:
        errors: list[str] = []
        for address in self.endpoints:
            try:
                self._post(address, {"ID": str(lease_id)}, REVOKE_PATH)
            except _HttpError as err:
                if err.status == 404:  # gone already (expired, or revoked): the goal is met
                    return
                errors.append(f"{address}: {err}")
            except (OSError, http.client.HTTPException, ValueError) as err:
                errors.append(f"{address}: {err}")
            else:
                return
        raise Unavailable(f"etcd: no endpoint revoked lease {lease_id:x}: {'; '.join(errors)}")

    def _keepalive(self, lease_id: int) -> int:
        errors: list[str] = []
        refusals = 0
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            address = self.endpoints[index]
            try:
                answer = self._post(address, {"ID": str(lease_id)})
            except _HttpError as err:
                errors.append(f"{address}: {err}")
                refusals += 1
                continue
            except (OSError, http.client.HTTPException, ValueError) as err:
                errors.append(f"{address}: {err}")
                continue
            self._current = index
            ttl = _ttl(answer)
            if ttl <= 0:
                raise NotFound(f"lease {lease_id:x} has expired")
            return ttl
        detail = "; ".join(errors)
        if refusals == len(self.endpoints):
            raise NoGateway(f"no endpoint's gateway renewed lease {lease_id:x}: {detail}")
        raise Unavailable(f"etcd: no endpoint refreshed lease {lease_id:x}: {detail}")

    def _post(
        self, address: str, body: dict[str, str], path: str = KEEPALIVE_PATH
    ) -> dict[str, Any]:
        host, _, port = address.rpartition(":")
        connection: http.client.HTTPConnection
        if self._context is not None:
            connection = http.client.HTTPSConnection(
                host, int(port), timeout=self.timeout, context=self._context
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
                raise _HttpError(response.status, response.reason)
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

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status


def _ttl(answer: dict[str, Any]) -> int:
    """The TTL a keepalive answer grants (0: the lease is gone); ValueError if malformed."""
    result = answer.get("result")
    if not isinstance(result, dict):
        raise ValueError("the gateway's answer has no result")
    return int(result.get("TTL", 0))
