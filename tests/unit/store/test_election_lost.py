"""What an election does the moment it learns leadership is lost: the holder's hooks run first,
in the same turn, and the term's waiter hears of it even when a hook fails."""

from __future__ import annotations

import pytest

from orka.store.election import LocalElection


async def test_hooks_run_before_anything_waiting_on_lost_can() -> None:
    election = LocalElection("controller", "127.0.0.1:1")
    await election.campaign()
    seen: list[tuple[bool, bool]] = []
    election.on_lost.append(lambda: seen.append((election.is_leader, election.lost.is_set())))
    election.fenced()
    # Already not leading, and `lost` not yet set: no waiter has been woken before the hook.
    assert seen == [(False, False)]
    assert election.lost.is_set() and not election.is_leader


async def test_a_failing_hook_still_ends_the_term() -> None:
    election = LocalElection("controller", "127.0.0.1:1")
    await election.campaign()
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("hook failed")

    election.on_lost.append(broken)
    with pytest.raises(RuntimeError, match="hook failed"):
        election.fenced()
    assert calls == ["broken"]
    assert election.lost.is_set() and not election.is_leader
