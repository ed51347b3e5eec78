from __future__ import annotations

import pytest

from orka.models import WorkloadKind, WorkloadSpec
from orka.runtime import identity
from orka.runtime.identity import IdentityRefused, UserPolicy


def spec(user: str = "", group: str = "") -> WorkloadSpec:
    return WorkloadSpec(name="w", kind=WorkloadKind.PROCESS, command=["x"], user=user, group=group)


@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity.os, "geteuid", lambda: 0)


@pytest.mark.usefixtures("as_root")
def test_default_user_with_its_group() -> None:
    ident = UserPolicy().resolve(spec())
    assert (ident.user, ident.uid, ident.gid, ident.switch) == ("nobody", 65534, 65534, True)


@pytest.mark.usefixtures("as_root")
def test_configured_default_user_and_group() -> None:
    ident = UserPolicy(default_user="daemon", default_group="nogroup").resolve(spec())
    assert (ident.uid, ident.gid) == (1, 65534)
    # A spec naming its own user does not inherit the node's default group.
    ident = UserPolicy(default_user="daemon", default_group="nogroup").resolve(spec("bin"))
    assert (ident.uid, ident.gid) == (2, 2)


@pytest.mark.usefixtures("as_root")
def test_numeric_ids() -> None:
    assert UserPolicy().resolve(spec("1")).gid == 1  # daemon's group from passwd
    # No passwd entry: its own number as group, never root's.
    ident = UserPolicy().resolve(spec("4242"))
    assert (ident.uid, ident.gid) == (4242, 4242)
    assert UserPolicy().resolve(spec("4242", "4343")).gid == 4343


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize(
    ("user", "group", "needle"),
    [
        ("root", "", "user 'root' is root"),
        ("0", "", "user '0' is root"),
        ("nobody", "root", "group 'root' is root"),
        ("nobody", "0", "group '0' is root"),
        ("no-such-user-xyz", "", "user 'no-such-user-xyz' does not exist on this node"),
        ("nobody", "no-such-group-xyz", "group 'no-such-group-xyz' does not exist"),
    ],
)
def test_refusals(user: str, group: str, needle: str) -> None:
    with pytest.raises(IdentityRefused, match=needle):
        UserPolicy().resolve(spec(user, group))


@pytest.mark.usefixtures("as_root")
def test_root_when_allowed() -> None:
    ident = UserPolicy(allow_root=True).resolve(spec("root"))
    assert (ident.uid, ident.gid, ident.switch) == (0, 0, True)
    # Allowed per node, never the default: a spec naming no user still gets nobody.
    assert UserPolicy(allow_root=True).resolve(spec()).uid == 65534


def test_unprivileged_agent_runs_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity.os, "geteuid", lambda: 1)
    monkeypatch.setattr(identity.os, "getegid", lambda: 1)
    ident = UserPolicy().resolve(spec())
    assert (ident.user, ident.uid, ident.gid, ident.switch) == ("daemon", 1, 1, False)
    assert UserPolicy().resolve(spec("daemon")).switch is False
    assert UserPolicy().resolve(spec("1", "daemon")).switch is False
    with pytest.raises(IdentityRefused, match="runs as 'daemon', not root, so it cannot run"):
        UserPolicy().resolve(spec("nobody"))
    with pytest.raises(IdentityRefused, match="group 'nogroup'"):
        UserPolicy().resolve(spec("", "nogroup"))


@pytest.mark.usefixtures("as_root")
def test_the_root_refusal_names_the_flag_that_allows_it() -> None:
    with pytest.raises(IdentityRefused) as refused:
        UserPolicy().resolve(spec("root"))
    assert str(refused.value) == (
        "user 'root' is root and this node does not allow root workloads"
        " (the agent's --allow-root-workloads)"
    )


def test_an_unprivileged_agent_without_a_passwd_entry_goes_by_its_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(identity.os, "geteuid", lambda: 4242)
    monkeypatch.setattr(identity.os, "getegid", lambda: 4343)
    ident = UserPolicy().resolve(spec("4242"))
    assert (ident.user, ident.uid, ident.gid, ident.switch) == ("4242", 4242, 4343, False)
    with pytest.raises(IdentityRefused, match="the agent runs as '4242', not root"):
        UserPolicy().resolve(spec("nobody"))
