"""Rolling updates: which instances a changed spec replaces when, and where its rollout stands.

A spec change that needs new instances makes a new generation and a revision (kept on the
workload record, the newest MAX_REVISIONS). The reconciler then calls `plan_rollout` for the
workload on each pass: it folds what the instances show into the rollout's state (the one
place a state changes: `_transition`), and moves instances within the spec's `update`
bounds, like a Kubernetes Deployment: at most `replicas + max_surge` instances, at least
`replicas - max_unavailable` ready ones, where ready means RUNNING and HEALTHY for
`min_ready_seconds`. New instances that fail, crash-loop or turn unhealthy, or no progress
for `progress_deadline_seconds`, stop the rollout; with `auto_rollback` a new revision with
the last completed spec follows, and the instances still running that spec are adopted by it
instead of being replaced.

Everything lives on the workload record, so a new leader continues a rollout where the last
one stopped: the counts it compares against (progress) are the stored status's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

import structlog

from orka.controller.tally import Tally, active, age, is_ready
from orka.controller.volume_plan import one_at_a_time
from orka.errors import Conflict, Invalid
from orka.etags import new_workload_etag
from orka.models import (
    MAX_REVISION_BYTES,
    MAX_REVISIONS,
    ROLLOUT_DONE,
    Instance,
    InstancePhase,
    InstanceReason,
    Revision,
    Rollout,
    RolloutState,
    Workload,
    WorkloadSpec,
)

log = structlog.get_logger("orka.controller.rollout")


def runs_same(a: WorkloadSpec, b: WorkloadSpec) -> bool:
    """Whether instances of spec `a` are instances of spec `b`: only replicas, the update
    strategy and the node-loss policy may differ (scaling, retuning a rollout or choosing how
    long to wait for a lost node restarts nothing)."""
    keep = {
        "replicas": b.replicas,
        "update": b.update,
        "on_node_lost": b.on_node_lost,
        "max_disconnect": b.max_disconnect,
    }
    return a.model_copy(update=keep) == b


def progress_only(old: Workload, new: Workload) -> bool:
    """Whether `new` is `old` with only its rollout's progress moved on (`progress_at` and the
    deadline after it): a write that may wait with the status counts that moved it, since each
    pass finds the same progress again until the counts are stored."""
    r = new.rollout
    moved = old.rollout.model_copy(update={"progress_at": r.progress_at, "deadline": r.deadline})
    return moved == r and old.model_copy(update={"rollout": r}) == new


def first_revision(w: Workload, who: str) -> Workload:
    """A new workload: revision 1, its rollout under way until its instances are ready."""
    rev = Revision(revision=w.generation, created_at=w.created_at, created_by=who)
    return w.model_copy(
        update={
            "revisions": [rev],
            "rollout": _started(w.generation, stable=0, now=w.created_at, spec=w.spec),
        }
    )


def new_revision(
    old: Workload, spec: WorkloadSpec, who: str, now: float, cause: str, rollback_of: int = 0
) -> Workload:
    """`old` moving to `spec`, which runs differently: a new generation and revision whose
    rollout starts now. The rollback target stays the last revision that completed."""
    generation = old.generation + 1
    r = old.rollout
    stable = (
        old.generation if r.state in ROLLOUT_DONE and r.revision == old.generation else r.stable
    )
    rev = Revision(revision=generation, created_at=now, created_by=who, cause=cause)
    revisions = _bounded([*old.history(), rev])
    return old.model_copy(
        update={
            "spec": spec,
            "generation": generation,
            "revisions": revisions,
            "rollout": _started(generation, stable, now, spec, rollback_of),
            "updated_at": now,
            "updated_by": who,
            "etag": new_workload_etag(),
        }
    )


def _bounded(revisions: list[Revision]) -> list[Revision]:
    """The newest MAX_REVISIONS, fewer when the earlier specs pass MAX_REVISION_BYTES (the
    newest, current one holds no spec of its own and is always kept)."""
    kept = revisions[-MAX_REVISIONS:]
    sizes = [len(r.spec.model_dump_json()) if r.spec is not None else 0 for r in kept[:-1]]
    while len(kept) > 1 and sum(sizes) > MAX_REVISION_BYTES:
        kept, sizes = kept[1:], sizes[1:]
    return kept


def _started(
    generation: int, stable: int, now: float, spec: WorkloadSpec, rollback_of: int = 0
) -> Rollout:
    # With no replicas there is nothing to roll out: it is complete as it is made.
    state = RolloutState.PROGRESSING if spec.replicas else RolloutState.COMPLETE
    return Rollout(
        state=state,
        revision=generation,
        stable=stable,
        rollback_of=rollback_of,
        message="rolling back" if rollback_of else "",
        progress_at=now,
        started_at=now,
        deadline=now + spec.update.progress_deadline_seconds,
    )


def rollback_spec(w: Workload, revision: int) -> tuple[WorkloadSpec, int]:
    """The spec of `revision` (0: the one before the current) at today's replica count, and
    the revision number; Conflict when the history does not hold it."""
    if revision < 0:
        raise Invalid.at("revision", f"must be >= 0, got {revision}")
    if revision == 0:
        older = [r for r in w.history() if r.revision < w.generation]
        if not older:
            raise Conflict(f"workload {w.name!r} has no earlier revision to return to")
        target = older[-1]
    else:
        found = w.revision(revision)
        if found is None:
            kept = ", ".join(str(r.revision) for r in w.revisions) or "none"
            raise Conflict(f"workload {w.name!r} has no revision {revision} (kept: {kept})")
        target = found
    assert target.spec is not None  # history() fills every spec in
    return target.spec.model_copy(update={"replicas": w.spec.replicas}), target.revision


# ---- one pass over one workload ----


class View:
    """A workload's instances as a rollout sees them: counted by their tally, and listed only
    when a step needs the instances themselves (replacing outdated ones)."""

    def __init__(
        self, w: Workload, insts: Collection[Instance], now: float, tally: Tally | None = None
    ) -> None:
        self._insts = insts  # read again by `new` and `old`: a collection, not an iterator
        self._generation = g = w.generation
        t = Tally.of(insts) if tally is None else tally
        min_ready = w.spec.update.min_ready_seconds
        self.updated = t.updated(g)  # active, of the current generation
        self.outdated = t.outdated(g)  # active, of an older one
        self.ready_new = t.ready(min_ready, now, g)
        self.ready_old = t.ready(min_ready, now) - self.ready_new
        # Why the current revision's instances fail, "" if they do not.
        self.failure = t.failure(g, w.rollout.started_at)
        self.wake_in = t.wake_in(min_ready, now)  # when the next instance turns ready

    @property
    def ready(self) -> int:
        return self.ready_new + self.ready_old

    @functools.cached_property
    def new(self) -> list[Instance]:
        return [i for i in self._insts if active(i) and i.generation == self._generation]

    @functools.cached_property
    def old(self) -> list[Instance]:
        return [i for i in self._insts if active(i) and i.generation != self._generation]


@dataclass
class Outcome:
    """What `plan_rollout` decided: the workload as it now stands (a rollback changes its spec),
    the instance records to write, and when to look again."""

    workload: Workload
    puts: list[Instance] = field(default_factory=list)
    wake_in: float | None = None


def plan_rollout(
    w: Workload,
    insts: Mapping[str, Instance],
    now: float,
    may_add: bool,
    new_instance: Callable[[Workload], Instance],
    tally: Tally | None = None,
) -> Outcome:
    """One pass: advance the rollout's state, roll back if it failed and may, then replace
    outdated instances within the bounds. `may_add` is False while a crash backoff runs;
    `tally`, when given, counts `insts`."""
    v = View(w, insts.values(), now, tally)
    rollout = _transition(w, v, now)
    out = Outcome(w.model_copy(update={"rollout": rollout}) if rollout != w.rollout else w)
    out.wake_in = v.wake_in
    # A rollback that fails too stays FAILED: going back and forth would never end.
    auto = w.spec.update.auto_rollback and not rollout.rollback_of
    if rollout.state is RolloutState.FAILED and auto:
        back = _auto_rollback(out.workload, now)
        if back is not None:
            out.workload = back
            out.puts += adopt(back, insts.values())
            merged = {**insts, **{i.name: i for i in out.puts}}
            v = View(back, merged.values(), now)
    if out.workload.rollout.state is RolloutState.PROGRESSING and v.outdated:
        out.puts += _replace(out.workload, v, now, may_add, new_instance)
    return out


def _transition(w: Workload, v: View, now: float) -> Rollout:
    """The rollout state the instances now show: the one place a rollout step happens."""
    r = w.rollout
    if r.revision != w.generation:
        # A record from before rollouts were kept: its rollout starts now.
        return _started(
            w.generation, r.revision if r.state in ROLLOUT_DONE else r.stable, now, w.spec
        )
    if r.state is not RolloutState.PROGRESSING:
        return r
    spec = w.spec
    if v.failure:
        return _step(w, r, RolloutState.FAILED, v.failure, now)
    updated, ready = v.updated, v.ready_new
    if (updated, ready) != (w.status.updated, w.status.ready) and not (updated == 0 and ready == 0):
        # Progress: pushes the deadline on.
        r = r.model_copy(
            update={"progress_at": now, "deadline": now + spec.update.progress_deadline_seconds}
        )
    canary = min(spec.update.canary, spec.replicas)
    if canary and not r.promoted and v.outdated and ready >= canary:
        return _step(
            w, r, RolloutState.AWAITING_PROMOTION, f"{ready} canary instance(s) ready", now
        )
    if not v.outdated and updated == spec.replicas and ready == spec.replicas:
        done = RolloutState.ROLLED_BACK if r.rollback_of else RolloutState.COMPLETE
        message = f"rolled back from revision {r.rollback_of}" if r.rollback_of else ""
        return _step(w, r, done, message, now)
    if now > r.deadline:
        message = (
            f"no progress for {spec.update.progress_deadline_seconds}s"
            f" ({ready} of {spec.replicas} new instance(s) ready)"
        )
        return _step(w, r, RolloutState.FAILED, message, now)
    return r


def _step(w: Workload, r: Rollout, state: RolloutState, message: str, now: float) -> Rollout:
    log.info(
        "rollout step",
        workload=w.name,
        revision=r.revision,
        state=state.value,
        message=message[:200],
    )
    return r.model_copy(update={"state": state, "message": message, "progress_at": now})


def _auto_rollback(w: Workload, now: float) -> Workload | None:
    """A new revision with the last completed one's spec; None when there is none to go to."""
    r = w.rollout
    target = w.revision(r.stable) if r.stable and r.stable != w.generation else None
    if target is None:
        return None
    assert target.spec is not None  # history() fills every spec in
    spec = target.spec.model_copy(update={"replicas": w.spec.replicas})
    back = new_revision(
        w,
        spec,
        "controller",
        now,
        f"automatic rollback to revision {target.revision}: {r.message}"[:500],
        rollback_of=w.generation,
    )
    # The failed revision stays FAILED in history: the new one records why it was made.
    return back


def adopt(w: Workload, insts: Iterable[Instance]) -> list[Instance]:
    """Active instances of an earlier revision that runs the same as `w`'s spec join the
    current generation: a rollback (or undo) keeps the instances that never left it."""
    same = {
        r.revision
        for r in w.history()
        if r.revision != w.generation and r.spec is not None and runs_same(r.spec, w.spec)
    }
    return [
        i.model_copy(update={"generation": w.generation, "updated_at": time.time()})
        for i in insts
        if i.generation in same and not i.terminal and not i.desired_stop
    ]


def _replace(
    w: Workload,
    v: View,
    now: float,
    may_add: bool,
    new_instance: Callable[[Workload], Instance],
) -> list[Instance]:
    """Stop outdated instances and add new ones, keeping at most `replicas + max_surge`
    instances and at least `replicas - max_unavailable` ready ones. An outdated instance not
    yet placed simply becomes a new one (it has run nothing)."""
    spec, u = w.spec, w.spec.update
    if one_at_a_time(spec):
        # A VM's disk serves one VM at a time: a surge successor would wait for the disk its
        # predecessor holds while the predecessor waits for it to be ready. Stop first.
        u = u.model_copy(update={"max_surge": 0, "max_unavailable": max(1, u.max_unavailable)})
    replicas = spec.replicas
    puts: list[Instance] = []
    target_new = replicas
    if u.canary and not w.rollout.promoted:
        target_new = min(u.canary, replicas)
    new_count = v.updated
    old = []
    for inst in v.old:
        if inst.phase is InstancePhase.PENDING and new_count < target_new:
            puts.append(inst.model_copy(update={"generation": w.generation}))
            new_count += 1
        else:
            old.append(inst)
    active = new_count + len(old)
    min_available = replicas - u.max_unavailable
    min_ready = u.min_ready_seconds
    ready_old = [i for i in old if is_ready(i, min_ready, now)]
    unready_old = [i for i in old if not is_ready(i, min_ready, now)]
    surplus = len(old) - (replicas - target_new)
    # Unready outdated instances go first: they serve nobody. Bounded as Kubernetes does, so
    # that new instances still starting count against the budget too.
    budget = active - min_available - (new_count - v.ready_new)
    stops: list[Instance] = []
    for inst in sorted(unready_old, key=age):
        if budget <= 0 or surplus <= 0:
            break
        stops.append(inst)
        budget -= 1
        surplus -= 1
    # Then ready ones, oldest first, while enough others stay ready.
    spare = v.ready - min_available
    for inst in sorted(ready_old, key=age):
        if spare <= 0 or surplus <= 0:
            break
        stops.append(inst)
        spare -= 1
        surplus -= 1
    wall = time.time()
    puts += [i.stop(InstanceReason.REPLACED, wall, f"revision {w.generation}") for i in stops]
    active -= len(stops)
    room = min(target_new - new_count, replicas + u.max_surge - active)
    if may_add:
        puts += [new_instance(w) for _ in range(max(0, room))]
    return puts


# ---- what users ask (the API) ----


def pause(w: Workload, now: float) -> Workload:
    r = w.rollout
    if r.state is RolloutState.PAUSED:
        return w
    if r.state is not RolloutState.PROGRESSING:
        raise Conflict(
            f"workload {w.name!r}: only a PROGRESSING rollout can be paused; it is {r.state.value}"
        )
    return _set(w, r.model_copy(update={"state": RolloutState.PAUSED, "message": "paused"}))


def resume(w: Workload, now: float) -> Workload:
    """A paused rollout goes on; a FAILED one is tried again. Its deadline starts afresh."""
    r = w.rollout
    if r.state is RolloutState.PROGRESSING:
        return w
    if r.state not in (RolloutState.PAUSED, RolloutState.FAILED):
        raise Conflict(
            f"workload {w.name!r}: only a PAUSED or FAILED rollout can be resumed; it is"
            f" {r.state.value}"
        )
    return _set(w, _restarted(w, r, now, r.promoted))


def promote(w: Workload, now: float) -> Workload:
    r = w.rollout
    if r.state is not RolloutState.AWAITING_PROMOTION:
        raise Conflict(
            f"workload {w.name!r}: only a rollout AWAITING_PROMOTION can be promoted; it is"
            f" {r.state.value}"
        )
    return _set(w, _restarted(w, r, now, promoted=True))


def _restarted(w: Workload, r: Rollout, now: float, promoted: bool) -> Rollout:
    return r.model_copy(
        update={
            "state": RolloutState.PROGRESSING,
            "message": "",
            "promoted": promoted,
            "progress_at": now,
            "deadline": now + w.spec.update.progress_deadline_seconds,
        }
    )


def _set(w: Workload, r: Rollout) -> Workload:
    return w.model_copy(update={"rollout": r, "updated_at": time.time()})
