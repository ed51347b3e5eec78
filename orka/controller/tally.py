"""A workload's instances counted by what a reconcile pass reads of them.

A pass decides from these counts whether a workload is settled, what its status says
(placed, running, ready...) and where its rollout stands. Counted afresh, they cost a look at
every instance of the workload; the reconciler instead keeps one tally per workload and moves
it as each instance is written (`remove` the old record, `add` the new), so a pass over a
workload of thousands of instances, of which a few changed, costs a few steps. A tally built
by adding and removing records one by one equals one counted at once from the records that
remain (`Tally.of`); tests/unit/controller/test_tally.py holds the two to that.

What counts as ready (RUNNING and HEALTHY for `min_ready` seconds) and as failing lives here
too, next to the counts that must agree with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sortedcontainers import SortedList

from orka.models import TERMINAL_PHASES, HealthState, Instance, InstancePhase

# Phases that keep a workload from being settled: finished, or waited for (the wait's end is
# a planning step of its own).
UNSETTLED_PHASES = TERMINAL_PHASES | {InstancePhase.DISCONNECTED}


def active(inst: Instance) -> bool:
    """Still one of its workload's replicas: not finished, not asked to stop, not replaced."""
    return not (inst.terminal or inst.desired_stop or inst.replaced_by)


def ready_since(inst: Instance) -> float | None:
    """When a RUNNING and HEALTHY instance began counting toward ready (it started, or turned
    healthy); None when it is not RUNNING and HEALTHY."""
    if inst.phase is not InstancePhase.RUNNING or inst.health is not HealthState.HEALTHY:
        return None
    return max(inst.started_at or 0.0, inst.health_changed_at or 0.0)


def _ready(since: float, min_ready: float, now: float) -> bool:
    return now - since >= min_ready


def _left(since: float, min_ready: float, now: float) -> float:
    return since + min_ready - now


def is_ready(inst: Instance, min_ready: float, now: float) -> bool:
    """RUNNING and HEALTHY for `min_ready` seconds (since it started, or turned healthy)."""
    since = ready_since(inst)
    return since is not None and _ready(since, min_ready, now)


def ready_in(inst: Instance, min_ready: float, now: float) -> float | None:
    """Seconds until a RUNNING and HEALTHY instance counts as ready; None if it is not on its
    way (or already is)."""
    since = ready_since(inst)
    if since is None:
        return None
    left = _left(since, min_ready, now)
    return left if left > 0 else None


def failing(inst: Instance) -> str:
    """Why a new instance shows its revision does not work ("" when it does not): it failed,
    restarted (exits at once, crash loop) or its health check fails."""
    if inst.phase is InstancePhase.FAILED and not inst.desired_stop:
        return f"instance {inst.name} failed: {inst.message or inst.reason or 'no reason given'}"
    if inst.restarts > 0 and not inst.desired_stop:
        return f"instance {inst.name} restarted {inst.restarts} time(s): {inst.message}".rstrip(
            ": "
        )
    if inst.phase is InstancePhase.RUNNING and inst.health is HealthState.UNHEALTHY:
        return f"instance {inst.name} is unhealthy: {inst.health_message or 'check failed'}"
    return ""


def age(inst: Instance) -> tuple[float, str]:
    """Oldest first, and a stable order among instances made at the same time."""
    return (inst.created_at, inst.name)


class Tally:
    """One workload's instances, counted. Every count covers the records added and not
    removed; those of active instances (`active`) cover only the active ones."""

    __slots__ = (
        "active",
        "failing",
        "generations",
        "healthy",
        "nodes",
        "placed",
        "running",
        "since",
        "size",
        "troubled",
        "unplaced",
    )

    def __init__(self) -> None:
        self.size = 0
        # Every instance by generation, and the names of those that keep the workload from
        # being settled by their own state (finished, DISCONNECTED, stopping, replaced).
        self.generations: dict[int, int] = {}
        self.troubled: set[str] = set()
        # Every bound instance by node (whether one sits on a draining or lost node).
        self.nodes: dict[str, int] = {}
        # Instances that show their revision fails (`failing`), by name.
        self.failing: dict[str, Instance] = {}
        # Active instances: by generation, bound, RUNNING, RUNNING and HEALTHY.
        self.active: dict[int, int] = {}
        self.placed = 0
        self.running = 0
        self.healthy = 0
        # The `ready_since` of active RUNNING and HEALTHY instances, by generation, sorted:
        # how many are ready at a time is a search, not a look at each.
        self.since: dict[int, SortedList] = {}
        # Active instances waiting for a node with a reason why none took them, by name.
        self.unplaced: dict[str, Instance] = {}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tally):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # moved in place: not a key

    @classmethod
    def of(cls, insts: Iterable[Instance]) -> Tally:
        t = cls()
        for inst in insts:
            t.add(inst)
        return t

    def add(self, inst: Instance) -> None:
        self._count(inst, 1)

    def remove(self, inst: Instance) -> None:
        """Take out a record added before (the same record, not a newer one of its name)."""
        self._count(inst, -1)

    def _count(self, inst: Instance, sign: int) -> None:
        # Every write moves a tally twice (the old record out, the new in): the rules of
        # `active`, `failing` and UNSETTLED_PHASES are spelled out here rather than called.
        phase = inst.phase
        stopping = inst.desired_stop
        finished = phase in TERMINAL_PHASES
        self.size += sign
        _bump(self.generations, inst.generation, sign)
        if inst.node:
            _bump(self.nodes, inst.node, sign)
        if finished or stopping or inst.replaced_by or phase is InstancePhase.DISCONNECTED:
            _mark(self.troubled, inst.name, sign)
        if ((phase is InstancePhase.FAILED or inst.restarts > 0) and not stopping) or (
            phase is InstancePhase.RUNNING and inst.health is HealthState.UNHEALTHY
        ):
            _keep(self.failing, inst, sign)
        if finished or stopping or inst.replaced_by:
            return  # not active
        _bump(self.active, inst.generation, sign)
        if inst.node:
            self.placed += sign
        if phase is InstancePhase.RUNNING:
            self.running += sign
            if inst.health is HealthState.HEALTHY:
                self.healthy += sign
                since = ready_since(inst)
                sorted_since = self.since.get(inst.generation)
                if sign > 0:
                    if sorted_since is None:
                        sorted_since = self.since[inst.generation] = SortedList()
                    sorted_since.add(since)
                elif sorted_since is not None:
                    sorted_since.remove(since)
                    if not sorted_since:
                        del self.since[inst.generation]
        elif phase is InstancePhase.PENDING and inst.message:
            _keep(self.unplaced, inst, sign)

    # ---- what a pass reads ----

    def all_of(self, generation: int) -> bool:
        """Every instance is of `generation`, and none is finished, DISCONNECTED, stopping
        or replaced."""
        return not self.troubled and self.generations.get(generation, 0) == self.size

    def on_any(self, nodes: Iterable[str]) -> bool:
        """Whether an instance is bound to one of `nodes`."""
        return any(self.nodes.get(n) for n in nodes)

    def updated(self, generation: int) -> int:
        """Active instances of `generation`."""
        return self.active.get(generation, 0)

    def outdated(self, generation: int) -> int:
        """Active instances of any other generation."""
        return sum(self.active.values()) - self.updated(generation)

    def ready(self, min_ready: float, now: float, generation: int | None = None) -> int:
        """Active instances ready at `now` (`is_ready`): of `generation`, or of any."""
        if generation is not None:
            values = self.since.get(generation)
            return 0 if values is None else _prefix(values, min_ready, now, _ready)
        return sum(_prefix(v, min_ready, now, _ready) for v in self.since.values())

    def wake_in(self, min_ready: float, now: float) -> float | None:
        """Seconds until the next active instance turns ready (`ready_in`); None when none is
        on its way."""
        best: float | None = None
        for values in self.since.values():
            # The first with time left has the least: the time left grows with `since`.
            k = _prefix(values, min_ready, now, _not_waiting)
            if k < len(values):
                left = _left(values[k], min_ready, now)
                if best is None or left < best:
                    best = left
        return best

    def failure(self, generation: int, since: float) -> str:
        """Why `generation` fails (`failing`), as its oldest failing instance made at or after
        `since` shows it; "" when none does."""
        shown = [
            i for i in self.failing.values() if i.generation == generation and i.created_at >= since
        ]
        return failing(min(shown, key=age)) if shown else ""

    def unplaced_oldest_first(self) -> list[Instance]:
        return sorted(self.unplaced.values(), key=age)


def _not_waiting(since: float, min_ready: float, now: float) -> bool:
    return not _left(since, min_ready, now) > 0


def _prefix(
    values: SortedList, min_ready: float, now: float, holds: Callable[[float, float, float], bool]
) -> int:
    """How many of the sorted `values` `holds` is true for, when it is true for a prefix of
    them. The search starts where exact arithmetic puts the edge and steps over the values
    that float rounding puts on the other side, so the count is the predicate's own."""
    k = values.bisect_right(now - min_ready)
    while k > 0 and not holds(values[k - 1], min_ready, now):
        k -= 1
    while k < len(values) and holds(values[k], min_ready, now):
        k += 1
    return k


def _bump(counts: dict[Any, int], key: object, sign: int) -> None:
    n = counts.get(key, 0) + sign
    if n:
        counts[key] = n
    else:
        del counts[key]


def _mark(names: set[str], name: str, sign: int) -> None:
    if sign > 0:
        names.add(name)
    else:
        names.discard(name)


def _keep(by_name: dict[str, Instance], inst: Instance, sign: int) -> None:
    if sign > 0:
        by_name[inst.name] = inst
    else:
        by_name.pop(inst.name, None)
