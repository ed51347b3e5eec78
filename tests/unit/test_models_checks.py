"""The field checks of orka/models.py, asserted on the exact boundary and the exact message:
an operator reads these errors, and a check one off at its limit lets a bad spec through."""

from __future__ import annotations

import re

import pytest

from orka.models import (
    MAX_ACCOUNT_LENGTH,
    MAX_SECRET_KEY_BYTES,
    _check_secret_key,
    check_account,
    check_name,
)
from orka.validation import MAX_NAME_LENGTH, quote


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def test_check_name_message_is_exact() -> None:
    with pytest.raises(
        ValueError,
        match=exactly(
            f"node {quote('Web')} must be 1-{MAX_NAME_LENGTH} lowercase letters, digits or '-',"
            " starting and ending with a letter or digit"
        ),
    ):
        check_name("Web", "node")
    with pytest.raises(ValueError, match=exactly("name is required")):
        check_name("")
    assert check_name("a" * MAX_NAME_LENGTH) == "a" * MAX_NAME_LENGTH


ACCOUNT_ERROR = (
    "must be a user or group name (letters, digits, '_', '.', '-', at most"
    f" {MAX_ACCOUNT_LENGTH} characters) or a numeric id, got "
)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("a b", "'a b'"),
        # exactly the limit: shown whole, no ellipsis
        ("!" * MAX_ACCOUNT_LENGTH, repr("!" * MAX_ACCOUNT_LENGTH)),
        # over it: cut at the limit, with an ellipsis
        ("!" * (MAX_ACCOUNT_LENGTH + 9), repr("!" * MAX_ACCOUNT_LENGTH) + "..."),
    ],
)
def test_check_account_quotes_at_most_the_limit(value: str, shown: str) -> None:
    with pytest.raises(ValueError, match=exactly(ACCOUNT_ERROR + shown)):
        check_account(value)


def test_check_account_numeric_ids_end_below_the_invalid_id() -> None:
    # 0xFFFFFFFF is (uid_t)-1, "no change" to setuid; the highest usable id is one below.
    assert check_account(str(0xFFFFFFFE)) == "4294967294"
    with pytest.raises(ValueError, match=exactly("numeric id 4294967295 is out of range")):
        check_account(str(0xFFFFFFFF))
    assert check_account("") == ""
    assert check_account("www-data") == "www-data"


def test_secret_keys_are_bounded_and_never_hold_nul_or_equals() -> None:
    longest = "K" * MAX_SECRET_KEY_BYTES
    _check_secret_key(longest)
    for bad in ("", "A=B", "A\0", "K" * (MAX_SECRET_KEY_BYTES + 1)):
        shown = repr(bad[:MAX_SECRET_KEY_BYTES])
        with pytest.raises(
            ValueError,
            match=exactly(
                f"key {shown} must be 1-{MAX_SECRET_KEY_BYTES} characters without '=' or NUL"
            ),
        ):
            _check_secret_key(bad)
