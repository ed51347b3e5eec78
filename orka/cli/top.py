"""`orka top nodes`: each node's CPU and memory in use and reserved, against what it offers.

Usage is what the node's agent measured at its last heartbeat (Node.usage); allocated is what
the instances bound to it requested (Node.allocated); both are shown against the node's
allocatable, as `kubectl top nodes` and `kubectl describe node` do.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from pydantic import BaseModel

from orka.cli import output
from orka.cli.client import AdminClient
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.cli.units import format_cpu, format_memory
from orka.models import Node, NodeState

SORT_KEYS = ("name", "cpu", "memory")


class NodeTop(BaseModel):
    """One row of `orka top nodes`, also its json/yaml shape."""

    name: str
    state: NodeState
    cpu_usage_millis: int
    cpu_allocated_millis: int
    cpu_allocatable_millis: int
    cpu_usage_percent: float | None  # None: the node offers no CPU (nothing to divide by)
    memory_usage_bytes: int
    memory_allocated_bytes: int
    memory_allocatable_bytes: int
    memory_usage_percent: float | None
    instances: int


def _percent(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 1) if whole > 0 else None


def top_of(n: Node) -> NodeTop:
    return NodeTop(
        name=n.name,
        state=n.state,
        cpu_usage_millis=n.usage.cpu_millis,
        cpu_allocated_millis=n.allocated.cpu_millis,
        cpu_allocatable_millis=n.allocatable.cpu_millis,
        cpu_usage_percent=_percent(n.usage.cpu_millis, n.allocatable.cpu_millis),
        memory_usage_bytes=n.usage.memory_bytes,
        memory_allocated_bytes=n.allocated.memory_bytes,
        memory_allocatable_bytes=n.allocatable.memory_bytes,
        memory_usage_percent=_percent(n.usage.memory_bytes, n.allocatable.memory_bytes),
        instances=n.instance_count,
    )


def rows(nodes: Sequence[Node], sort: str = "name") -> list[NodeTop]:
    tops = [top_of(n) for n in nodes]
    if sort == "cpu":
        tops.sort(key=lambda t: (-(t.cpu_usage_percent or 0.0), t.name))
    elif sort == "memory":
        tops.sort(key=lambda t: (-(t.memory_usage_percent or 0.0), t.name))
    else:
        tops.sort(key=lambda t: t.name)
    return tops


def _pct(value: float | None) -> str:
    return output.NONE if value is None else f"{value:.0f}%"


def table(tops: Sequence[NodeTop]) -> str:
    return output.table(
        (
            "NAME",
            "STATE",
            "CPU",
            "CPU%",
            "CPU-ALLOCATED",
            "MEMORY",
            "MEMORY%",
            "MEMORY-ALLOCATED",
            "INSTANCES",
        ),
        (
            (
                t.name,
                t.state.value,
                f"{format_cpu(t.cpu_usage_millis)}/{format_cpu(t.cpu_allocatable_millis)}",
                _pct(t.cpu_usage_percent),
                format_cpu(t.cpu_allocated_millis),
                f"{format_memory(t.memory_usage_bytes)}/"
                f"{format_memory(t.memory_allocatable_bytes)}",
                _pct(t.memory_usage_percent),
                format_memory(t.memory_allocated_bytes),
                t.instances,
            )
            for t in tops
        ),
    )


def render(nodes: Sequence[Node], fmt: str, sort: str = "name") -> str:
    tops = rows(nodes, sort)
    if fmt == "table":
        return table(tops) if tops else "No nodes found."
    return output.dump(tops, fmt)


async def _top(args: argparse.Namespace) -> str:
    address, certs = client_target(args)
    async with AdminClient(address, certs, identity=client_identity(args)) as c:
        nodes = await c.list_nodes()
    return render(nodes, args.output, args.sort)


def cmd_top(args: argparse.Namespace) -> int:
    if args.resource.lower() not in ("nodes", "node", "no"):
        raise UsageError(f"top: {args.resource!r}: only nodes have a top (orka top nodes)")
    if args.output not in output.FORMATS:
        raise UsageError(f"-o/--output: {args.output!r} is not one of {', '.join(output.FORMATS)}")
    if args.sort not in SORT_KEYS:
        raise UsageError(f"--sort: {args.sort!r} is not one of {', '.join(SORT_KEYS)}")
    print(asyncio.run(_top(args)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="show CPU and memory use per node")
    p.add_argument("resource", metavar="nodes")
    add_flag(p, "--output", "-o", default="table", help="table, json or yaml", metavar="FORMAT")
    add_flag(p, "--sort", default="name", metavar="|".join(SORT_KEYS), help="row order (name)")
    add_client_flags(p)
    p.set_defaults(func=cmd_top)
