"""One placement decision's context and outcome, shared by the pipeline's stages."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from orka import fit
from orka.scheduler.index import SnapshotIndex
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot

Check = Callable[[PlacementRequest, NodeView], fit.Reason | None]


@dataclass(slots=True)
class Decision:
    """One ranking's context: the request, the snapshot it reads (never writes), and what the
    stages work out for this decision alone."""

    req: PlacementRequest
    snapshot: Snapshot
    # At most this many candidates; None for every feasible node.
    limit: int | None
    # The filters that can reject this request, in precedence order.
    checks: list[Check]
    # The snapshot's index, when one exists for it.
    index: SnapshotIndex | None = None

    def rejections(self) -> dict[fit.Reason, int]:
        return filter_nodes(self.req, self.snapshot.nodes, self.checks)[1]


class Ranking:
    """Candidates best first, why the other nodes were left out, and which stage decided.

    The reason counts matter only when nothing fits (they become the Unschedulable message),
    so the indexed stage computes them on first access rather than filtering every node.
    """

    __slots__ = ("_lazy", "_rejections", "candidates", "stage")

    def __init__(
        self,
        candidates: tuple[str, ...],
        rejections: Mapping[fit.Reason, int] | None = None,
        *,
        lazy: Callable[[], Mapping[fit.Reason, int]] | None = None,
        stage: str = "exhaustive",
    ) -> None:
        # Node names, best first; at most `limit` of them when rank() was given one.
        self.candidates = candidates
        self._rejections = rejections if rejections is not None or lazy else {}
        self._lazy = lazy
        self.stage = stage

    @property
    def rejections(self) -> Mapping[fit.Reason, int]:
        """Reason -> number of nodes the filters rejected for it."""
        if self._rejections is None:
            assert self._lazy is not None
            self._rejections = self._lazy()
            self._lazy = None
        return self._rejections

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ranking):
            return NotImplemented
        return self.candidates == other.candidates and self.rejections == other.rejections

    def __repr__(self) -> str:
        return (
            f"Ranking(candidates={self.candidates!r}, rejections={dict(self.rejections)!r},"
            f" stage={self.stage!r})"
        )

    def counted_rejections(self) -> Mapping[fit.Reason, int] | None:
        """The rejections when they were counted already (an exhaustive ranking), else None:
        for explaining a placement that needs no explaining to succeed, never worth a count."""
        return self._rejections

    def reason_counts(self) -> list[fit.ReasonCount]:
        return fit.count_reasons(self.rejections)

    def reasons_text(self) -> str:
        """Why nodes were left out; "no nodes" when the cluster had none at all."""
        if not self.rejections and self.candidates:
            return ""
        return fit.format_reasons(self.reason_counts())


class Stage(Protocol):
    name: str

    def rank(self, decision: Decision) -> Ranking | None:
        """The ranking, or None to leave the decision to the next stage."""
        ...


def filter_nodes(
    req: PlacementRequest, nodes: tuple[NodeView, ...] | list[NodeView], checks: list[Check]
) -> tuple[list[NodeView], dict[fit.Reason, int]]:
    """The nodes every check passes, and how many nodes each first failing reason rejected."""
    rejections: dict[fit.Reason, int] = {}
    feasible: list[NodeView] = []
    keep = feasible.append
    for node in nodes:
        for check in checks:
            reason = check(req, node)
            if reason is not None:
                rejections[reason] = rejections.get(reason, 0) + 1
                break
        else:
            keep(node)
    return feasible, rejections
