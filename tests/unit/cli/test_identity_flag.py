"""--identity NAME: which pair of --certs the client commands present."""

from __future__ import annotations

import argparse

import pytest

from orka.cli.defaults import UsageError, client_identity
from orka.cli.main import build_parser


@pytest.mark.parametrize(
    ("value", "identity"),
    [
        ("admin", ("admin", "admin")),
        ("viewer-alice", ("viewer", "alice")),
        ("admin-bob", ("admin", "bob")),
        ("agent-node-1", ("agent", "node-1")),
    ],
)
def test_names_map_to_the_pairs_certs_issue_writes(value: str, identity: tuple[str, str]) -> None:
    assert client_identity(argparse.Namespace(identity=value)) == identity


@pytest.mark.parametrize("value", ["nobody", "viewer-", "viewer-../../etc", "Admin", "x" * 300])
def test_a_malformed_name_is_a_usage_error_without_echoing_it_whole(value: str) -> None:
    with pytest.raises(UsageError) as err:
        client_identity(argparse.Namespace(identity=value))
    assert err.value.message.startswith("--identity: ")
    assert len(err.value.message) < 250


def test_flag_before_or_after_the_command_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORKA_IDENTITY", raising=False)
    parse = build_parser().parse_args
    assert parse(["get", "workloads"]).identity == "admin"
    assert parse(["--identity", "viewer-a", "get", "workloads"]).identity == "viewer-a"
    assert parse(["get", "workloads", "--identity", "viewer-b"]).identity == "viewer-b"
    monkeypatch.setenv("ORKA_IDENTITY", "viewer-env")
    assert build_parser().parse_args(["get", "workloads"]).identity == "viewer-env"
    assert build_parser().parse_args(["apply", "--identity", "admin"]).identity == "admin"
