"""`orka apply -f FILE`: create or update workloads from a manifest, optionally wait for them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import dataclass, field
from typing import TextIO

from orka.cli import volumes as volume_docs
from orka.cli.classes import apply_class
from orka.cli.client import AdminClient, WatchedChange
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.cli.manifest import Manifest, load_manifests
from orka.errors import Aborted, AlreadyExists, NotFound, OutOfRange
from orka.models import (
    Class,
    Instance,
    InstancePhase,
    RestartPolicy,
    RolloutState,
    VolumeSpec,
    Workload,
    WorkloadSpec,
)

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


# Exit codes of `apply --wait` a script can rely on (orka/cli/main.py has the rest): 0 every
# workload runs all its replicas, healthy; 1 one cannot get there (a replica FAILED under
# restart policy NEVER, no node can ever take a replica, the workload was deleted), or any
# other failed operation; 2 the timeout passed first. 2 is also argparse's usage error (a bad
# flag): both mean "nothing went wrong with the workloads", and a usage error is refused
# before anything is applied.
EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_TIMED_OUT = 2


@dataclass
class Progress:
    """One workload as `apply --wait` follows it: its record, and its current instances."""

    workload: Workload
    instances: dict[str, Instance] = field(default_factory=dict)
    revisions: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    deleted: bool = False

    @property
    def name(self) -> str:
        return self.workload.name

    def line(self) -> str:
        w, st = self.workload, self.workload.status
        text = (
            f"workload/{self.name}: desired {w.spec.replicas}, placed {st.placed},"
            f" running {st.running}, healthy {st.healthy}"
        )
        failure = self.failure()
        if failure:
            return f"{text}: failed: {failure}"
        if self.ready():
            return f"{text}: ready"
        if st.unschedulable_reasons:
            text += f" (unschedulable: {st.unschedulable_reasons[0]})"
        elif w.rollout.state is not RolloutState.COMPLETE:
            text += f" (rollout {w.rollout.state.value.lower().replace('_', ' ')})"
        return text

    def ready(self) -> bool:
        w, st = self.workload, self.workload.status
        want = w.spec.replicas
        return (
            not self.deleted
            and st.running >= want
            and st.healthy >= want
            and st.placed <= want
            and not w.deleting
            # Old instances may all run and be healthy while a new revision rolls out.
            and w.rollout.state is RolloutState.COMPLETE
            and w.rollout.revision == w.generation
        )

    def failure(self) -> str:
        """Why this workload cannot get ready without someone changing it; "" if it can."""
        w = self.workload
        if self.deleted or w.deleting:
            return "the workload was deleted"
        if w.spec.restart_policy is RestartPolicy.NEVER:
            for i in sorted(self.instances.values(), key=lambda i: i.name):
                if (
                    i.phase is InstancePhase.FAILED
                    and i.generation == w.generation
                    and not i.desired_stop
                ):
                    code = "" if i.exit_code is None else f" with exit code {i.exit_code}"
                    return f"instance {i.name} failed{code} and restart policy is NEVER"
        r = w.rollout
        if r.rollback_of and r.state in (RolloutState.PROGRESSING, RolloutState.ROLLED_BACK):
            # The rollback's revision says why (its cause names the failure).
            cause = next((v.cause for v in w.revisions if v.revision == r.revision), "")
            why = f" ({cause})" if cause else ""
            return f"revision {r.rollback_of} failed and is being rolled back{why}"
        if r.state is RolloutState.FAILED:
            why = f": {r.message}" if r.message else ""
            return f"the rollout of revision {r.revision} failed{why}"
        if w.status.unschedulable_unresolvable:
            why = "; ".join(w.status.unschedulable_reasons) or "no node can take it"
            return f"no node can ever take a replica as specified: {why}"
        return ""


class ProgressView:
    """Progress lines: on a terminal redrawn in place (one line per workload), piped one
    plain line each time a workload's line changes (so a log reads as a history)."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.shown: dict[str, str] = {}
        self._drawn = 0

    def show(self, items: list[Progress]) -> None:
        lines = {p.name: p.line() for p in items}
        if lines == self.shown:
            return
        if self.tty:
            # Up to the first line drawn, then each line rewritten and cleared to its end.
            up = f"\x1b[{self._drawn}F" if self._drawn else ""
            body = "".join(f"\x1b[2K{text}\n" for text in lines.values())
            self.out.write(up + body)
            self._drawn = len(lines)
        else:
            for name, text in lines.items():
                if self.shown.get(name) != text:
                    self.out.write(text + "\n")
        self.out.flush()
        self.shown = lines


async def _list(client: AdminClient, names: list[str]) -> tuple[dict[str, Progress], int]:
    """The workloads and their instances, and the revision to watch from (the lowest of the
    listings': events a later listing already holds are skipped by revision)."""
    listed, since = await client.list_at("workloads")
    by_name = {o.name: (r, o) for r, o in listed if isinstance(o, Workload)}
    out: dict[str, Progress] = {}
    for name in names:
        if name not in by_name:
            raise NotFound(f"workload/{name} not found (deleted meanwhile?)")
        r, w = by_name[name]
        p = out[name] = Progress(w, revision=r)
        insts, rev = await client.list_at("instances", workload=name)
        since = min(since, rev)
        for ri, i in insts:
            assert isinstance(i, Instance)
            p.instances[i.name], p.revisions[i.name] = i, ri
    return out, since


def _apply_change(items: dict[str, Progress], change: WatchedChange) -> bool:
    """Apply one watched change; True when it changed what is followed."""
    obj = change.obj
    if isinstance(obj, Workload):
        p = items.get(obj.name)
        if p is None or p.revision >= change.revision:
            return False
        p.revision = change.revision
        if change.type == "DELETED":
            p.deleted = True
        else:
            p.workload = obj
        return True
    if isinstance(obj, Instance):
        p = items.get(obj.workload)
        if p is None or p.revisions.get(obj.name, 0) >= change.revision:
            return False
        p.revisions[obj.name] = change.revision
        if change.type == "DELETED":
            p.instances.pop(obj.name, None)
        else:
            p.instances[obj.name] = obj
        return True
    return False


def _verdict(items: dict[str, Progress], view: ProgressView) -> int | None:
    view.show(list(items.values()))
    if any(p.failure() for p in items.values()):
        return EXIT_FAILED
    if all(p.ready() for p in items.values()):
        return EXIT_DONE
    return None


async def follow(
    client: AdminClient, names: list[str], view: ProgressView
) -> tuple[int, list[Progress]]:
    """Follow the workloads (list, then watch from the list's revision) until every one is
    ready (EXIT_DONE) or one cannot get there (EXIT_FAILED). No timeout here: the caller's.
    One stream for the whole wait; listed again only when it ends or falls too far behind."""
    watch_one = names[0] if len(names) == 1 else ""
    while True:
        items, since = await _list(client, names)
        code = _verdict(items, view)
        if code is not None:
            return code, list(items.values())
        try:
            async with contextlib.aclosing(client.watch(since, workload=watch_one)) as changes:
                async for change in changes:
                    if _apply_change(items, change):
                        code = _verdict(items, view)
                        if code is not None:
                            return code, list(items.values())
        except OutOfRange:
            pass  # fell too far behind: list again
        # Else the stream ended (a new leader): list again too.


def _not_ready_message(items: list[Progress], timeout: float) -> str:
    lines = [f"error: timed out after {timeout:g}s waiting for:"]
    for p in items:
        if p.ready():
            continue
        w = p.workload
        lines.append(
            f"  workload/{w.name}: {w.status.running}/{w.spec.replicas} running, "
            f"{w.status.placed} placed, {w.status.healthy} healthy"
        )
        for reason in w.status.unschedulable_reasons:
            lines.append(f"    unschedulable: {reason}")
        if w.status.message:
            lines.append(f"    {w.status.message}")
    lines.append("(see `orka describe workload NAME`)")
    return "\n".join(lines)


async def _apply(args: argparse.Namespace, docs: list[Manifest]) -> int:
    # Classes first: the workloads of the same file may name them.
    specs = [d for d in docs if isinstance(d, WorkloadSpec)]
    address, certs = client_target(args)
    async with AdminClient(address, certs, identity=client_identity(args)) as client:
        for c in [d for d in docs if isinstance(d, Class)]:
            print(f"class/{c.name} {await apply_class(client, c)}", flush=True)
        # Volumes next: the workloads that use them are placed at once.
        for v in [d for d in docs if isinstance(d, VolumeSpec)]:
            print(f"volume/{v.name} {await volume_docs.apply_volume(client, v)}", flush=True)
        for spec in specs:
            verb = await apply_one(client, spec, etag=args.etag)
            print(f"workload/{spec.name} {verb}", flush=True)
        if not args.wait or not specs:
            return EXIT_DONE
        view = ProgressView(sys.stdout, sys.stdout.isatty())
        names = [s.name for s in specs]
        try:
            async with asyncio.timeout(args.timeout):
                code, items = await follow(client, names, view)
        except TimeoutError:
            items = list((await _list(client, names))[0].values())
            print(_not_ready_message(items, args.timeout), file=sys.stderr)
            return EXIT_TIMED_OUT
    if code == EXIT_FAILED:
        for p in items:
            if p.failure():
                print(f"error: workload/{p.name}: {p.failure()}", file=sys.stderr)
        print("(see `orka describe workload NAME`)", file=sys.stderr)
        return EXIT_FAILED
    for p in items:
        st = p.workload.status
        print(f"workload/{p.name} ready: {st.running}/{p.workload.spec.replicas} running")
    return EXIT_DONE


def cmd_apply(args: argparse.Namespace) -> int:
    if not args.file:
        raise UsageError("-f/--file: a manifest file is required (or - for stdin)")
    if args.timeout <= 0:
        raise UsageError("--timeout: must be > 0")
    # Parse every document before sending anything, so a typo in the last one changes nothing.
    specs = load_manifests(args.file)
    if args.etag and (len(specs) != 1 or not isinstance(specs[0], WorkloadSpec)):
        raise UsageError(f"--etag: {args.file} holds {len(specs)} workloads; it takes one")
    return asyncio.run(_apply(args, specs))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("apply", help="create or update workloads from a YAML manifest")
    add_flag(p, "--file", "-f", metavar="FILE", help="YAML manifest, - for stdin")
    add_flag(
        p,
        "--wait",
        action="store_true",
        help="follow progress until every replica runs healthy: exit 0 done, 1 failed, 2 timed out",
    )
    add_flag(p, "--timeout", type=float, default=120.0, metavar="S", help="for --wait (120)")
    # Not from the environment: an etag belongs to one object as read at one time.
    p.add_argument(
        "--etag",
        default="",
        help="apply only if the workload still has this etag (as `orka get -o yaml` shows it)",
    )
    add_client_flags(p)
    p.set_defaults(func=cmd_apply)
