"""Which scheduler a client dials next (orka/rpc/targets.py): following NOT_LEADER answers."""

from __future__ import annotations

import grpc
import pytest

from orka.errors import NotLeader, PermissionDenied, Unavailable, trailing_metadata, wire_message
from orka.rpc.targets import DOWN_FOR, FAILOVER_PAUSE, NOT_LEADER_PAUSE, Targets, hint_of

A, B, C = "10.0.0.1:7444", "10.0.0.2:7444", "10.0.0.3:7444"
BACKOFF = 1.6


def rpc_error(err: NotLeader | Unavailable | PermissionDenied) -> grpc.aio.AioRpcError:
    """The error a client sees when a server aborts with `err` (its rich-status trailer)."""
    return grpc.aio.AioRpcError(
        err.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing_metadata(err)),
        details=wire_message(err),
    )


def not_leader(leader: str | None) -> grpc.aio.AioRpcError:
    return rpc_error(NotLeader("not the active scheduler", leader=leader))


# (targets, index of current, the failure, -> the next current, the delay)
CASES = [
    pytest.param([A, B, C], 0, not_leader(C), C, 0.0, id="leader in the list: there at once"),
    pytest.param([A, B, C], 1, not_leader(A), A, 0.0, id="leader earlier in the list"),
    pytest.param(
        [A, B], 0, not_leader("evil.example:7444"), B, NOT_LEADER_PAUSE, id="outside: ignored"
    ),
    pytest.param([A, B], 0, not_leader(A), A, 0.0, id="names itself: it took over, again"),
    pytest.param([A, B, C], 1, not_leader(None), C, NOT_LEADER_PAUSE, id="no leader: next"),
    pytest.param([A, B], 1, not_leader(None), A, NOT_LEADER_PAUSE, id="no leader: wraps"),
    pytest.param(
        [A, B], 0, rpc_error(Unavailable("connection refused")), B, BACKOFF, id="down: backoff"
    ),
    pytest.param(
        [A, B], 0, rpc_error(PermissionDenied("wrong role")), B, BACKOFF, id="refused: backoff"
    ),
    pytest.param([A, B], 0, RuntimeError("bug"), B, BACKOFF, id="any other failure"),
    pytest.param([A, B], 0, None, B, BACKOFF, id="stream ended without error"),
    pytest.param([A, B, C], 0, NotLeader("raised here", leader=B), B, 0.0, id="OrkaError itself"),
    pytest.param([A], 0, not_leader(None), A, NOT_LEADER_PAUSE, id="one target"),
]


@pytest.mark.parametrize(("addresses", "index", "error", "then", "delay"), CASES)
def test_next_target(
    addresses: list[str],
    index: int,
    error: BaseException | None,
    then: str,
    delay: float,
) -> None:
    targets = Targets(addresses)
    for _ in range(index):
        targets.failed(not_leader(None), BACKOFF)  # moves on, marks nothing down
    assert targets.current == addresses[index]
    assert targets.failed(error, BACKOFF) == delay
    assert targets.current == then


def test_an_address_outside_the_list_is_never_dialed() -> None:
    """A standby (or anything holding a scheduler certificate) naming another address cannot
    send the client there, however often it says so."""
    targets = Targets([A, B])
    seen = set()
    for _ in range(10):
        targets.failed(not_leader("10.9.9.9:7444"), BACKOFF)
        seen.add(targets.current)
    assert seen == {A, B}


def test_two_servers_naming_each_other_cannot_make_it_spin() -> None:
    """A follows B's hint at once, but B's hint back to A is followed only after a pause."""
    targets = Targets([A, B])
    assert targets.failed(not_leader(B), BACKOFF) == 0.0
    assert targets.current == B
    assert targets.failed(not_leader(A), BACKOFF) == NOT_LEADER_PAUSE
    assert targets.current == A
    # The pause broke the chain: a hint is followed at once again.
    assert targets.failed(not_leader(B), BACKOFF) == 0.0
    assert targets.current == B


def test_a_followed_leader_that_is_down_means_a_failover_is_under_way() -> None:
    """The standby still names the old active scheduler (its lease has not expired): the client
    goes there at once, finds it down, and asks the standby again after a short pause rather
    than its (growing) backoff, which would hold it away long after the standby took over."""
    targets = Targets([A, B])
    targets.failed(None, BACKOFF)  # A died: on to B
    assert targets.failed(not_leader(A), BACKOFF) == 0.0
    assert targets.current == A
    down = rpc_error(Unavailable("connection refused"))
    assert targets.failed(down, BACKOFF) == FAILOVER_PAUSE
    assert targets.current == B
    # A smaller backoff stays as it is; a failure not following a hint keeps the backoff.
    assert targets.failed(not_leader(A), 0.4) == 0.0
    assert targets.failed(down, 0.4) == 0.4
    assert targets.failed(down, BACKOFF) == BACKOFF


def test_while_the_dead_one_is_down_the_standby_is_asked_again() -> None:
    """After the old active's lease expired and before the standby has taken over, the standby
    names nobody: the client asks it again after a short pause rather than dialing the dead
    address (whose refusal would cost it a whole backoff)."""
    now = [100.0]
    targets = Targets([A, B], clock=lambda: now[0])
    down = rpc_error(Unavailable("connection refused"))
    assert targets.failed(down, BACKOFF) == BACKOFF  # A died under the client
    assert targets.current == B
    for _ in range(3):
        assert targets.failed(not_leader(None), BACKOFF) == NOT_LEADER_PAUSE
        assert targets.current == B
    # Once A has been down long enough, it is tried again in turn.
    now[0] += DOWN_FOR
    targets.failed(not_leader(None), BACKOFF)
    assert targets.current == A


def test_a_hint_is_followed_even_to_an_address_that_was_down() -> None:
    """The election is the authority: a restarted server named by it is tried at once."""
    targets = Targets([A, B, C], clock=lambda: 0.0)
    targets.failed(rpc_error(Unavailable("connection refused")), BACKOFF)  # A down
    assert targets.current == B
    assert targets.failed(not_leader(A), BACKOFF) == 0.0
    assert targets.current == A


def test_when_every_other_is_down_it_goes_round_in_order() -> None:
    targets = Targets([A, B, C], clock=lambda: 0.0)
    down = rpc_error(Unavailable("connection refused"))
    seen = []
    for _ in range(4):
        targets.failed(down, BACKOFF)
        seen.append(targets.current)
    assert seen == [B, C, A, B]


def test_connecting_clears_the_down_mark() -> None:
    targets = Targets([A, B], clock=lambda: 0.0)
    down = rpc_error(Unavailable("connection refused"))
    targets.failed(down, BACKOFF)  # A down, now at B
    targets.failed(down, BACKOFF)  # B down too: round to A
    assert targets.current == A
    targets.connected()  # A answers after all
    targets.failed(not_leader(None), BACKOFF)  # on to B? B is down, A is not: stay on A
    assert targets.current == A


def test_connected_resets_the_chain() -> None:
    targets = Targets([A, B])
    targets.failed(not_leader(B), BACKOFF)
    targets.connected()
    assert targets.failed(not_leader(A), BACKOFF) == 0.0
    assert targets.current == A


def test_a_server_naming_itself_is_asked_again_at_once_but_only_once() -> None:
    """A standby that held the client until it took over names itself: asked again at once.
    Naming itself a second time in a row (it lost its lease again) cannot make it spin."""
    targets = Targets([A, B])
    targets.failed(None, BACKOFF)  # A died: on to B
    assert targets.failed(not_leader(B), BACKOFF) == 0.0
    assert targets.current == B
    assert targets.failed(not_leader(B), BACKOFF) == NOT_LEADER_PAUSE
    assert targets.current == B  # after a pause; A is still down


def test_unreachable_lists_what_was_down_lately() -> None:
    now = [100.0]
    targets = Targets([A, B, C], clock=lambda: now[0])
    assert targets.unreachable() == []
    targets.failed(rpc_error(Unavailable("connection refused")), BACKOFF)  # A down
    targets.failed(not_leader(None), BACKOFF)  # B answers: not down
    assert targets.unreachable() == [A]
    now[0] += DOWN_FOR
    assert targets.unreachable() == []


def test_hint_reads_structured_details_not_prose() -> None:
    """Prose naming an address is no hint; only ErrorInfo metadata `leader` is."""
    prose = rpc_error(Unavailable(f"not the leader; the leader is at {B}"))
    assert hint_of(prose).leader is None and not hint_of(prose).not_leader
    assert hint_of(not_leader(B)).leader == B


def test_needs_an_address() -> None:
    with pytest.raises(ValueError, match=r"^at least one address is required$"):
        Targets([])


def test_failed_at_says_when_an_address_was_last_unreachable() -> None:
    now = [100.0]
    t = Targets([A, B], clock=lambda: now[0])
    assert t.failed_at(A) is None
    t.failed(rpc_error(Unavailable("refused")), BACKOFF)
    assert (t.failed_at(A), t.failed_at(B)) == (100.0, None)
    now[0] = 101.5
    t.failed(not_leader(None), BACKOFF)  # B answered: alive, only not leading
    assert (t.failed_at(A), t.failed_at(B)) == (100.0, None)
    assert t.current == B  # A is down lately: B is asked again
    t.failed(rpc_error(Unavailable("refused")), BACKOFF)
    assert (t.failed_at(A), t.failed_at(B)) == (100.0, 101.5)
    current = t.current
    t.connected()
    assert t.failed_at(current) is None
