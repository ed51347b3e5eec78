"""Refusing revoked certificates in a running service (the CRL itself: `revoke.py`).

grpc-python (1.85) cannot check a CRL in its handshake: `ssl_server_credentials`,
`dynamic_ssl_server_credentials` and `ssl_server_certificate_configuration` take no CRL (the C
core's CRL provider is not exposed to Python). So a revoked peer completes the handshake and is
refused right after it, where the servers read the peer's identity (`identity.peer_identity`
calls `admit`): UNAUTHENTICATED "certificate revoked". Calls already running when a CRL revoking
their peer is loaded (the agent stream lives for hours) are cancelled by the watcher, so a
revoked peer is cut off within one reload interval.

The registry is per process: the peer's identity is read from a gRPC context that carries no
reference to the server, and every server of a process trusts the same CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import structlog
from cryptography import x509

from orka.errors import Invalid, Unauthenticated, trailing_metadata
from orka.security import peer_cert

log = structlog.get_logger("orka.security")

REVOKED = "certificate revoked"
# Its status details (ErrorInfo reason UNAUTHENTICATED), as every other refusal carries.
REVOKED_DETAILS = trailing_metadata(Unauthenticated(REVOKED))
# A CRL is a list of serials; 1 MiB holds ~25,000 entries and keeps a hostile file harmless.
MAX_CRL_BYTES = 1024 * 1024


def parse_crl(data: bytes, ca: x509.Certificate, source: str) -> x509.CertificateRevocationList:
    """The CRL in `data` if it parses and the cluster CA signed it; else Invalid saying why."""
    if len(data) > MAX_CRL_BYTES:
        raise Invalid(f"crl: {source} is {len(data)} bytes, over the {MAX_CRL_BYTES} limit")
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError as e:
        raise Invalid(f"crl: {source} is not a PEM certificate revocation list: {e}") from None
    if crl.issuer != ca.subject:
        raise Invalid(
            f"crl: {source} was issued by {crl.issuer.rfc4514_string()!r}, "
            f"not the cluster CA {ca.subject.rfc4514_string()!r}"
        )
    try:
        valid = crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise Invalid(f"crl: {source} is not signed by the cluster CA")
    return crl


def crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def serials_of(crl: x509.CertificateRevocationList) -> frozenset[int]:
    return frozenset(entry.serial_number for entry in crl)


class Guard(Protocol):
    """Told of each CRL that revokes something new (a server watching its own certificate)."""

    def revoked(self, serials: frozenset[int]) -> None: ...


@dataclass
class _Call:
    task: asyncio.Task[object]
    context: grpc.aio.ServicerContext


@dataclass
class Revocations:
    """The serials this process refuses (one set per CRL file watched) and its live calls."""

    by_file: dict[Path, frozenset[int]] = field(default_factory=dict)
    # Live calls by peer serial. Weak keys: a finished call's task is freed and drops out by
    # itself, with no per-call callback (this runs on every RPC).
    calls: dict[int, weakref.WeakKeyDictionary[asyncio.Task[object], grpc.aio.ServicerContext]] = (
        field(default_factory=dict)
    )
    revoked: frozenset[int] = frozenset()
    # Servers checking their own certificate against each new CRL; weak, so a server that is
    # gone drops out without unregistering.
    guards: weakref.WeakSet[Guard] = field(default_factory=weakref.WeakSet)
    _cutting: set[asyncio.Future[None]] = field(default_factory=set)

    def is_revoked(self, serial: int) -> bool:
        return serial in self.revoked

    def admit(self, pem: bytes, context: grpc.aio.ServicerContext) -> None:
        """Refuse a revoked peer; remember an admitted call so a later revocation can cut it."""
        serial = peer_cert.serial(pem)
        if serial in self.revoked:
            raise Unauthenticated(REVOKED)
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no loop: a sync caller has no call to cut later
            return
        if task is None:
            return
        calls = self.calls.get(serial)
        if calls is None:
            calls = self.calls[serial] = weakref.WeakKeyDictionary()
        calls[task] = context

    def forget(self, path: Path) -> None:
        """Drop a CRL file no server of this process watches any more."""
        self.by_file.pop(path, None)
        self.revoked = frozenset().union(*self.by_file.values())

    def update(self, path: Path, serials: frozenset[int]) -> int:
        """Install the serials of one CRL file; cancels the live calls of newly revoked peers.

        Returns how many calls were cut.
        """
        before = self.revoked
        self.by_file[path] = serials
        self.revoked = frozenset().union(*self.by_file.values())
        cut = 0
        for serial in self.revoked - before:
            for task, context in list(self.calls.pop(serial, {}).items()):
                if task.done():
                    continue
                cutting = asyncio.ensure_future(_cut(_Call(task, context)))
                self._cutting.add(cutting)  # a reference, so the task is not collected
                cutting.add_done_callback(self._cutting.discard)
                cut += 1
        if self.revoked - before:
            for guard in list(self.guards):
                guard.revoked(self.revoked)
        return cut


async def _cut(call: _Call) -> None:
    """End a running call of a peer just revoked, telling it why.

    The handler may be parked in a read or a write. abort() from here sends the status to the
    peer (grpc aio takes a CancelledError in the handler for the client's own cancel and sends
    nothing, which would leave the peer waiting); then the handler task is cancelled so it
    stops working for a peer that is gone.
    """
    with contextlib.suppress(Exception):
        await call.context.abort(
            grpc.StatusCode.UNAUTHENTICATED, REVOKED, trailing_metadata=REVOKED_DETAILS
        )
    call.task.cancel()


REVOCATIONS = Revocations()


class CrlWatcher:
    """Re-reads one service's CRL every `interval` seconds, on the event loop.

    Only a stat() per tick: the file is read and verified when its mtime, size or inode
    changes. A CRL that does not parse or is not signed by the CA is logged and ignored; the
    previous one stays in force, as it does when the file is deleted or replaced by an older
    CRL (a lower CRLNumber): none of these can un-revoke a key.
    """

    def __init__(
        self, crl: Path, ca: Path, interval: float, registry: Revocations = REVOCATIONS
    ) -> None:
        self.crl = crl
        self.ca = ca
        self.interval = interval
        self.registry = registry
        self._seen: tuple[int, int, int] | None = None
        self._number = 0  # the CRLNumber in force
        self._handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def load(self) -> None:
        """Check the file now; install it if it changed and is valid."""
        try:
            st = os.stat(self.crl)
        except FileNotFoundError:
            # No CRL (nothing revoked yet) is normal; a CRL that disappears keeps what was
            # revoked: deleting the file must not reinstate a key.
            return
        except OSError as e:
            log.error("crl unreadable; keeping the previous one", path=str(self.crl), error=str(e))
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            ca = x509.load_pem_x509_certificate(self.ca.read_bytes())
            data = self.crl.read_bytes()[: MAX_CRL_BYTES + 1]
            crl = parse_crl(data, ca, str(self.crl))
            number = crl_number(crl)
            if number < self._number:
                # `orka certs revoke` only ever adds and counts up: an older CRL, even one the
                # CA signed, would un-revoke what was revoked since.
                raise Invalid(
                    f"crl: {self.crl} is number {number}, older than the one in force "
                    f"({self._number})"
                )
        except Invalid as e:
            log.error(
                "crl rejected; keeping the previous one", path=str(self.crl), reason=e.message
            )
            return
        except (OSError, ValueError) as e:
            log.error("crl unreadable; keeping the previous one", path=str(self.crl), error=str(e))
            return
        serials = serials_of(crl)
        self._number = number
        cut = self.registry.update(self.crl, serials)
        log.info("crl loaded", path=str(self.crl), revoked=len(serials), calls_cut=cut)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.load()
        self._handle = loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        try:
            self.load()
        finally:
            assert self.loop is not None
            if not self.loop.is_closed():
                self._handle = self.loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# One watcher per CRL file and event loop: the servers of one process share their CRL.
_WATCHERS: dict[tuple[int, Path], CrlWatcher] = {}


def watch(crl: Path, ca: Path, interval: float) -> CrlWatcher:
    """Start watching `crl` on the running loop (idempotent); loads it once right away."""
    loop = asyncio.get_running_loop()
    crl = crl.resolve()
    for key in [k for k, w in _WATCHERS.items() if w.loop is not None and w.loop.is_closed()]:
        stale = _WATCHERS.pop(key)
        stale.stop()
        stale.registry.forget(stale.crl)
    key = (id(loop), crl)
    watcher = _WATCHERS.get(key)
    if watcher is None or watcher.loop is not loop:
        watcher = CrlWatcher(crl, ca, interval)
        watcher.start(loop)
        _WATCHERS[key] = watcher
    else:
        watcher.interval = min(watcher.interval, interval)
    return watcher
