"""get, describe, delete, cordon, uncordon, drain: reading and poking cluster objects."""

from __future__ import annotations

import argparse
import asyncio
import time

from orka.cli import output
from orka.cli.client import AdminClient
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.errors import Aborted, NotFound, OrkaError
from orka.models import InstancePhase

# Every accepted spelling -> the canonical resource.
ALIASES: dict[str, str] = {
    **dict.fromkeys(("workloads", "workload", "wl", "wls"), "workloads"),
    **dict.fromkeys(("instances", "instance", "inst", "insts"), "instances"),
    **dict.fromkeys(("nodes", "node", "no"), "nodes"),
    **dict.fromkeys(("endpoints", "endpoint", "ep"), "endpoints"),
}


def resource_kind(value: str) -> str:
    try:
        return ALIASES[value.lower()]
    except KeyError:
        raise UsageError(
            f"unknown resource {value!r}; use workloads (wl), instances (inst), nodes (no) or"
            " endpoints (ep)"
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
        if kind == "endpoints":
            eps = sorted(await c.list_endpoints(args.name), key=lambda e: e.instance)
            return output.dump(eps, fmt) if fmt != "table" else output.endpoints_table(eps)
        if args.name:
            n = await c.get_node(args.name)
            return output.dump(n, fmt) if fmt != "table" else output.nodes_table([n])
        nodes = sorted(await c.list_nodes(), key=lambda n: n.name)
        return output.dump(nodes, fmt) if fmt != "table" else output.nodes_table(nodes)


def cmd_get(args: argparse.Namespace) -> int:
    # Usage errors before any connection attempt.
    if resource_kind(args.resource) == "endpoints" and not args.name:
        raise UsageError("get endpoints: name the workload (orka get endpoints WORKLOAD)")
    if args.output not in output.FORMATS:
        raise UsageError(f"-o/--output: {args.output!r} is not one of {', '.join(output.FORMATS)}")
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
    async with _client(args) as c:
        if kind == "workloads":
            w = await c.get_workload(args.name)
            insts = sorted(await c.list_instances(workload=args.name), key=lambda i: i.name)
            return output.describe_workload(w, insts)
        if kind == "instances":
            return output.describe_instance(await c.get_instance(args.name))
        n = await c.get_node(args.name)
        insts = sorted(await c.list_instances(node=args.name), key=lambda i: i.name)
        return output.describe_node(n, insts)


def cmd_describe(args: argparse.Namespace) -> int:
    if resource_kind(args.resource) == "endpoints":
        raise UsageError("describe: endpoints are listed, not described (orka get endpoints W)")
    print(asyncio.run(_describe(args)))
    return 0


# ---- delete ----


async def _delete(args: argparse.Namespace) -> None:
    async with _client(args) as c:
        try:
            await c.delete_workload(args.name, etag=args.etag)
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
    if resource_kind(args.resource) != "workloads":
        raise UsageError("delete: only workloads can be deleted (nodes leave on SIGTERM or drain)")
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
    resources = "workloads|instances|nodes|endpoints"
    p = sub.add_parser("get", help="list workloads, instances, nodes or a workload's endpoints")
    p.add_argument("resource", metavar=resources, help="also wl, inst, no, or singular")
    p.add_argument("name", nargs="?", help="one object by name")
    add_flag(p, "--output", "-o", default="table", help="table, json or yaml", metavar="FORMAT")
    add_flag(p, "--workload", metavar="W", help="instances of this workload only")
    add_flag(p, "--node", metavar="N", help="instances on this node only")
    add_flag(p, "--phase", metavar="PHASE", help="instances in this phase only")
    add_client_flags(p)
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("describe", help="show one workload, instance or node in detail")
    p.add_argument("resource", metavar="workload|instance|node")
    p.add_argument("name")
    add_client_flags(p)
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("delete", help="delete a workload (its instances are stopped)")
    p.add_argument("resource", metavar="workload")
    p.add_argument("name")
    add_flag(p, "--wait", action="store_true", help="wait until the workload is gone")
    add_flag(p, "--timeout", type=float, default=120.0, metavar="S", help="for --wait")
    _etag_flag(p, "workload")
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
