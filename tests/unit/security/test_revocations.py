"""The process's revoked serials and the live calls a new revocation cuts (`Revocations`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from orka.errors import Unauthenticated
from orka.security.revocation import REVOKED, REVOKED_DETAILS, Revocations
from orka.security.revoke import serial_of
from tests.waits import until


class Context:
    """A call's context as the cut sees it: abort() sends the status, then raises, as grpc's
    does."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str, object]] = []

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()
    ) -> None:
        self.aborted.append((code, details, trailing_metadata))
        raise grpc.aio.AbortError()


async def _call(registry: Revocations, pem: bytes, context: Context, hold: bool) -> None:
    """A handler admitted for `pem`, then parked (a stream waiting on its peer) or done."""
    registry.admit(pem, context)  # type: ignore[arg-type]
    if hold:
        await asyncio.Event().wait()


def test_files_add_up_and_a_forgotten_file_revokes_no_more(tmp_path: Path) -> None:
    registry = Revocations()
    registry.update(tmp_path / "a.pem", frozenset({1, 2}))
    registry.update(tmp_path / "b.pem", frozenset({3}))
    assert registry.revoked == {1, 2, 3}
    registry.forget(tmp_path / "a.pem")
    assert registry.revoked == {3}
    assert not registry.is_revoked(1) and registry.is_revoked(3)
    registry.forget(tmp_path / "never-watched.pem")
    assert registry.revoked == {3}


async def test_every_live_call_of_a_revoked_peer_is_cut_and_told_why(certs: Path) -> None:
    registry = Revocations()
    admin_pem = (certs / "admin.crt").read_bytes()
    node_pem = (certs / "agent-node-1" / "agent-node-1.crt").read_bytes()
    # The admin's first call has ended (kept referenced, so its entry stays), two more are
    # live; the node's call is live too and must be left alone.
    contexts = [Context() for _ in range(4)]
    done = asyncio.create_task(_call(registry, admin_pem, contexts[0], hold=False))
    await done
    live = [asyncio.create_task(_call(registry, admin_pem, contexts[i], hold=True)) for i in (1, 2)]
    node = asyncio.create_task(_call(registry, node_pem, contexts[3], hold=True))
    await until(
        lambda: (
            len(registry.calls) == 2
            and len(registry.calls[serial_of(certs, "admin", "admin")]) == 3
        )
    )

    cut = registry.update(certs / "crl.pem", frozenset({serial_of(certs, "admin", "admin")}))

    assert cut == 2
    for task in live:
        with pytest.raises(asyncio.CancelledError):
            await task
    refusal = (grpc.StatusCode.UNAUTHENTICATED, REVOKED, REVOKED_DETAILS)
    assert [c.aborted for c in contexts] == [[], [refusal], [refusal], []]
    assert not node.done()
    # The cuts let go of themselves once done: nothing is kept per revoked call.
    await until(lambda: not registry._cutting, timeout=5.0)
    with pytest.raises(Unauthenticated, match=f"^{REVOKED}$"):
        registry.admit(admin_pem, Context())  # type: ignore[arg-type]
    node.cancel()


async def test_a_call_is_cut_even_when_telling_its_peer_fails(certs: Path) -> None:
    """abort() on a call whose peer already left raises; the handler is cancelled anyway."""
    registry = Revocations()
    admin_pem = (certs / "admin.crt").read_bytes()

    class Gone(Context):
        async def abort(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("the call is already finished")

    task = asyncio.create_task(_call(registry, admin_pem, Gone(), hold=True))
    await until(lambda: registry.calls)
    assert registry.update(certs / "crl.pem", frozenset({serial_of(certs, "admin", "admin")})) == 1
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_revocation_of_nothing_new_cuts_nothing(certs: Path) -> None:
    registry = Revocations()
    admin = serial_of(certs, "admin", "admin")
    registry.update(certs / "crl.pem", frozenset({admin}))
    node_pem = (certs / "agent-node-1" / "agent-node-1.crt").read_bytes()
    task = asyncio.create_task(_call(registry, node_pem, Context(), hold=True))
    await until(lambda: registry.calls)
    assert registry.update(certs / "crl.pem", frozenset({admin})) == 0
    assert not task.done()
    task.cancel()
