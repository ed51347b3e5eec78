"""`orka certs init|issue`: the cluster CA and the certificates each identity uses."""

from __future__ import annotations

import argparse
from pathlib import Path

from orka.cli.defaults import (
    UsageError,
    add_flag,
    append_from_env,
    env_value,
    resolve_certs,
    resolve_data_dir,
)
from orka.security.issue import init_certs, issue_cert


def _dir(args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir).expanduser()
    # Same place `orka up` and the client commands look, so the defaults line up.
    return resolve_certs(env_value("--certs"), resolve_data_dir(None))


def _report(paths: list[Path], dir: Path) -> None:
    if not paths:
        print(f"nothing to do: every certificate already exists in {dir}")
        return
    for p in paths:
        print(f"wrote {p}")


def cmd_init(args: argparse.Namespace) -> int:
    dir = _dir(args)
    nodes = append_from_env(args.node, "--node")
    hosts = append_from_env(args.host, "--host")
    _report(init_certs(dir, nodes=nodes, extra_hosts=hosts), dir)
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    if not args.role:
        raise UsageError("--role: is required (controller, scheduler, agent, admin or viewer)")
    if not args.name:
        raise UsageError("--name: is required")
    dir = _dir(args)
    _report(issue_cert(dir, args.role, args.name, append_from_env(args.host, "--host")), dir)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="create the cluster CA and certificates")
    csub = p.add_subparsers(dest="certs_command", metavar="init|issue")
    csub.required = True

    init = csub.add_parser("init", help="CA + controller, scheduler, admin and agent certs")
    add_flag(init, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(init, "--node", action="append", metavar="NAME", help="agent cert per node")
    add_flag(init, "--host", action="append", metavar="H", help="extra DNS name or IP")
    init.set_defaults(func=cmd_init)

    issue = csub.add_parser("issue", help="issue (or re-issue) one certificate")
    add_flag(issue, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(issue, "--role", metavar="ROLE", help="controller, scheduler, agent, admin or viewer")
    add_flag(issue, "--name", metavar="NAME", help="the identity's name, e.g. the node name")
    add_flag(issue, "--host", action="append", metavar="H", help="extra DNS name or IP")
    issue.set_defaults(func=cmd_issue)
