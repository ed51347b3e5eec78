"""Paging helpers: page sizes, tokens bound to their filters, walks strictly after a key."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from sortedcontainers import SortedList

from orka.controller import paging
from orka.errors import FieldViolation, Invalid


@pytest.mark.parametrize(
    ("asked", "got"),
    [(0, paging.DEFAULT_PAGE_SIZE), (1, 1), (1000, 1000), (1001, 1000), (2**31 - 1, 1000)],
)
def test_page_size_defaults_and_coerces_to_the_maximum(asked: int, got: int) -> None:
    assert paging.page_size(asked) == got


def test_a_negative_page_size_is_invalid() -> None:
    with pytest.raises(Invalid, match=r"^page_size: must be >= 0, got -1$") as info:
        paging.page_size(-1)
    assert info.value.violations() == [FieldViolation("page_size", "must be >= 0, got -1")]


def test_tokens_round_trip_for_their_own_filters_only() -> None:
    shape = (str, float, str)
    mine = paging.fingerprint("instances", "web", "", 0)
    token = paging.encode_token(("web", 1795000000.123456, "web-1"), mine)
    assert paging.decode_token(token, mine, shape) == ("web", 1795000000.123456, "web-1")
    assert paging.decode_token("", mine, shape) is None
    other = paging.fingerprint("instances", "db", "", 0)
    with pytest.raises(
        Invalid, match=r"^page_token: was issued for a listing with other filters"
    ) as info:
        paging.decode_token(token, other, shape)
    assert [v.field for v in info.value.violations()] == ["page_token"]


def _forged(key: object, f: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"k": key, "f": f}).encode()).decode()


@pytest.mark.parametrize(
    "token",
    [
        "%%%",
        "x" * (paging.MAX_TOKEN_CHARS + 1),
        base64.urlsafe_b64encode(b"not json").decode(),
        base64.urlsafe_b64encode(b"[]").decode(),
        _forged(["web", 1.0], "F"),
        _forged(["web", "one", "web-1"], "F"),
        _forged(["web", True, "web-1"], "F"),
        _forged([1, 1.0, "web-1"], "F"),
        _forged(["web", 1.0, "web-1"], 7),
    ],
)
def test_what_is_not_our_token_is_invalid_naming_page_token(token: str) -> None:
    with pytest.raises(Invalid, match=r"^page_token: ") as info:
        paging.decode_token(token, "F", (str, float, str))
    assert [v.field for v in info.value.violations()] == ["page_token"]


def test_an_integer_time_in_a_token_is_taken_as_a_float() -> None:
    assert paging.decode_token(_forged(["w", 3, "n"], "F"), "F", (str, float, str)) == (
        "w",
        3.0,
        "n",
    )


def test_pages_resume_strictly_after_the_key_and_stop_at_size_and_bytes() -> None:
    index = SortedList([("a",), ("b",), ("c",), ("d",), ("e",)])
    keep = {"a": 1, "b": 1, "c": None, "d": 5, "e": 1}

    def pick(key: paging.Key) -> int | None:
        return keep[key[0]]

    page, last = paging.take_page(paging.after(index, None), 2, pick, lambda n: n)
    assert (page, last) == ([1, 1], ("b",))
    # "c" is filtered out; the byte bound stops before "d" only when something is taken.
    page, last = paging.take_page(paging.after(index, last), 5, pick, lambda n: n, max_bytes=4)
    assert (page, last) == ([5], ("d",))
    page, last = paging.take_page(paging.after(index, last), 5, pick, lambda n: n, max_bytes=4)
    assert (page, last) == ([1], None)
    # A token's key need not exist any more (deleted meanwhile); a lower bound applies first.
    assert list(paging.after(index, ("bb",))) == [("c",), ("d",), ("e",)]
    assert list(paging.after(index, ("a",), lower=("c",))) == [("c",), ("d",), ("e",)]
    assert list(paging.after(index, None, lower=("d",))) == [("d",), ("e",)]


def test_a_token_at_the_lower_bound_resumes_after_it_not_at_it() -> None:
    index = SortedList([("a",), ("b",), ("c",)])
    # The first page of a range starting at "b" ended on "b": the next starts at "c".
    assert list(paging.after(index, ("b",), lower=("b",))) == [("c",)]


def test_a_page_holds_exactly_its_byte_bound() -> None:
    index = SortedList([("a",), ("b",), ("c",)])
    page, last = paging.take_page(
        paging.after(index, None), 10, lambda key: key[0], lambda item: 50, max_bytes=100
    )
    assert (page, last) == (["a", "b"], ("b",))


def test_a_token_is_compact_json_without_padding_bound_to_the_filters_texts() -> None:
    """Any controller of the cluster resumes a listing another began (after a failover): the
    token and the fingerprint are the same text everywhere."""
    filters = paging.fingerprint("web", 5)
    assert filters == hashlib.sha256(b'["web","5"]').hexdigest()[:16]
    for name in ("a", "ab", "abc"):  # every padding length base64 has
        token = paging.encode_token((name, 1.5), filters)
        assert not token.endswith("=")
        body = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        assert body.decode() == f'{{"k":["{name}",1.5],"f":"{filters}"}}'
        assert paging.decode_token(token, filters, (str, float)) == (name, 1.5)


def test_a_token_at_the_length_limit_is_read_not_refused_for_its_length() -> None:
    with pytest.raises(Invalid) as info:
        paging.decode_token("x" * paging.MAX_TOKEN_CHARS, "F", (str,))
    assert info.value.message == "page_token: not a page token this server issued"
