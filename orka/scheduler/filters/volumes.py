"""The volumes an instance uses must be usable on the node: a bound volume pins the instance to
the node its data lives on; an unbound one needs a node of its pool offering its backend, with
room for it."""

from __future__ import annotations

from orka import fit
from orka.api import agent_pb2 as apb
from orka.errors import Invalid
from orka.models import DEFAULT_POOL, VOLUME_BACKENDS, check_name
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class VolumesFilter:
    __slots__ = ()
    name: str = "volumes"
    # Pool, backends and volume space are not in the index's buckets: every node is asked.
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.volumes)

    def applies(self, req: PlacementRequest) -> bool:
        # Most requests use no volume: they never pay for this.
        return bool(req.volumes)


# A bound on what an agent may list (duplicates are harmless: the set is kept).
MAX_BACKENDS = 8


def volume_offer(info: apb.NodeInfo) -> tuple[str, frozenset[str], int]:
    """What a registering node offers for volumes (its pool, backends, volume space), checked
    like any input from outside: an agent names only backends this version knows."""
    try:
        pool = check_name(info.pool, "register: node.pool") if info.pool else DEFAULT_POOL
    except ValueError as err:
        raise Invalid(str(err)) from None
    if len(info.volume_backends) > MAX_BACKENDS:
        raise Invalid(f"register: node.volume_backends: at most {MAX_BACKENDS}")
    for i, b in enumerate(info.volume_backends):
        if b not in VOLUME_BACKENDS:
            raise Invalid(
                f"register: node.volume_backends[{i}]: {b[:32]!r} is not one of"
                f" {', '.join(VOLUME_BACKENDS)}"
            )
    if info.volume_capacity_bytes < 0:
        raise Invalid("register: node.volume_capacity_bytes must not be negative")
    return pool, frozenset(info.volume_backends), info.volume_capacity_bytes
