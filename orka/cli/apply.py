"""`orka apply -f FILE`: create or update workloads from a manifest, optionally wait for them."""

from __future__ import annotations

import argparse
import asyncio
import time

from orka.cli.client import AdminClient
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.cli.manifest import load_manifests
from orka.errors import Aborted, AlreadyExists, NotFound, OrkaError
from orka.models import Workload, WorkloadSpec

POLL_SECONDS = 0.5


REREAD = "nothing was applied; re-read it (orka get workload {name}) and apply again"


async def apply_one(client: AdminClient, spec: WorkloadSpec, etag: str = "") -> str:
    """Create if absent, else update; returns the verb to print.

    The update carries the etag read here (or `etag`, what the caller read earlier), so a
    change someone made in between fails the update instead of being silently overwritten;
    likewise two creates racing: the second gets ALREADY_EXISTS.
    """
    try:
        try:
            current = await client.get_workload(spec.name)
        except NotFound:
            if etag:
                raise Aborted("deleted since it was read") from None
            try:
                await client.create_workload(spec)
            except AlreadyExists:
                raise AlreadyExists(
                    f"workload/{spec.name} was created by someone else meanwhile; "
                    + REREAD.format(name=spec.name)
                ) from None
            return "created"
        if etag and etag != current.etag:
            raise Aborted("changed since it was read")
        if current.spec == spec:
            # An identical update could still start a rolling replacement on some
            # controllers; re-applying an unchanged file must be a no-op.
            return "unchanged"
        # With secret_env the specs always differ here (the controller shows "<redacted>");
        # only it can tell whether anything changed, and it leaves an unchanged workload as is.
        after = await client.update_workload(spec, etag=etag or current.etag)
    except Aborted:
        # The controller's own words are not shown: whatever it said, the advice is the same.
        raise Aborted(
            f"workload/{spec.name} was changed by someone else since it was read; "
            + REREAD.format(name=spec.name)
        ) from None
    return "configured" if after.etag != current.etag else "unchanged"


def _ready(w: Workload) -> bool:
    return w.status.running >= w.spec.replicas and w.status.placed <= w.spec.replicas


async def wait_ready(client: AdminClient, names: list[str], timeout: float) -> list[Workload]:
    """Poll until every workload runs all its replicas; returns the ones that did not."""
    deadline = time.monotonic() + timeout
    pending = list(names)
    latest: dict[str, Workload] = {}
    while pending:
        still: list[str] = []
        for name in pending:
            w = await client.get_workload(name)
            latest[name] = w
            if _ready(w):
                print(f"workload/{name} ready: {w.status.running}/{w.spec.replicas} running")
            else:
                still.append(name)
        pending = still
        if not pending or time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    return [latest[n] for n in pending]


def _not_ready_message(items: list[Workload], timeout: float) -> str:
    lines = [f"timed out after {timeout:g}s waiting for:"]
    for w in items:
        lines.append(
            f"  workload/{w.name}: {w.status.running}/{w.spec.replicas} running, "
            f"{w.status.placed} placed"
        )
        for reason in w.status.unschedulable_reasons:
            lines.append(f"    unschedulable: {reason}")
        if w.status.message:
            lines.append(f"    {w.status.message}")
    lines.append("(see `orka describe workload NAME`)")
    return "\n".join(lines)


async def _apply(args: argparse.Namespace, specs: list[WorkloadSpec]) -> int:
    address, certs = client_target(args)
    async with AdminClient(address, certs, identity=client_identity(args)) as client:
        for spec in specs:
            verb = await apply_one(client, spec, etag=args.etag)
            print(f"workload/{spec.name} {verb}")
        if not args.wait:
            return 0
        missing = await wait_ready(client, [s.name for s in specs], args.timeout)
    if missing:
        raise OrkaError(_not_ready_message(missing, args.timeout))
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    if not args.file:
        raise UsageError("-f/--file: a manifest file is required (or - for stdin)")
    if args.timeout <= 0:
        raise UsageError("--timeout: must be > 0")
    # Parse every document before sending anything, so a typo in the last one changes nothing.
    specs = load_manifests(args.file)
    if args.etag and len(specs) != 1:
        raise UsageError(f"--etag: {args.file} holds {len(specs)} workloads; it takes one")
    return asyncio.run(_apply(args, specs))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("apply", help="create or update workloads from a YAML manifest")
    add_flag(p, "--file", "-f", metavar="FILE", help="YAML manifest, - for stdin")
    add_flag(p, "--wait", action="store_true", help="wait until every replica runs")
    add_flag(p, "--timeout", type=float, default=120.0, metavar="S", help="for --wait (120)")
    # Not from the environment: an etag belongs to one object as read at one time.
    p.add_argument(
        "--etag",
        default="",
        help="apply only if the workload still has this etag (as `orka get -o yaml` shows it)",
    )
    add_client_flags(p)
    p.set_defaults(func=cmd_apply)
