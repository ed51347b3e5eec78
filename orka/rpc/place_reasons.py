"""PlaceResult and its structured reasons, to and from the wire: the one converter each way."""

from __future__ import annotations

from collections.abc import Mapping

from orka import fit
from orka.api import agent_pb2 as apb

# An instance's reasons come from at most one line per distinct reason; more than this many
# from a scheduler would be a fault, and the controller stores what it keeps in messages.
MAX_REASONS = 64
_MAX_TEXT = 512


def place_result_to_pb(
    instance: str,
    node: str = "",
    refusals: Mapping[str, fit.Reason] | None = None,
    rejections: Mapping[fit.Reason, int] | None = None,
    passed_over: Mapping[fit.Reason, int] | None = None,
) -> apb.PlaceResult:
    """The outcome of placing one instance: the node that took it, or why none did; with a
    node, `passed_over` says why the filters left the others out (when it was counted)."""
    if not refusals and not rejections and not passed_over:
        # Most results: the first offer was taken (one per instance, thousands per second).
        return apb.PlaceResult(instance=instance, node=node)
    msg = apb.PlaceResult(
        instance=instance,
        node=node,
        refusals={name: r.message for name, r in (refusals or {}).items()},
    )
    for c in fit.count_reasons(rejections or {}):
        msg.reasons.add(
            code=c.code, message=c.message, node_count=c.node_count, resolvable=c.resolvable
        )
    for c in fit.count_reasons(passed_over or {}):
        msg.passed_over.add(
            code=c.code, message=c.message, node_count=c.node_count, resolvable=c.resolvable
        )
    return msg


def reasons_from_pb(msg: apb.PlaceResult, field: str = "reasons") -> list[fit.ReasonCount]:
    """Why nowhere took the instance, as the scheduler counted it (bounded, order kept); with
    field "passed_over", why the nodes it was not placed on were left out."""
    return [
        fit.ReasonCount(
            code=r.code[:_MAX_TEXT],
            message=r.message[:_MAX_TEXT],
            node_count=max(0, r.node_count),
            resolvable=r.resolvable,
        )
        for r in getattr(msg, field)[:MAX_REASONS]
    ]
