"""Who a process workload runs as: the user policy of one node and the ids it resolves to.

Like Nomad's exec driver, a workload that names no user runs as an unprivileged one the agent
is configured with (`nobody` by default), with that user's group and no supplementary groups.
Root is a choice the operator makes per node (`--allow-root-workloads`), never a default. An
agent that is not root itself cannot switch users at all: it runs workloads as itself and
refuses specs that name someone else.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from orka.models import WorkloadSpec

DEFAULT_WORKLOAD_USER = "nobody"


@dataclass(frozen=True)
class Identity:
    """The resolved ids a task runs with; `switch` is False when the agent runs it as itself."""

    user: str
    uid: int
    gid: int
    switch: bool

    @property
    def privileged(self) -> bool:
        return self.uid == 0 or self.gid == 0


class IdentityRefused(Exception):
    """A spec's user or group cannot be used on this node; the message says why."""


def _lookup_user(user: str) -> tuple[int, int | None]:
    """(uid, primary gid or None when the numeric uid has no passwd entry)."""
    try:
        entry = pwd.getpwnam(user)
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        pass
    if user.isdigit():
        uid = int(user)
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, None
    raise IdentityRefused(f"user {user!r} does not exist on this node")


def _lookup_group(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        pass
    if group.isdigit():
        return int(group)
    raise IdentityRefused(f"group {group!r} does not exist on this node")


@dataclass(frozen=True)
class UserPolicy:
    """One node's rules: the default user and group, and whether root is allowed."""

    default_user: str = DEFAULT_WORKLOAD_USER
    default_group: str = ""
    allow_root: bool = False

    def resolve(self, spec: WorkloadSpec) -> Identity:
        """The identity `spec` runs as here; raises IdentityRefused with a reason otherwise."""
        if os.geteuid() != 0:
            return self._as_self(spec)
        user = spec.user or self.default_user
        group = spec.group or ("" if spec.user else self.default_group)
        uid, primary = _lookup_user(user)
        if group:
            gid = _lookup_group(group)
        elif primary is not None:
            gid = primary
        else:
            # A bare numeric uid: its own number as group, never root's group by accident.
            gid = uid
        identity = Identity(user=user, uid=uid, gid=gid, switch=True)
        if identity.privileged and not self.allow_root:
            who = f"user {user!r}" if uid == 0 else f"group {group or gid!r}"
            raise IdentityRefused(
                f"{who} is root and this node does not allow root workloads"
                " (the agent's --allow-root-workloads)"
            )
        return identity

    def _as_self(self, spec: WorkloadSpec) -> Identity:
        uid, gid = os.geteuid(), os.getegid()
        try:
            me = pwd.getpwuid(uid).pw_name
        except KeyError:
            me = str(uid)
        if spec.user and spec.user not in (me, str(uid)):
            raise IdentityRefused(
                f"the agent runs as {me!r}, not root, so it cannot run a workload as"
                f" user {spec.user!r}"
            )
        if spec.group and _lookup_group(spec.group) != gid:
            raise IdentityRefused(
                f"the agent runs as {me!r}, not root, so it cannot run a workload as"
                f" group {spec.group!r}"
            )
        return Identity(user=me, uid=uid, gid=gid, switch=False)
