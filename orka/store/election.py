"""Leader election on the store, for several controllers sharing one etcd.

Built on the Store's optional capabilities (leases, watch, a leased Create) rather than on
aetcd directly, so it has one implementation for any store that has them, and the controller
never sees etcd. The leader holds the key `leader/<name>` (etcd: `/orka/leader/<name>`),
created in a CAS transaction under a lease of `ttl` seconds that it refreshes every ttl/3:

* campaign: grant a lease, then `Create(leader/<name>, lease)`; on AlreadyExists watch the key
  until it is deleted (resign, or the holder's lease expired) and try again;
* a leader that cannot refresh its lease for a whole TTL, or finds it expired, sets `lost` and
  must stop acting as leader: by then another candidate may already hold the key;
* where the store has a lease keeper (etcd: its JSON gateway over plain HTTP, apart from the
  process's gRPC), the lease is refreshed from a thread of its own with its own event loop
  (one per process): a service whose loop is busy (a scheduler taking thousands of
  registrations at once) still keeps its lease, as long as that loop makes progress at all;
  one that has not run for LOOP_SILENCE TTLs is let go, so a wedged leader is replaced;
* `evict(address)` ends the term of the leader a candidate follows, found dead by other means
  (orka/scheduler/takeover.py), by revoking its lease: candidates need not wait it out;
* resign deletes the key (CAS on our revision, so never someone else's) and revokes the lease;
* `fence()` is the condition the leader's writes carry: `Require(leader/<name>, revision of our
  key)`. Once the key is gone or someone else's, a write with it fails as a whole (`Fenced`),
  even from a leader that has not yet noticed (paused, partitioned) that its lease ran out;
  `fenced()` then ends its leadership at once, as a lost lease does.

Stores without leases (SQLite, memory) are single-node: there is nobody to compete with, so
`election_for` gives them a LocalElection that always wins and has no fence (SQLite's writer
lock keeps a second process off the file instead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import structlog

from orka.errors import AlreadyExists, Conflict, NotFound, OrkaError
from orka.store.base import Create, Delete, LeaseKeeper, Require, Store

log = structlog.get_logger("orka.store.election")

KIND = "leader"
# The lease refresher (its own thread) stops refreshing once the service's event loop has not
# run for this many TTLs: busy is fine, wedged is not.
LOOP_SILENCE = 2


class Election(ABC):
    """One candidate for leadership of `name`; `identity` is how others see it (an address)."""

    def __init__(self, name: str, identity: str, info: dict[str, Any] | None = None) -> None:
        self.name = name
        self.identity = identity
        self.info = dict(info or {})
        self.is_leader = False
        # The record of the leader this candidate waits on while campaigning (`evict`).
        self.followed: dict[str, Any] | None = None
        # Set when leadership ends without resign(): the holder must stop acting at once.
        self.lost = asyncio.Event()
        # Called the moment leadership is known lost, before any task waiting on `lost` runs:
        # whatever must not outlive the term (a repo's writes) ends here, not a turn later.
        self.on_lost: list[Callable[[], None]] = []
        self.lease_id: int | None = None

    @abstractmethod
    async def campaign(self) -> None:
        """Return once this candidate leads (blocks while another one does)."""

    @abstractmethod
    async def leader_info(self) -> dict[str, Any] | None:
        """The current leader's record ({"id": identity, **info}), or None if nobody leads."""

    async def leader(self) -> str | None:
        record = await self.leader_info()
        return None if record is None else str(record.get("id"))

    @abstractmethod
    async def resign(self) -> None:
        """Give leadership up (or stop campaigning) cleanly. Idempotent."""

    async def abandon(self) -> None:
        """Stop refreshing without cleaning up, as a crashed process would (for tests)."""
        await self.resign()

    def record(self) -> dict[str, Any]:
        return {**self.info, "id": self.identity}

    async def evict(self, address: str) -> bool:
        """End the term of the leader at `address`, found dead by other means, so candidates
        need not wait out its lease. False if it does not lead (any more), or cannot be."""
        return False

    def fence(self) -> Require | None:
        """The condition every write of this leader's term carries (None: nothing to fence
        against). Taken once when the term starts, so it keeps naming that term's key."""
        return None

    def fenced(self) -> None:
        """A write carrying our fence failed: someone else leads. Stop acting as leader now."""
        if self.is_leader:
            log.warning("fenced: our election key is gone or another's", election=self.name)
        self._lose()

    def _lose(self) -> None:
        self.is_leader = False
        try:
            for hook in self.on_lost:
                hook()
        finally:
            # Even past a failing hook: the term's waiter must still step down.
            self.lost.set()


class LocalElection(Election):
    """A single-node store's election: the only candidate always wins."""

    async def campaign(self) -> None:
        self.is_leader = True
        self.lost.clear()

    async def leader_info(self) -> dict[str, Any] | None:
        return self.record() if self.is_leader else None

    async def resign(self) -> None:
        self.is_leader = False


class LeaseElection(Election):
    def __init__(
        self,
        store: Store,
        name: str,
        identity: str,
        ttl: int = 5,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name, identity, info)
        if ttl < 1:
            raise ValueError("election ttl must be at least 1 second")
        self.store = store
        self.ttl = ttl
        self._revision: int | None = None
        self._keepalive: asyncio.Task[None] | None = None

    async def campaign(self) -> None:
        if self.is_leader:
            return
        self.lost.clear()
        lease = await self.store.grant_lease(self.ttl)
        self.lease_id = lease
        self._keepalive = asyncio.create_task(self._keep(lease), name=f"lease-{self.name}")
        try:
            while True:
                try:
                    (self._revision,) = await self.store.commit(
                        [Create(KIND, self.name, {**self.record(), "lease": lease}, lease=lease)]
                    )
                except AlreadyExists:
                    pass
                else:
                    self.is_leader = True
                    self.followed = None
                    log.info("elected leader", election=self.name, identity=self.identity)
                    return
                current = await self.store.get(KIND, self.name)
                if current is None:
                    continue  # it went between our Create and our read: try again at once
                self.followed = current.value
                log.info(
                    "following leader",
                    election=self.name,
                    identity=self.identity,
                    leader=current.value.get("id"),
                )
                await self._wait_until_deleted(current.revision)
        except BaseException:
            await self._release(delete=False)
            raise

    def fence(self) -> Require | None:
        # Not checked against is_leader: a lease lost before the term started still fences
        # (its writes fail), where None would let them through unconditioned.
        if self._revision is None:
            return None
        return Require(KIND, self.name, self._revision)

    async def _wait_until_deleted(self, revision: int) -> None:
        """Until the leader key written at `revision` is gone; fails if our own lease is lost
        meanwhile (a candidate without a live lease would win a key that expires at once)."""
        assert self._keepalive is not None

        async def deleted() -> None:
            events = self.store.watch(KIND, self.name, start_revision=revision + 1)
            try:
                async for event in events:
                    if event.name == self.name and event.deleted:
                        return
            finally:
                await events.aclose()  # type: ignore[attr-defined]

        watcher = asyncio.create_task(deleted())
        try:
            await asyncio.wait({watcher, self._keepalive}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
            raise watcher.exception()  # type: ignore[misc]
        if self._keepalive.done():
            raise OrkaError(f"election {self.name}: lost our lease while campaigning")

    async def _keep(self, lease: int) -> None:
        """Refresh the lease every ttl/3; give leadership up when it cannot be kept."""
        keeper = self.store.lease_keeper()
        if keeper is None:
            reason = await _refresh(self.store, lease, self.ttl, self.name)
        else:
            reason = await self._refresh_in_thread(keeper, lease)
        if self.is_leader:
            log.warning("leadership lost", election=self.name, reason=reason)
        self._lose()

    async def _refresh_in_thread(self, store: LeaseKeeper, lease: int) -> str:
        """`_refresh` on the refresher thread's event loop, fed this loop's progress."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()
        stop = threading.Event()
        ticked = [time.monotonic()]

        def tick() -> None:
            ticked[0] = time.monotonic()
            timer[0] = loop.call_later(self.ttl / 6, tick)

        def end(reason: str) -> None:
            if not ended.done():
                ended.set_result(reason)

        def finished(refreshing: concurrent.futures.Future[str]) -> None:
            try:
                reason = refreshing.result()
            except Exception as err:  # the lease is no longer refreshed: say so, never die mute
                reason = f"lease refresher failed: {err!r}"
            if not stop.is_set():
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    loop.call_soon_threadsafe(end, reason)

        timer = [loop.call_later(self.ttl / 6, tick)]
        refresh = _refresh(store, lease, self.ttl, self.name, stop, lambda: ticked[0], own=True)
        asyncio.run_coroutine_threadsafe(refresh, _refresher_loop()).add_done_callback(finished)
        try:
            return await ended
        finally:
            stop.set()
            timer[0].cancel()

    async def leader_info(self) -> dict[str, Any] | None:
        item = await self.store.get(KIND, self.name)
        return None if item is None else item.value

    async def evict(self, address: str) -> bool:
        # The record of the leader we follow was read when we began to follow it: revoking its
        # lease ends that term and no other (a successor holds a lease of its own), without a
        # read first. Through the lease keeper where the store has one (etcd: plain HTTP), as
        # a standby whose own gRPC is swamped by agents arriving must still get this through.
        record = self.followed
        if record is None or address_of(record) != address or address == self.identity:
            return False
        lease = record.get("lease")
        if isinstance(lease, bool) or not isinstance(lease, int) or lease <= 0:
            return False
        keeper = self.store.lease_keeper()
        if keeper is None:
            await self.store.revoke_lease(lease)
        else:
            try:
                await keeper.revoke_lease(lease)
            finally:
                await keeper.close()
        self.followed = None
        log.warning("evicted the leader", election=self.name, leader=address)
        return True

    async def resign(self) -> None:
        await self._release(delete=True)

    async def abandon(self) -> None:
        task, self._keepalive = self._keepalive, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.is_leader = False
        self.lease_id = None

    async def _release(self, delete: bool) -> None:
        was_leader, revision, lease = self.is_leader, self._revision, self.lease_id
        self.is_leader = False
        self._revision = self.lease_id = None
        task, self._keepalive = self._keepalive, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if delete and was_leader and revision is not None:
            # CAS on our revision: if the key is already someone else's, leave it alone.
            with contextlib.suppress(NotFound, Conflict):
                await self.store.commit([Delete(KIND, self.name, expected_revision=revision)])
        if lease is not None:
            # Revoking also deletes the key if we still held it; harmless if it is gone.
            with contextlib.suppress(OrkaError):
                await self.store.revoke_lease(lease)
        if was_leader:
            log.info("resigned leadership", election=self.name, identity=self.identity)


_refresher: asyncio.AbstractEventLoop | None = None
_refresher_lock = threading.Lock()


def _refresher_loop() -> asyncio.AbstractEventLoop:
    """The event loop lease refreshes run on, in a thread of its own: one per process, never
    closed. grpc.aio hands each call's completions to the loop the call was made on, and a
    loop closed under a call's last completion makes grpc's poller fail in another loop."""
    global _refresher
    with _refresher_lock:
        if _refresher is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="orka-lease", daemon=True).start()
            _refresher = loop
        return _refresher


async def _refresh(
    store: Store | LeaseKeeper,
    lease: int,
    ttl: int,
    name: str,
    stop: threading.Event | None = None,
    ticked: Callable[[], float] | None = None,
    own: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Refresh `lease` every ttl/3 until it cannot be kept (returns why) or `stop` is set.
    `ticked()`: when the service's own loop last ran, where this runs on another one;
    `own`: the store is this refresher's own, opened and closed here."""
    if own:
        await store.open()
    try:
        valid_until = clock() + ttl
        while stop is None or not stop.is_set():
            await asyncio.sleep(ttl / 3)
            if stop is not None and stop.is_set():
                break
            now = clock()
            if ticked is not None and now - ticked() > LOOP_SILENCE * ttl:
                if now < valid_until:
                    continue  # not refreshed: it runs out, and a standby takes over
                return f"the event loop has not run for {now - ticked():.1f}s"
            sent = clock()
            try:
                got = await store.keepalive_lease(lease)
            except NotFound:
                return "lease expired"
            except OrkaError as err:
                # etcd unreachable for now: keep trying while the lease may still be alive.
                if clock() < valid_until:
                    log.warning("lease refresh failed", election=name, error=err.message)
                    continue
                return f"lease not refreshed for {ttl}s: {err.message}"
            # From when the refresh was sent: etcd may have renewed the lease long before its
            # answer is read (a loaded host), and the lease runs out counted from then.
            valid_until = sent + got
        return "stopped"
    finally:
        if own:
            await store.close()


def address_of(record: dict[str, Any]) -> str | None:
    """Where a leader record says its holder is reached: `address`, else its identity."""
    return str(record.get("address") or record.get("id") or "") or None


def election_for(
    store: Store, name: str, identity: str, ttl: int = 5, info: dict[str, Any] | None = None
) -> Election:
    """The election fitting `store`: a lease-based one where the store has leases and watch,
    otherwise (a single-node store) one that always wins."""
    if store.supports_leases and store.supports_watch:
        return LeaseElection(store, name, identity, ttl, info)
    return LocalElection(name, identity, info)
