"""get, describe, delete, cordon, uncordon, drain: reading and poking cluster objects."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from orka.cli import classes, output
from orka.cli import volumes as volume_cli
from orka.cli.client import AdminClient, Change, WatchedChange
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.errors import Aborted, NotFound, OrkaError, OutOfRange
from orka.models import Instance, InstancePhase, VolumeState

# Every accepted spelling -> the canonical resource.
ALIASES: dict[str, str] = {
    **dict.fromkeys(("workloads", "workload", "wl", "wls"), "workloads"),
    **dict.fromkeys(("instances", "instance", "inst", "insts"), "instances"),
    **dict.fromkeys(("nodes", "node", "no"), "nodes"),
    **dict.fromkeys(("endpoints", "endpoint", "ep"), "endpoints"),
    **dict.fromkeys(("classes", "class"), "classes"),
    **dict.fromkeys(("pools", "pool"), "pools"),
    **dict.fromkeys(("volumes", "volume", "vol", "vols"), "volumes"),
}


def resource_kind(value: str) -> str:
    try:
        return ALIASES[value.lower()]
    except KeyError:
        raise UsageError(
            f"unknown resource {value!r}; use workloads (wl), instances (inst), nodes (no),"
            " endpoints (ep), classes, pools or volumes (vol)"
        ) from None


def _client(args: argparse.Namespace) -> AdminClient:
    address, certs = client_target(args)
    return AdminClient(address, certs, identity=client_identity(args))


def _phase(value: str | None) -> InstancePhase | None:
    if not value:
        return None
    try:
        return InstancePhase(value.strip().upper())
    except ValueError:
        names = ", ".join(p.value for p in InstancePhase)
        raise UsageError(f"--phase: {value!r} is not one of {names}") from None


# ---- get ----


async def _get(args: argparse.Namespace) -> str:
    kind = resource_kind(args.resource)
    fmt = args.output
    async with _client(args) as c:
        if kind in ("classes", "pools"):
            return await classes.get_text(c, kind, args.name, fmt)
        if kind == "workloads":
            if args.name:
                w = await c.get_workload(args.name)
                return output.dump(w, fmt) if fmt != "table" else output.workloads_table([w])
            ws = sorted(await c.list_workloads(), key=lambda w: w.name)
            return output.dump(ws, fmt) if fmt != "table" else output.workloads_table(ws)
        if kind == "instances":
            if args.name:
                i = await c.get_instance(args.name)
                return output.dump(i, fmt) if fmt != "table" else output.instances_table([i])
            items = await c.list_instances(
                workload=args.workload or "", node=args.node or "", phase=_phase(args.phase)
            )
            items.sort(key=lambda i: (i.workload, i.name))
            return output.dump(items, fmt) if fmt != "table" else output.instances_table(items)
        if kind == "volumes":
            return await volume_cli.get(
                c, args.name or "", fmt, node=args.node or "", workload=args.workload or ""
            )
        if kind == "endpoints":
            eps = sorted(await c.list_endpoints(args.name), key=lambda e: e.instance)
            return output.dump(eps, fmt) if fmt != "table" else output.endpoints_table(eps)
        if args.name:
            n = await c.get_node(args.name)
            return output.dump(n, fmt) if fmt != "table" else output.nodes_table([n])
        nodes = sorted(await c.list_nodes(), key=lambda n: n.name)
        return output.dump(nodes, fmt) if fmt != "table" else output.nodes_table(nodes)


# ---- get -w ----


def _wanted(args: argparse.Namespace, kind: str, phase: InstancePhase | None, obj: Change) -> bool:
    """Whether a watched object is one `get` would list with these filters."""
    if args.name and obj.name != args.name:
        return False
    if kind == "instances" and isinstance(obj, Instance):
        return (
            (not args.workload or obj.workload == args.workload)
            and (not args.node or obj.node == args.node)
            and (phase is None or obj.phase is phase)
        )
    return True


def _emit(text: str) -> None:
    # Flushed per change: a pipe would otherwise hold the rows back until 4 KiB piled up.
    print(text, flush=True)


async def _watch(args: argparse.Namespace) -> None:
    """List, print, then WatchEvents from the list's revision, printing each change once.

    Each object's revision is kept, and an event applies only when it is newer than the copy
    held (the rule of proto/controller.proto), so an event a later page already showed is not
    printed twice. A revision the controller no longer holds (OutOfRange, "list again") lists
    again and goes on from the new list's revision; objects that changed meanwhile are printed
    again, those that were deleted meanwhile are printed as deleted.
    """
    kind = resource_kind(args.resource)
    phase = _phase(args.phase)
    printer = output.WatchPrinter(kind, args.output, events=args.output_watch_events)
    # Server side, the watch narrows to one workload when `get` does.
    workload = args.workload if kind == "instances" else ""
    if kind == "workloads" and args.name:
        workload = args.name
    held: dict[str, tuple[int, Change]] = {}
    first = True
    async with _client(args) as c:
        while True:
            items, revision = await c.list_at(
                kind, workload=args.workload or "", node=args.node or "", phase=phase
            )
            items = sorted(
                ((r, o) for r, o in items if _wanted(args, kind, phase, o)),
                key=lambda ro: _sort_key(ro[1]),
            )
            if first:
                text = printer.listed([o for _, o in items])
                if text:  # json/yaml of an empty listing: nothing, not an empty line
                    _emit(text)
                first = False
            else:
                _relisted(printer, held, items)
            held = {o.name: (r, o) for r, o in items}
            try:
                async with contextlib.aclosing(c.watch(revision, workload=workload)) as changes:
                    async for change in changes:
                        _apply(args, kind, phase, printer, held, change)
            except OutOfRange:
                continue  # list again, watch from there
            # The stream ended without an error (the controller stopping): watch again.


def _sort_key(obj: Change) -> tuple[str, str]:
    return (obj.workload, obj.name) if isinstance(obj, Instance) else ("", obj.name)


def _apply(
    args: argparse.Namespace,
    kind: str,
    phase: InstancePhase | None,
    printer: output.WatchPrinter,
    held: dict[str, tuple[int, Change]],
    change: WatchedChange,
) -> None:
    if change.kind + "s" != kind:
        return
    obj = change.obj
    have = held.get(obj.name)
    if have is not None and have[0] >= change.revision:
        return  # a later page of the list already showed it
    if change.type == "DELETED" or not _wanted(args, kind, phase, obj):
        # An object that left the filter (an instance no longer in --phase) is gone from
        # the listing, as kubectl's field selectors report it.
        if held.pop(obj.name, None) is not None:
            _emit(printer.change(obj, "DELETED"))
        return
    held[obj.name] = (change.revision, obj)
    _emit(printer.change(obj, "ADDED" if have is None else change.type))


def _relisted(
    printer: output.WatchPrinter,
    held: dict[str, tuple[int, Change]],
    items: list[tuple[int, Change]],
) -> None:
    fresh = {o.name for _, o in items}
    for name, (_, old) in held.items():
        if name not in fresh:
            _emit(printer.change(old, "DELETED"))
    for r, o in items:
        have = held.get(o.name)
        if have is None or have[0] < r:
            _emit(printer.change(o, "ADDED" if have is None else "MODIFIED"))


def cmd_get(args: argparse.Namespace) -> int:
    # Usage errors before any connection attempt.
    if args.watch and resource_kind(args.resource) in ("classes", "pools", "volumes"):
        raise UsageError(f"get -w: {resource_kind(args.resource)} cannot be watched")
    if args.watch and resource_kind(args.resource) == "endpoints":
        raise UsageError("get -w: endpoints cannot be watched; watch instances --workload W")
    if resource_kind(args.resource) == "endpoints" and not args.name:
        raise UsageError("get endpoints: name the workload (orka get endpoints WORKLOAD)")
    if args.output not in output.FORMATS:
        raise UsageError(f"-o/--output: {args.output!r} is not one of {', '.join(output.FORMATS)}")
    if args.output_watch_events and not args.watch:
        raise UsageError("--output-watch-events: only with -w/--watch")
    if args.watch:
        try:
            asyncio.run(_watch(args))
        except KeyboardInterrupt:
            sys.stdout.flush()
            raise
        return 0
    text = asyncio.run(_get(args))
    if args.output == "table" and text.count("\n") == 0:
        # Only the header row: say so, like kubectl, instead of printing a bare header.
        print(f"No {resource_kind(args.resource)} found.")
    else:
        print(text)
    return 0


# ---- describe ----


async def _describe(args: argparse.Namespace) -> str:
    kind = resource_kind(args.resource)
    fmt = args.output
    async with _client(args) as c:
        if kind == "volumes":
            vol = await c.get_volume(args.name)
            return volume_cli.describe(vol) if fmt == "table" else output.dump(vol, fmt)
        obj: Change
        if kind == "workloads":
            obj = await c.get_workload(args.name)
        elif kind == "instances":
            obj = await c.get_instance(args.name)
        else:
            obj = await c.get_node(args.name)
        activities = await c.list_activities(kind.removesuffix("s"), args.name)
        if fmt != "table":
            return output.describe_document(obj, activities, fmt)
        if isinstance(obj, Instance):
            text = output.describe_instance(obj)
        else:
            kw = {"workload": args.name} if kind == "workloads" else {"node": args.name}
            insts = sorted(await c.list_instances(**kw), key=lambda i: i.name)
            if kind == "workloads":
                text = output.describe_workload(obj, insts)  # type: ignore[arg-type]
            else:
                text = output.describe_node(obj, insts)  # type: ignore[arg-type]
        return text + "\n" + output.activity_section(activities)


def cmd_describe(args: argparse.Namespace) -> int:
    if resource_kind(args.resource) in ("classes", "pools"):
        raise UsageError("describe: classes and pools are shown by orka get class|pool NAME")
    if resource_kind(args.resource) == "endpoints":
        raise UsageError("describe: endpoints are listed, not described (orka get endpoints W)")
    if args.output not in output.FORMATS:
        raise UsageError(f"-o/--output: {args.output!r} is not one of {', '.join(output.FORMATS)}")
    print(asyncio.run(_describe(args)))
    return 0


# ---- delete ----


async def _delete_volume(args: argparse.Namespace) -> None:
    async with _client(args) as c:
        try:
            vol = await c.delete_volume(args.name, etag=args.etag)
        except Aborted:
            raise Aborted(
                f"volume/{args.name} was changed since it was read; nothing was deleted:"
                f" re-read it (orka get volume {args.name}) and try again"
            ) from None
        if vol.state is not VolumeState.DELETING:
            print(f"volume/{args.name} deleted")
            return
        if not args.wait:
            print(f"volume/{args.name} deleting (on node {vol.node})")
            return
        print(f"volume/{args.name} deleting; waiting for node {vol.node} to delete it")
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                vol = await c.get_volume(args.name)
            except NotFound:
                print(f"volume/{args.name} deleted")
                return
            if time.monotonic() >= deadline:
                why = f": {vol.message}" if vol.message else ""
                raise OrkaError(
                    f"volume/{args.name} still exists after {args.timeout:g}s"
                    f" ({vol.state.value}{why})"
                )
            await asyncio.sleep(0.5)


async def _delete(args: argparse.Namespace) -> None:
    if resource_kind(args.resource) == "volumes":
        return await _delete_volume(args)
    async with _client(args) as c:
        if resource_kind(args.resource) == "classes":
            await classes.delete_class(c, args.name, etag=args.etag)
            print(f"class/{args.name} deleted")
            return
        try:
            await c.delete_workload(args.name, etag=args.etag, with_volumes=args.with_volumes)
        except Aborted:
            raise Aborted(
                f"workload/{args.name} was changed since it was read; nothing was deleted:"
                f" re-read it (orka get workload {args.name}) and try again"
            ) from None
        if not args.wait:
            print(f"workload/{args.name} deleted")
            return
        print(f"workload/{args.name} deleting; waiting for its instances to stop")
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                w = await c.get_workload(args.name)
            except NotFound:
                print(f"workload/{args.name} deleted")
                return
            if time.monotonic() >= deadline:
                raise OrkaError(
                    f"workload/{args.name} still exists after {args.timeout:g}s "
                    f"({w.status.placed} placed, {w.status.running} running)"
                )
            await asyncio.sleep(0.5)


def cmd_delete(args: argparse.Namespace) -> int:
    kind = resource_kind(args.resource)
    if kind not in ("workloads", "volumes", "classes"):
        raise UsageError(
            "delete: only workloads, volumes and classes can be deleted (nodes leave on SIGTERM"
            " or drain)"
        )
    if args.with_volumes and kind != "workloads":
        raise UsageError("--with-volumes: only when deleting a workload")
    if args.timeout <= 0:
        raise UsageError("--timeout: must be > 0")
    asyncio.run(_delete(args))
    return 0


# ---- cordon / uncordon / drain ----

_NODE_ACTIONS = {
    "cordon": ("cordon", "cordoned"),
    "uncordon": ("uncordon", "uncordoned"),
    "drain": ("drain", "draining (its instances are being replaced on other nodes)"),
}


async def _node_action(args: argparse.Namespace) -> None:
    method, done = _NODE_ACTIONS[args.command]
    async with _client(args) as c:
        try:
            await getattr(c, method)(args.node, etag=args.etag)
        except Aborted:
            raise Aborted(
                f"node/{args.node} was changed since it was read; nothing was done:"
                f" re-read it (orka get node {args.node}) and try again"
            ) from None
    print(f"node/{args.node} {done}")


def cmd_node_action(args: argparse.Namespace) -> int:
    asyncio.run(_node_action(args))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    resources = "workloads|instances|nodes|endpoints|classes|pools|volumes"
    p = sub.add_parser("get", help="list workloads, instances, nodes or a workload's endpoints")
    p.add_argument("resource", metavar=resources, help="also wl, inst, no, or singular")
    p.add_argument("name", nargs="?", help="one object by name")
    add_flag(p, "--output", "-o", default="table", help="table, json or yaml", metavar="FORMAT")
    add_flag(
        p, "--workload", metavar="W", help="instances (or template volumes) of this workload only"
    )
    add_flag(p, "--node", metavar="N", help="instances (or volumes) on this node only")
    add_flag(p, "--phase", metavar="PHASE", help="instances in this phase only")
    # Not from the environment: a watch that never ends must be asked for each time.
    p.add_argument(
        "--watch",
        "-w",
        action="store_true",
        help="after listing, print each change as it happens, until Ctrl-C",
    )
    p.add_argument(
        "--output-watch-events",
        action="store_true",
        help="with -w: an EVENT column (ADDED, MODIFIED, DELETED); json/yaml: {type, object}",
    )
    add_client_flags(p)
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("describe", help="show one workload, instance or node in detail")
    p.add_argument("resource", metavar="workload|instance|node|volume")
    p.add_argument("name")
    add_flag(
        p,
        "--output",
        "-o",
        default="table",
        metavar="FORMAT",
        help="table (text), json or yaml (the object with its recent activity)",
    )
    add_client_flags(p)
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser(
        "delete",
        help="delete a workload (its instances are stopped), a volume (its data) or a class",
    )
    p.add_argument("resource", metavar="workload|volume|class")
    p.add_argument("name")
    add_flag(p, "--wait", action="store_true", help="wait until it is gone")
    add_flag(p, "--timeout", type=float, default=120.0, metavar="S", help="for --wait")
    # Not from the environment: deleting data must be asked for each time.
    p.add_argument(
        "--with-volumes",
        action="store_true",
        help="a workload's volumes too (its template's, and those no other workload names);"
        " without it every volume and its data is kept",
    )
    _etag_flag(p, "workload, volume or class")
    add_client_flags(p)
    p.set_defaults(func=cmd_delete)

    helps = {
        "cordon": "stop new placements on a node",
        "uncordon": "allow placements on a node again",
        "drain": "cordon a node and move its instances elsewhere",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("node", metavar="NODE")
        _etag_flag(p, "node")
        add_client_flags(p)
        p.set_defaults(func=cmd_node_action)


def _etag_flag(p: argparse.ArgumentParser, what: str) -> None:
    # Not from the environment: an etag belongs to one object as read at one time.
    p.add_argument("--etag", default="", help=f"act only if the {what} still has this etag")
