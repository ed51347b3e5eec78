"""`orka rollout status|history|undo|pause|resume|promote WORKLOAD`: follow and steer the
rolling update of a workload (orka/controller/rollout.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import yaml

from orka.cli import output
from orka.cli.client import AdminClient
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.errors import Aborted
from orka.models import Revision, RolloutState, Workload

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_TIMED_OUT = 2
# How often `status` asks the controller while it follows a rollout.
POLL_SECONDS = 0.5
# States `status` stops following at, and its exit code there.
_FINAL = {
    RolloutState.COMPLETE: EXIT_DONE,
    RolloutState.FAILED: EXIT_FAILED,
    RolloutState.ROLLED_BACK: EXIT_FAILED,
}


def _client(args: argparse.Namespace) -> AdminClient:
    address, certs = client_target(args)
    return AdminClient(address, certs, identity=client_identity(args))


def _format(args: argparse.Namespace) -> str:
    if args.output not in output.FORMATS:
        raise UsageError(f"-o/--output: {args.output!r} is not one of {', '.join(output.FORMATS)}")
    return str(args.output)


# ---- rendering (pure, for the output tests) ----


def status_data(w: Workload) -> dict[str, Any]:
    r, s = w.rollout, w.status
    return {
        "workload": w.name,
        "revision": r.revision,
        "state": r.state.value,
        "desired": w.spec.replicas,
        "updated": s.updated,
        "ready": s.ready,
        "stable_revision": r.stable,
        "message": r.message,
        "deadline_time": output.rfc3339(r.deadline)
        if r.state is RolloutState.PROGRESSING
        else None,
    }


def status_line(w: Workload) -> str:
    r, s = w.rollout, w.status
    text = (
        f"workload/{w.name} revision {r.revision}: {r.state.value},"
        f" {s.updated} of {w.spec.replicas} updated, {s.ready} ready"
    )
    return f"{text} ({r.message})" if r.message else text


def render_status(w: Workload, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(status_data(w), indent=2)
    if fmt == "yaml":
        return yaml.safe_dump(status_data(w), sort_keys=False).rstrip("\n")
    return status_line(w)


def _history_data(revisions: Sequence[Revision], current: int) -> list[dict[str, Any]]:
    return [
        {
            "revision": r.revision,
            "current": r.revision == current,
            "create_time": output.rfc3339(r.created_at),
            "created_by": r.created_by,
            "cause": r.cause,
            "command": list(r.spec.command) if r.spec else [],
            "image": r.spec.image if r.spec else "",
        }
        for r in revisions
    ]


def render_history(
    revisions: Sequence[Revision], current: int, fmt: str, now: float | None = None
) -> str:
    if fmt == "json":
        return json.dumps(_history_data(revisions, current), indent=2)
    if fmt == "yaml":
        return yaml.safe_dump(_history_data(revisions, current), sort_keys=False).rstrip("\n")
    rows = [
        (
            f"{r.revision}{' *' if r.revision == current else ''}",
            output.age(r.created_at, now),
            r.created_by or output.NONE,
            r.cause or output.NONE,
        )
        for r in revisions
    ]
    return output.table(("REVISION", "AGE", "BY", "CAUSE"), rows)


# ---- commands ----


async def _status(args: argparse.Namespace, fmt: str) -> int:
    deadline = time.monotonic() + args.timeout if args.timeout else None
    last = ""
    async with _client(args) as c:
        while True:
            w = await c.get_workload(args.workload)
            text = render_status(w, fmt)
            if text != last:
                print(text, flush=True)
                last = text
            code = _FINAL.get(w.rollout.state)
            if w.rollout.revision == w.generation and code is not None:
                return code
            if not args.watch:
                return EXIT_DONE
            if deadline is not None and time.monotonic() >= deadline:
                print(f"workload/{args.workload}: not done after {args.timeout:g}s", flush=True)
                return EXIT_TIMED_OUT
            await asyncio.sleep(POLL_SECONDS)


def cmd_status(args: argparse.Namespace) -> int:
    fmt = _format(args)
    if args.timeout < 0:
        raise UsageError("--timeout: must be >= 0")
    return asyncio.run(_status(args, fmt))


async def _history(args: argparse.Namespace, fmt: str) -> str:
    async with _client(args) as c:
        w = await c.get_workload(args.workload)
        revisions = await c.list_revisions(args.workload)
    return render_history(revisions, w.generation, fmt)


def cmd_history(args: argparse.Namespace) -> int:
    print(asyncio.run(_history(args, _format(args))))
    return 0


async def _undo(args: argparse.Namespace) -> None:
    async with _client(args) as c:
        try:
            w = await c.rollback(args.workload, args.to_revision, etag=args.etag)
        except Aborted:
            raise Aborted(
                f"workload/{args.workload} was changed since it was read; nothing was done:"
                f" re-read it (orka get workload {args.workload}) and try again"
            ) from None
    print(f"workload/{args.workload} rolling back: its spec is now revision {w.generation}")


def cmd_undo(args: argparse.Namespace) -> int:
    if args.to_revision < 0:
        raise UsageError("--to-revision: must be >= 0 (0: the revision before the current)")
    asyncio.run(_undo(args))
    return 0


_ACTIONS = {
    "pause": ("Pause", "paused"),
    "resume": ("Resume", "resumed"),
    "promote": ("Promote", "promoted"),
}


async def _action(args: argparse.Namespace) -> None:
    action, done = _ACTIONS[args.rollout_command]
    async with _client(args) as c:
        w = await c.rollout_action(action, args.workload)
    print(f"workload/{args.workload} rollout of revision {w.rollout.revision} {done}")


def cmd_action(args: argparse.Namespace) -> int:
    asyncio.run(_action(args))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser("rollout", help="follow and steer a workload's rolling update")
    verbs = top.add_subparsers(dest="rollout_command", metavar="VERB", required=True)

    p = verbs.add_parser(
        "status",
        help="follow the rollout until it is done (exit 0), fails or rolls back (1), or"
        " --timeout passes (2)",
    )
    p.add_argument("workload", metavar="WORKLOAD")
    add_flag(p, "--output", "-o", default="table", help="table, json or yaml", metavar="FORMAT")
    add_flag(p, "--timeout", type=float, default=0.0, metavar="S", help="0: wait for ever")
    p.add_argument("--no-watch", dest="watch", action="store_false", help="print the status once")
    add_client_flags(p)
    p.set_defaults(func=cmd_status)

    p = verbs.add_parser("history", help="the revisions kept (the newest 10)")
    p.add_argument("workload", metavar="WORKLOAD")
    add_flag(p, "--output", "-o", default="table", help="table, json or yaml", metavar="FORMAT")
    add_client_flags(p)
    p.set_defaults(func=cmd_history)

    p = verbs.add_parser("undo", help="roll back to the previous (or a given) revision")
    p.add_argument("workload", metavar="WORKLOAD")
    p.add_argument("--to-revision", type=int, default=0, metavar="N", help="0: the previous")
    p.add_argument("--etag", default="", help="act only if the workload still has this etag")
    add_client_flags(p)
    p.set_defaults(func=cmd_undo)

    helps = {
        "pause": "stop replacing instances until resumed",
        "resume": "go on with a paused (or retry a failed) rollout",
        "promote": "let a canary rollout replace the rest",
    }
    for name, text in helps.items():
        p = verbs.add_parser(name, help=text)
        p.add_argument("workload", metavar="WORKLOAD")
        add_client_flags(p)
        p.set_defaults(func=cmd_action)
