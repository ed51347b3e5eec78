"""Etags on their own: a workload's is 16 random bytes, a node's a 16-byte digest of what users
write of it (the four values are made once, at import, by the same function tested here)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from orka.errors import Aborted
from orka.etags import _digest, check_etag, new_workload_etag, node_etag

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_a_workload_etag_is_sixteen_random_bytes() -> None:
    tokens = {new_workload_etag() for _ in range(100)}
    assert len(tokens) == 100
    assert all(HEX32.fullmatch(t) for t in tokens)


def test_a_node_etag_follows_what_users_write_and_nothing_else() -> None:
    combos = [(s, d) for s in (False, True) for d in (False, True)]
    digests = {combo: _digest(*combo) for combo in combos}
    assert all(HEX32.fullmatch(d) for d in digests.values())
    assert len(set(digests.values())) == 4
    for (schedulable, draining), digest in digests.items():
        node = SimpleNamespace(schedulable=schedulable, draining=draining, state="READY")
        assert node_etag(node) == digest
        node.state = "NOT_READY"  # heartbeats and states move; the etag does not
        assert node_etag(node) == digest


def test_a_stale_etag_is_refused_naming_both() -> None:
    check_etag("", "abc", "workload 'web'")  # none sent: no check
    check_etag("abc", "abc", "workload 'web'")
    with pytest.raises(Aborted) as info:
        check_etag("old", "new", "workload 'web'")
    assert info.value.message == (
        "workload 'web' was changed since it was read (etag 'old' is stale, now 'new'); "
        "re-read it and apply your change again"
    )
