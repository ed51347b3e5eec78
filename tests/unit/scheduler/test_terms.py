"""The scheduler's fence on controllers' orders: only the newest leadership term gives them."""

from __future__ import annotations

import grpc
import pytest

from orka.scheduler.terms import LeaderTerms, StaleTerm


@pytest.mark.parametrize(
    ("calls", "refused"),
    [
        ([0, 0, 0], []),  # a single-node store: no terms at all
        ([5, 5, 9, 9], []),  # a leader, then its successor
        ([5, 9, 5], [2]),  # the old leader, resumed after its successor called
        ([9, 5, 0, 9, 12, 9], [1, 2, 5]),
    ],
)
def test_terms_below_the_highest_seen_are_refused(calls: list[int], refused: list[int]) -> None:
    terms = LeaderTerms()
    got = []
    for i, term in enumerate(calls):
        try:
            terms.admit(term)
        except StaleTerm as err:
            got.append(i)
            assert err.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"term {term} is stale" in err.message
    assert got == refused
    assert terms.highest == max(calls)
