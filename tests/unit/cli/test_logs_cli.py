"""`orka logs` helpers: --since, workload prefixes; `orka exec` flag parsing."""

from __future__ import annotations

import io

import pytest

from orka.cli.defaults import UsageError
from orka.cli.logs import Prefixer, build_request, parse_since
from orka.cli.main import build_parser


def test_parse_since() -> None:
    assert parse_since("90s", now=1000.0) == 910.0
    assert parse_since("1m30s", now=1000.0) == 910.0
    assert parse_since("2026-01-02T03:04:05Z") == 1767323045.0
    with pytest.raises(UsageError, match="--since: 'yesterday' is neither a duration"):
        parse_since("yesterday")


def test_build_request() -> None:
    req = build_request("web-1", True, 5, 1767323045.5)
    assert (req.instance, req.follow, req.tail_lines) == ("web-1", True, 5)
    assert req.since_time.seconds == 1767323045 and req.since_time.nanos == 500_000_000
    assert not build_request("web-1", False, None, None).HasField("since_time")


def test_prefixer_prefixes_whole_lines() -> None:
    out = io.BytesIO()
    p = Prefixer(b"[web-1] ", out)  # type: ignore[arg-type]
    p.write(b"one\ntw")
    p.write(b"o\nthree")
    assert out.getvalue() == b"[web-1] one\n[web-1] two\n"
    p.close()
    assert out.getvalue().endswith(b"[web-1] three\n")


def test_exec_takes_flags_before_the_double_dash() -> None:
    args = build_parser().parse_args(
        ["exec", "-t", "web-1", "--controller", "h:1", "--", "sh", "-c", "echo -i"]
    )
    assert args.instance == "web-1" and args.tty
    assert args.command == ["--controller", "h:1", "--", "sh", "-c", "echo -i"]
