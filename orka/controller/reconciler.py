"""Keeps stored instances in line with workloads and with what the nodes report.

One planning pass (`plan`) looks at every workload and returns the writes that move it toward
its desired state; the commands that follow (stop, start again) are sent after the write lands,
so a crash between the two only repeats a command, it never loses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import secrets
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import structlog

from orka.controller import rollout, volumes
from orka.controller.activity import ActivityLog
from orka.controller.commands import (
    ClusterUpdate,
    InstanceReported,
    NodeCommand,
    NodeSeen,
    NodeSynced,
    start_command,
    stop_command,
)
from orka.controller.link import SchedulerLink
from orka.controller.placement import PlacementQueue
from orka.controller.repo import Change, Repo
from orka.controller.tally import Tally, active
from orka.controller.volume_plan import Ordinals, one_at_a_time
from orka.errors import Invalid, OrkaError
from orka.models import (
    TERMINAL_PHASES,
    Instance,
    InstancePhase,
    InstanceReason,
    InstanceReport,
    Node,
    NodeState,
    OnNodeLost,
    RestartPolicy,
    RolloutState,
    Workload,
    WorkloadSpec,
    WorkloadStatus,
)

log = structlog.get_logger("orka.controller.reconciler")

# How long a stop or start command may go unanswered before it is sent again.
RESEND_AFTER = 10.0
# A bound instance the node does not mention after this long is considered gone.
START_GRACE = 15.0
# Finished instances kept per workload for `orka get instances`; older ones are removed
# (--keep-finished), and none kept past FINISHED_RETENTION seconds (--finished-retention).
KEEP_FINISHED = 5
FINISHED_RETENTION = 3600.0
# Incremental passes plan only changed workloads; a full pass runs at least this often.
FULL_PASS_EVERY = 2.0
# Node states in which the node's instances are lost (and replaced elsewhere).
_NODE_GONE = (NodeState.LOST, NodeState.LEFT)
# A workload whose instances fail is re-placed with backoff: after the n-th failure in a row
# the next replacement waits CRASH_BACKOFF_START * 2**(n-1) seconds, at most CRASH_BACKOFF_MAX,
# counted from when the failed instance finished. A replacement that then runs for
# CRASH_HEALTHY_RUN seconds ends the streak. Without it a spec that fails at start is placed,
# started and failed again as fast as the services can go, keeping all three busy.
CRASH_BACKOFF_START = 1.0
CRASH_BACKOFF_MAX = 300.0
CRASH_HEALTHY_RUN = 60.0
# While instances move, a workload's status counts (placed, running, healthy, updated, ready)
# are written at most this often: a burst reports each instance three times, and every report
# would otherwise rewrite its workload. The rollout progress the counts show (its deadline
# pushed on) waits with them; a new reason or message, settled counts (all of them at
# `replicas`), a rollout step and any other change to the workload are written at once; a
# count held back is written by a pass this much after the last write at the latest.
STATUS_COUNTS_EVERY = 0.25
_COUNT_FIELDS = ("placed", "running", "healthy", "updated", "ready")


@dataclass
class CrashBackoff:
    """One workload's streak of failed instances (controller memory, per leader term)."""

    failures: int = 0
    # No replacement for a failed instance before this time (time.time()).
    not_before: float = 0.0
    # Failed instances already counted, and replacements made during the streak.
    counted: set[str] = dataclasses.field(default_factory=set)
    probes: set[str] = dataclasses.field(default_factory=set)
    last_error: str = ""

    def delay(self) -> float:
        return min(CRASH_BACKOFF_START * 2 ** max(0, self.failures - 1), CRASH_BACKOFF_MAX)


class WorkloadInstances(Mapping[str, Instance]):
    """A workload's instances by name, as the repo holds them, gathered only when a step
    reads them: a settled workload is planned from its tally alone, and gathering thousands of
    instances for each of the few that changed was most of a pass in a burst."""

    def __init__(self, repo: Repo, workload: str) -> None:
        self._repo = repo
        self._workload = workload
        self._by_name: dict[str, Instance] | None = None

    def _all(self) -> dict[str, Instance]:
        if self._by_name is None:
            self._by_name = {i.name: i for i in self._repo.instances_of(self._workload)}
        return self._by_name

    def __getitem__(self, name: str) -> Instance:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __contains__(self, name: object) -> bool:
        return name in self._all()


class WorkloadStep:
    """One workload's planning pass: its instances as the steps so far left them, and the
    writes they planned. Each step reads `current()` and writes with `put`."""

    def __init__(self, workload: Workload, insts: Mapping[str, Instance], now: float) -> None:
        self.workload = workload
        self.insts = insts
        self.now = now
        self.changes: list[Change] = []
        self._updated: dict[str, Instance] = {}
        self._drawn: set[str] = set()

    def put(self, inst: Instance) -> None:
        self._updated[inst.name] = inst
        self.changes.append(Change("instances", inst.name, inst))

    def fresh(self, w: Workload, ordinal: int) -> Instance:
        """A new instance of `w` (the workload as this pass has it) under a name none of the
        workload's instances has, stored or drawn this pass."""
        inst = new_instance(w, ordinal, taken=self)
        self._drawn.add(inst.name)
        return inst

    def __contains__(self, name: object) -> bool:
        return name in self.insts or name in self._drawn

    def current(self) -> Mapping[str, Instance]:
        # Most passes change nothing here: the workload's own table stands as is.
        return {**self.insts, **self._updated} if self._updated else self.insts


@dataclass(frozen=True)
class History:
    """How much instance history each workload keeps: finished instances (stopped, failed
    for good, lost, replaced) beyond the newest `keep`, or finished more than `retention`
    seconds ago, are removed. Like Nomad's garbage collection of terminal allocations (by
    age, and a count per client), not Kubernetes' one cluster-wide threshold of terminated
    pods: a workload that restarts often cannot crowd out every other workload's history.
    Completed replicas (SUCCEEDED, standing for their replica) are never removed here."""

    keep: int = KEEP_FINISHED
    retention: float = FINISHED_RETENTION

    def __post_init__(self) -> None:
        if self.keep < 0:
            raise Invalid(f"--keep-finished: must be >= 0, got {self.keep}")
        if self.retention <= 0:
            raise Invalid(f"--finished-retention: must be > 0, got {self.retention:g}")


def new_instance(w: Workload, ordinal: int, taken: Container[str]) -> Instance:
    """A new instance of `w` named unlike any in `taken`. Names are the workload's and six
    random hex digits: one workload of a few thousand replicas meets a repeat within a few
    thousand new instances, and a repeated name would replace the instance that has it."""
    while True:
        name = f"{w.name}-{secrets.token_hex(3)}"
        if name not in taken:
            return Instance(name=name, workload=w.name, generation=w.generation, ordinal=ordinal)


class Reconciler:
    def __init__(
        self,
        repo: Repo,
        link: SchedulerLink,
        queue: PlacementQueue,
        history: History | None = None,
    ) -> None:
        self.repo = repo
        self.link = link
        self.queue = queue
        self.history = history or History()
        # LOST instances whose node registered again without them: nothing of them is left
        # there, so their records are history like any other finished instance.
        self._gone_from_node: set[str] = set()
        self._dirty = asyncio.Event()
        self._stops_sent: dict[str, float] = {}
        self._starts_sent: dict[str, float] = {}
        self._cleanup_sent: dict[tuple[str, str], float] = {}
        # Removal commands for finished instances whose records a plan deletes.
        self._removals: list[NodeCommand] = []
        # Incremental passes: while `run` listens to the repo, a pass plans only the workloads
        # whose records (or instances' records) changed since the last pass; a full pass runs
        # at least every FULL_PASS_EVERY seconds (time-based steps: resends, grace periods,
        # placement-queue state) and after anything that is not tied to one workload (a node
        # changed, the cache was reloaded). Without the listener every pass is full.
        self._listening = False
        self._changed_workloads: set[str] = set()
        # And the instances written since: an incremental pass checks only their commands
        # and queueing (`_in_scope`).
        self._changed_instances: set[str] = set()
        self._full_due = True
        self._last_full = -1e9
        self._reloads_seen = repo.reloads
        # The workloads the current pass looks at; None: all of them. And the instances
        # written before it began whose commands it checks.
        self._scope: set[str] | None = None
        self._scope_instances: set[str] = set()
        # While listening: each workload's instances counted (Tally), moved as each instance
        # is written, so planning a workload whose few instances changed does not look at
        # all of them again; made afresh from the repo on first use and by each full pass.
        self._tallies: dict[str, Tally] = {}
        # Nodes whose instances keep their workloads from being settled: draining, leaving,
        # lost or departed. Counted by each full pass (a node's change makes the next pass
        # full) and moved as nodes are written.
        self._unsettling: set[str] = set()
        # While listening: when each workload's status was last written (monotonic; a full
        # pass forgets deleted workloads), and the workloads with a held-back count waiting
        # for their pass (STATUS_COUNTS_EVERY).
        self._status_written: dict[str, float] = {}
        self._status_held: set[str] = set()
        # Workloads whose instances keep failing: their replacements wait (CrashBackoff).
        self.crashes: dict[str, CrashBackoff] = {}
        self.clock: Callable[[], float] = time.time
        # For recording steps `orka describe` shows (rollouts): the controller's shared log.
        self.activity = ActivityLog()

    def kick(self) -> None:
        self._dirty.set()

    def _on_change(self, change: Change, old: object) -> None:
        if change.kind == "instances":
            inst = change.value if change.value is not None else old
            if isinstance(inst, Instance):
                self._changed_workloads.add(inst.workload)
                self._changed_instances.add(inst.name)
                tally = self._tallies.get(inst.workload)
                if tally is not None:
                    if isinstance(old, Instance):
                        tally.remove(old)
                    if isinstance(change.value, Instance):
                        tally.add(change.value)
        elif change.kind == "workloads":
            self._changed_workloads.add(change.name)
            if change.value is None:
                self._tallies.pop(change.name, None)
        else:
            self._full_due = True  # a node: its instances span any number of workloads
            if change.kind == "nodes":
                node = change.value
                if isinstance(node, Node) and _unsettling(node):
                    self._unsettling.add(change.name)
                else:
                    self._unsettling.discard(change.name)

    def _tally(self, workload: str, insts: Mapping[str, Instance]) -> Tally:
        """The tally of `workload`, whose instances in the repo are `insts`: the one kept up
        to date while listening, else counted now."""
        if not self._listening:
            return Tally.of(insts.values())
        tally = self._tallies.get(workload)
        if tally is None:
            tally = self._tallies[workload] = Tally.of(insts.values())
        return tally

    def recount_nodes(self) -> None:
        """Count afresh which nodes unsettle their workloads (`_unsettling`)."""
        self._unsettling = {n.name for n in self.repo.nodes.values() if _unsettling(n)}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.repo.listeners.append(self._on_change)
        self._listening = True
        self._full_due = True
        self._tallies = {}
        try:
            while True:
                # A timer rather than wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that races with the event, and the controller would never stop.
                tick = loop.call_later(1.0, self._dirty.set)
                try:
                    await self._dirty.wait()
                finally:
                    tick.cancel()
                self._dirty.clear()
                try:
                    await self.reconcile_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self._full_due = True
                    log.exception("reconcile pass failed")
                    await asyncio.sleep(0.5)
        finally:
            self._listening = False
            self._tallies = {}
            self._status_written = {}
            self._status_held = set()
            with contextlib.suppress(ValueError):
                self.repo.listeners.remove(self._on_change)

    def _next_scope(self) -> set[str] | None:
        now = time.monotonic()
        if (
            not self._listening
            or self._full_due
            or self.repo.reloads != self._reloads_seen
            or now - self._last_full >= FULL_PASS_EVERY
        ):
            self._full_due = False
            self._reloads_seen = self.repo.reloads
            self._last_full = now
            self._changed_workloads = set()
            self._changed_instances = set()
            # A full pass counts afresh: whatever a count missed lasts one period at most.
            self._tallies = {}
            return None
        scope, self._changed_workloads = self._changed_workloads, set()
        self._scope_instances, self._changed_instances = self._changed_instances, set()
        return scope

    def _in_scope(self) -> list[Instance]:
        """The instances whose commands (stop) and queueing this pass checks: every one in a
        full pass; in an incremental one, those written since the last pass began and by
        this pass. A command follows from an instance's own record (a stop asked for) or
        from time (a resend, a node back: full passes), never from the rest of its
        workload, whose every instance a burst would otherwise look at after each report."""
        if self._scope is None:
            return list(self.repo.instances.values())
        # The pass's own writes (stops, new instances) are in the changed set by now.
        names = self._scope_instances | self._changed_instances
        return [self.repo.instances[n] for n in names if n in self.repo.instances]

    async def reconcile_once(self) -> None:
        self._removals = []
        self._scope = self._next_scope()
        try:
            await self.repo.mutate(self.plan)
            if self._removals:
                await self._command(self._removals)
            insts = self._in_scope()
            await self._send_commands(insts, full=self._scope is None)
            for inst in insts:
                if inst.phase is InstancePhase.PENDING and not inst.desired_stop:
                    self.queue.add(inst.name)
        except BaseException:
            self._full_due = True  # whatever this pass did not finish, the next one redoes
            raise
        finally:
            self._scope = None
            self._scope_instances = set()

    # ---- planning ----

    def _forget(self, inst: Instance) -> Change:
        """Delete the record; a finished task the node still keeps (logs, container) goes too."""
        node = self._node(inst.node) if inst.node else None
        if inst.terminal and node is not None and node.state is NodeState.READY:
            self._removals.append(stop_command(inst.node, inst.name, "forgotten"))
        self._gone_from_node.discard(inst.name)
        return Change("instances", inst.name, None)

    def plan(self) -> list[Change]:
        changes: list[Change] = []
        now = self.clock()
        scope = self._scope
        if scope is None:
            self.recount_nodes()
        names = list(self.repo.workloads) if scope is None else sorted(scope)
        for name in names:
            w = self.repo.workloads.get(name)
            if w is None:
                continue
            insts = WorkloadInstances(self.repo, name)
            if w.deleting:
                changes += self._plan_delete(w, insts)
            else:
                tally = self._tally(name, insts)
                changes += self._plan_workload(w, insts, now, tally)
        if scope is not None:
            return changes
        for name in [n for n in self.crashes if n not in self.repo.workloads]:
            del self.crashes[name]
        for name in [n for n in self._status_written if n not in self.repo.workloads]:
            del self._status_written[name]
        # Instances whose workload record is gone (should not happen; heal it anyway).
        for inst in list(self.repo.instances.values()):
            if inst.workload not in self.repo.workloads:
                if inst.terminal or not inst.node:
                    changes.append(self._forget(inst))
                elif not inst.desired_stop:
                    stopped = _stop(inst, InstanceReason.WORKLOAD_DELETED)
                    changes.append(Change("instances", inst.name, stopped))
        return changes

    def _node(self, name: str) -> Node | None:
        return self.repo.nodes.get(name)

    def _plan_delete(self, w: Workload, insts: Mapping[str, Instance]) -> list[Change]:
        changes: list[Change] = []
        remaining = 0
        for inst in insts.values():
            node = self._node(inst.node) if inst.node else None
            gone = inst.node and (node is None or node.state in _NODE_GONE)
            unplaced = inst.phase is InstancePhase.PENDING and not self.queue.busy(inst.name)
            if inst.terminal or unplaced or gone:
                changes.append(self._forget(inst))
                continue
            remaining += 1
            if not inst.desired_stop:
                stopped = _stop(inst, InstanceReason.WORKLOAD_DELETED)
                changes.append(Change("instances", inst.name, stopped))
        if remaining == 0:
            changes.append(Change("workloads", w.name, None))
            # In the same commit: its volumes are released, or deleted when asked.
            changes += volumes.workload_removed(self.repo, w, time.time())
        return changes

    def _plan_workload(
        self, w: Workload, insts: Mapping[str, Instance], now: float, tally: Tally | None = None
    ) -> list[Change]:
        """The writes that move one live workload toward its spec, step by step; each step sees
        what the steps before it wrote. `tally`, when given, counts `insts`."""
        if tally is None:
            tally = Tally.of(insts.values())
        if self._settled(w, tally):
            crash = None
            if w.name in self.crashes:
                crash = self._crash_streak(w, insts, now)  # a settled one may end its streak
            if w.rollout.state is not RolloutState.PROGRESSING:
                return self._status_change(w, w, tally, now)
            # Every instance is of the current revision: nothing to replace, scale or forget,
            # only the rollout's state may move (its instances turn ready, or fail).
            step = WorkloadStep(w, insts, now)
            self._roll(step, crash, tally)
            if step.current() is not insts:  # a rollback adopted instances
                tally = Tally.of(step.current().values())
            return step.changes + self._status_change(w, step.workload, tally, now)
        step = WorkloadStep(w, insts, now)
        self._lose_on_gone_nodes(step)
        _release_replaced(step)
        crash = self._crash_streak(w, step.current(), now)
        self._drain_replacements(step, crash)
        self._roll(step, crash, tally)
        rolling = _outdated_left(step)
        done = _completed(step.workload, step.current())
        if not rolling:
            _scale(step, done, crash)
        self._forget_finished(step, done)
        current = step.current()
        if current is not insts:
            tally = Tally.of(current.values())
        return step.changes + self._status_change(w, step.workload, tally, now)

    def _roll(
        self, step: WorkloadStep, crash: CrashBackoff | None, tally: Tally | None = None
    ) -> None:
        """Step 3b. The rolling update (orka/controller/rollout.py): advances the rollout's state
        (a rollback changes the workload) and replaces outdated instances within its bounds.
        `tally` counts the step's instances, when the steps before wrote none."""
        may_add = crash is None or step.now >= crash.not_before
        current = step.current()

        def fresh(w: Workload) -> Instance:
            # The lowest ordinal free in the new generation: with a volume_template, the
            # successor of replica n takes replica n's volume (on its node: ext4 volumes
            # are shared there, so the surge instance and its predecessor run side by side).
            ordinals = taken.get(w.generation)
            if ordinals is None:
                ordinals = taken[w.generation] = Ordinals(
                    current.values(), w.generation, any_generation=one_at_a_time(w.spec)
                )
            return step.fresh(w, ordinals.take())

        taken: dict[int, Ordinals] = {}
        if current is not step.insts:
            tally = None  # the steps before wrote some: counted anew from `current`
        out = rollout.plan_rollout(step.workload, current, step.now, may_add, fresh, tally)
        step.workload = out.workload
        for inst in out.puts:
            if crash is not None and inst.name not in step.insts:
                crash.probes.add(inst.name)
            step.put(inst)
        if out.wake_in is not None:
            self._wake_at(step.workload.name, out.wake_in)

    def _lose_on_gone_nodes(self, step: WorkloadStep) -> None:
        """Step 1. An instance on a lost or departed node runs nowhere the controller can see:
        it is LOST, so that the later steps count it out and place a replacement. Unless its
        workload waits for lost nodes (on_node_lost: wait): then it is DISCONNECTED, still
        counted as its replica, until max_disconnect has passed (see `node_lost_policy`)."""
        spec = step.workload.spec
        for inst in step.insts.values():
            if inst.terminal or not inst.node:
                continue
            node = self._node(inst.node)
            decision = node_lost_policy(spec, inst, node, step.now)
            if decision is LossDecision.KEEP:
                continue
            if decision is LossDecision.WAIT:
                assert node is not None
                message = (
                    f"node {node.name} is {node.state.value}; waiting up to"
                    f" {spec.max_disconnect:g}s for it (on_node_lost: wait)"
                )
                step.put(inst.disconnected(message, step.now))
                continue
            if decision is LossDecision.WAITING:
                # The wait's end is seen by a full pass (FULL_PASS_EVERY): the workload is
                # not settled while any instance is DISCONNECTED.
                continue
            if node is None or node.state in _NODE_GONE:
                message = f"node {inst.node} is {node.state.value if node else 'gone'}"
            else:
                message = f"node {node.name} did not report it within max_disconnect"
            if decision is LossDecision.EXPIRED:
                message += f" ({spec.max_disconnect:g}s waited)"
            step.put(inst.lost(InstanceReason.NODE_LOST, message, step.now))

    def _drain_replacements(self, step: WorkloadStep, crash: CrashBackoff | None) -> None:
        """Step 3. An instance on a draining node gets a successor before it stops (surge, so
        capacity never dips), all at once, none while a crash backoff runs. (Outdated
        instances elsewhere are the rollout's, step 3b.)"""
        w, now = step.workload, step.now
        for inst in self._draining(step.current()):
            if crash is not None and now < crash.not_before:
                continue  # a successor failed: the next waits out the backoff
            # The successor takes its replica's ordinal (and with it the replica's volume).
            succ = step.fresh(w, inst.ordinal)
            if crash is not None:
                crash.probes.add(succ.name)
            step.put(succ)
            step.put(inst.hand_over(succ.name))

    def _draining(self, current: Mapping[str, Instance]) -> list[Instance]:
        """The bound instances on a draining node that have no successor yet, oldest first.
        They are few, so they alone are sorted, not the whole workload each pass."""
        todo = []
        for inst in current.values():
            if not active(inst):
                continue
            if inst.phase not in (InstancePhase.PENDING, InstancePhase.DISCONNECTED):
                node = self._node(inst.node)
                if node is not None and (node.draining or node.leaving):
                    todo.append(inst)
        return sorted(todo, key=lambda i: i.created_at)

    def _forget_finished(self, step: WorkloadStep, done: list[Instance]) -> None:
        """Step 5. Records that no longer serve anyone go, so the store does not grow without
        bound: a stop-requested instance never placed, and finished ones beyond the newest
        `history.keep` or older than `history.retention`. Completed replicas (`done`) stand
        for their replica: forgetting them would start them again. A LOST instance whose
        node is READY but has not yet confirmed it gone is kept, up to the retention."""
        current = step.current()
        done_names = {i.name for i in done}
        finished = sorted(
            (i for i in current.values() if i.terminal and i.name not in done_names),
            key=lambda i: i.finished_at or i.updated_at,
        )
        for inst in current.values():
            if inst.desired_stop and (
                inst.phase is InstancePhase.PENDING and not self.queue.busy(inst.name)
            ):
                step.changes.append(self._forget(inst))
        expired = step.now - self.history.retention
        for i, inst in enumerate(finished):
            old = (inst.finished_at or inst.updated_at) < expired
            if not old and i >= len(finished) - self.history.keep:
                continue  # among the newest kept
            if not old and inst.phase is InstancePhase.LOST and self._node_unsettled(inst):
                continue  # kept until the node confirms it stopped, or is gone for good
            step.changes.append(self._forget(inst))

    def _crash_streak(
        self, w: Workload, insts: Mapping[str, Instance], now: float
    ) -> CrashBackoff | None:
        """Count the workload's newly failed instances into its streak, end the streak when a
        replacement has run long enough; the streak, or None when there is none."""
        crash = self.crashes.get(w.name)
        if w.spec.restart_policy is RestartPolicy.NEVER:
            return None  # a failed replica is done, never replaced
        new = sorted(
            (
                i
                for i in insts.values()
                if i.phase is InstancePhase.FAILED
                and not i.desired_stop
                and (crash is None or i.name not in crash.counted)
            ),
            key=lambda i: i.finished_at or now,
        )
        for inst in new:
            crash = crash or self.crashes.setdefault(w.name, CrashBackoff())
            crash.counted.add(inst.name)
            crash.last_error = (inst.message or inst.reason or "failed")[:200]
            finished = inst.finished_at or now
            if finished >= crash.not_before:
                # A new round; replicas failing before it ends are replaced in it too, so
                # 100 replicas failing at once wait 1 s, not 2**99.
                crash.failures += 1
                crash.not_before = finished + crash.delay()
                self._wake_at(w.name, crash.not_before - now)
            # Once per failure, without a traceback: a failing spec is the user's to fix.
            log.info(
                "instance failed; replacing with backoff",
                workload=w.name,
                instance=inst.name,
                reason=inst.reason,
                error=inst.message[:200],
                failures=crash.failures,
                retry_in=round(max(0.0, crash.not_before - now), 1),
            )
        if crash is None:
            return None
        crash.counted &= insts.keys()  # history is trimmed; so is what we remember of it
        for name in list(crash.probes):
            probe = insts.get(name)
            if probe is None or probe.terminal:
                crash.probes.discard(name)
            elif (
                probe.phase is InstancePhase.RUNNING
                and probe.started_at is not None
                and now - probe.started_at >= CRASH_HEALTHY_RUN
            ):
                log.info("workload recovered", workload=w.name, failures=crash.failures)
                # The streak ends; the failures already counted stay counted.
                crash.failures, crash.not_before = 0, 0.0
                crash.probes.clear()
                return crash
        return crash

    def _wake_at(
        self, workload: str, delay: float, wake: Callable[[str], None] | None = None
    ) -> None:
        """Plan `workload` again when its backoff ends (or call `wake` with it): an
        incremental pass only looks at workloads that changed, and a full one may be up to
        FULL_PASS_EVERY away."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_later(max(0.0, delay) + 0.01, wake or self._wake, workload)

    def _wake(self, workload: str) -> None:
        self._changed_workloads.add(workload)
        self.kick()

    def _settled(self, w: Workload, tally: Tally) -> bool:
        """True when steps 1-5 of `_plan_workload` have nothing to do but move the rollout's
        state: as many instances as replicas, none finished, DISCONNECTED, stopping, replaced or
        of an old generation, none on a node that is lost, departed or draining. Most workloads
        are so on most passes (a full pass looks at every one), and the tally tells at once,
        where the steps take one or more looks at each instance."""
        if tally.size != w.spec.replicas:
            return False
        if w.rollout.revision != w.generation:
            return False  # a rollout to start
        if not tally.all_of(w.generation):
            return False
        return not (self._unsettling and tally.on_any(self._unsettling))

    def _status_change(self, old: Workload, w: Workload, tally: Tally, now: float) -> list[Change]:
        """The write of `w` (the workload as the pass left it: a rollback changes it) with its
        status now, if it differs from the stored `old`; `tally` counts its instances."""
        status = self._status(w, tally, now)
        crash = self.crashes.get(w.name)
        if crash is not None and now < crash.not_before and not status.message:
            status.message = (
                f"{crash.failures} instance failure(s) in a row (the last: {crash.last_error});"
                f" replaced with backoff, up to {CRASH_BACKOFF_MAX:.0f}s"
            )
        if w is old and status == w.status:
            return []
        if self._hold_counts(old, w, status):
            return []
        if self._listening:
            self._status_written[w.name] = time.monotonic()
        return [
            Change("workloads", w.name, w.model_copy(update={"status": status, "updated_at": now}))
        ]

    def _hold_counts(self, old: Workload, w: Workload, status: WorkloadStatus) -> bool:
        """True when `w` with `status` differs from the stored `old` only in status counts
        that have not settled (and the rollout progress they made), and the last write was
        less than STATUS_COUNTS_EVERY ago: the write waits for a pass (woken for it) that
        much after the last one."""
        if not self._listening or not _counts_only(w.status, status) or _counts_settled(status):
            return False
        if w is not old and not rollout.progress_only(old, w):
            return False
        if w.name in self._status_held:
            return True  # its pass is due already
        last = self._status_written.get(w.name)
        left = 0.0 if last is None else last + STATUS_COUNTS_EVERY - time.monotonic()
        if left <= 0:
            return False
        self._status_held.add(w.name)
        self._wake_at(w.name, left, self._counts_due)
        return True

    def _counts_due(self, workload: str) -> None:
        self._status_held.discard(workload)
        self._wake(workload)

    def _node_unsettled(self, inst: Instance) -> bool:
        if not inst.node or inst.name in self._gone_from_node:
            return False
        node = self._node(inst.node)
        return node is not None and node.state is NodeState.READY

    def _status(self, w: Workload, tally: Tally, now: float) -> WorkloadStatus:
        # Oldest first, so the reasons keep a stable order from one pass to the next.
        unplaced = tally.unplaced_oldest_first()
        reasons: list[str] = []
        for i in unplaced:
            if i.message not in reasons:
                reasons.append(i.message)
        message = ""
        if reasons:
            message = f"{w.spec.replicas - tally.placed} replica(s) not placed"
        return WorkloadStatus(
            desired=w.spec.replicas,
            placed=tally.placed,
            running=tally.running,
            healthy=tally.healthy,
            unschedulable_reasons=reasons,
            # Parked by the placement queue: refused by every node for unresolvable reasons.
            unschedulable_unresolvable=any(i.name in self.queue.parked for i in unplaced),
            message=message,
            updated=tally.updated(w.generation),
            ready=tally.ready(w.spec.update.min_ready_seconds, now, w.generation),
        )

    # ---- commands to nodes ----

    async def _send_commands(
        self, insts: Sequence[Instance] | None = None, full: bool = True
    ) -> None:
        now = time.monotonic()
        cmds: list[NodeCommand] = []
        for inst in self.repo.instances.values() if insts is None else insts:
            if not inst.node or inst.terminal:
                continue
            node = self._node(inst.node)
            if node is None or node.state is not NodeState.READY:
                continue
            if inst.desired_stop:
                if now - self._stops_sent.get(inst.name, -1e9) > RESEND_AFTER:
                    self._stops_sent[inst.name] = now
                    cmds.append(stop_command(inst.node, inst.name, inst.message))
            elif inst.phase is InstancePhase.SCHEDULED:
                # The start may have been lost (controller restart between bind and start).
                scheduled = inst.scheduled_at or 0.0
                if (
                    time.time() - scheduled > RESEND_AFTER
                    and now - self._starts_sent.get(inst.name, -1e9) > RESEND_AFTER
                ):
                    w = self.repo.workloads.get(inst.workload)
                    if w is None:
                        continue
                    atts = self.queue.attachments(inst, w)
                    if atts is None:
                        continue  # its volume cannot be used now; sent once it can
                    self._starts_sent[inst.name] = now
                    cmds.append(start_command(inst, w, atts))
        if full:
            for name in list(self._stops_sent):
                if name not in self.repo.instances:
                    del self._stops_sent[name]
            for name in list(self._starts_sent):
                if name not in self.repo.instances:
                    del self._starts_sent[name]
            # A cleanup older than RESEND_AFTER acts as if never sent: drop it (bounded growth).
            for key, at in list(self._cleanup_sent.items()):
                if now - at >= RESEND_AFTER:
                    del self._cleanup_sent[key]
        if cmds:
            await self._command(cmds)

    async def _command(self, cmds: list[NodeCommand]) -> None:
        try:
            results = await self.link.command(cmds)
        except OrkaError as err:
            log.warning("commands not delivered", count=len(cmds), error=err.message)
            return
        for cmd, result in zip(cmds, results, strict=True):
            if not result.ok:
                log.warning("command refused", node=cmd.node, error=result.error)

    def cleanup(self, node: str, instance: str, why: str) -> NodeCommand | None:
        """A node runs something the controller did not bind there: tell it to stop."""
        key = (node, instance)
        now = time.monotonic()
        if now - self._cleanup_sent.get(key, -1e9) < RESEND_AFTER:
            return None
        self._cleanup_sent[key] = now
        log.info("stopping unexpected instance", node=node, instance=instance, why=why)
        return stop_command(node, instance, why)

    # ---- what the scheduler tells us ----

    def _original_back(
        self, inst: Instance, r: InstanceReport, changed: dict[str, Instance], now: float
    ) -> list[Instance]:
        """A LOST instance (its node was lost; REPLACE, or WAIT past max_disconnect) that its
        node reports still live, while the replacement made for it was never placed: keep the
        running original and drop the replacement, rather than kill what runs and wait for a
        start elsewhere (or on the same node). The writes, or [] when the original was
        replaced for real (its copy is then stopped, as before)."""
        if (
            inst.phase is not InstancePhase.LOST
            or inst.reason != InstanceReason.NODE_LOST
            or inst.desired_stop
            or r.phase in TERMINAL_PHASES
            or r.phase is InstancePhase.PENDING
        ):
            return []
        w = self.repo.workloads.get(inst.workload)
        if w is None or w.deleting:
            return []
        succ = _unplaced_successor(inst, self.repo.instances_of(w.name), changed)
        if succ is None:
            return []
        log.info(
            "lost instance back before its replacement was placed; keeping it",
            instance=inst.name,
            node=r.node,
            dropped=succ.name,
        )
        return [inst.reconnected(r, now), _stop(succ, InstanceReason.ORIGINAL_BACK, inst.name)]

    async def on_updates(self, updates: Sequence[ClusterUpdate]) -> None:
        nodes: list[Node] = []
        reports: list[InstanceReport] = []
        syncs: dict[str, set[str]] = {}
        for u in updates:
            if isinstance(u, NodeSeen):
                nodes.append(u.node)
            elif isinstance(u, InstanceReported):
                reports.append(u.report)
            elif isinstance(u, NodeSynced):
                reports += u.reports
                syncs[u.node] = {r.name for r in u.reports}
        cleanups: list[NodeCommand] = []
        reapply: list[Node] = []
        freed = False

        def plan() -> list[Change]:
            nonlocal freed
            changes: list[Change] = []
            now = time.time()
            for node in nodes:
                old = self.repo.nodes.get(node.name)
                if old is not None:
                    # Cordon is the controller's truth; a restarted scheduler forgets it.
                    if not old.schedulable and node.schedulable:
                        reapply.append(old)
                        node = node.model_copy(update={"schedulable": False})
                    if old.draining and not node.draining and old.state is node.state:
                        reapply.append(old)
                        node = node.model_copy(update={"draining": True})
                if old is None or _node_changed(old, node):
                    changes.append(Change("nodes", node.name, node))
                    if node.state is NodeState.READY:
                        freed = True
                else:
                    self.repo.touch(node)
            changed_instances: dict[str, Instance] = {}
            for r in reports:
                inst = changed_instances.get(r.name) or self.repo.instances.get(r.name)
                if inst is not None and inst.node == r.node:
                    back = self._original_back(inst, r, changed_instances, now)
                    if back:
                        changed_instances.update((i.name, i) for i in back)
                        self._gone_from_node.discard(inst.name)
                        freed = True
                        continue
                if inst is None or inst.node != r.node or inst.phase is InstancePhase.LOST:
                    why = (
                        "not bound to this node"
                        if inst is None or inst.node != r.node
                        else "replaced after node loss"
                    )
                    if inst is not None and inst.node == r.node and r.phase in TERMINAL_PHASES:
                        # The node stopped its copy of a LOST instance: nothing runs there.
                        self._gone_from_node.add(inst.name)
                    cmd = self.cleanup(r.node, r.name, why)
                    if cmd is not None:
                        cleanups.append(cmd)
                    continue
                new = inst.reported(r, now)
                if new is not None:
                    changed_instances[r.name] = new
                    if new.terminal:
                        freed = True
            # A scheduler's failover re-registers every node, a few per batch: each node's
            # instances come from the repo's index, not a pass over every instance.
            for node_name, names in syncs.items():
                for inst in self.repo.instances_on(node_name):
                    if inst.name in names:
                        continue
                    if inst.phase is InstancePhase.LOST:
                        self._gone_from_node.add(inst.name)  # the node holds nothing of it
                    if inst.terminal:
                        continue
                    if inst.name in changed_instances:
                        continue
                    if (
                        inst.phase is InstancePhase.SCHEDULED
                        and now - (inst.scheduled_at or 0) < START_GRACE
                    ):
                        continue
                    changed_instances[inst.name] = inst.lost(
                        InstanceReason.NOT_ON_NODE,
                        f"node {node_name} re-registered without it",
                        now,
                    )
                    self._gone_from_node.add(inst.name)
                    freed = True
            changes += [Change("instances", n, i) for n, i in changed_instances.items()]
            return changes

        changes = await self.repo.mutate(plan)
        if cleanups:
            await self._command(cleanups)
        for node in reapply:
            try:
                await self.link.set_node(
                    node.name, schedulable=node.schedulable, draining=node.draining or None
                )
            except OrkaError as err:
                log.warning("could not re-apply cordon", node=node.name, error=err.message)
        if freed:
            self.queue.cluster_changed()
        if changes or freed:
            self.kick()


class LossDecision(enum.Enum):
    """What step 1 does with one live instance (node_lost_policy)."""

    KEEP = "keep"  # its node is there (or only NOT_READY): nothing to do
    WAIT = "wait"  # its node is lost: DISCONNECTED from now, not replaced yet
    WAITING = "waiting"  # DISCONNECTED, max_disconnect not over yet
    EXPIRED = "expired"  # DISCONNECTED past max_disconnect: LOST, replaced
    LOSE = "lose"  # its node is lost (REPLACE) or left: LOST, replaced


def node_lost_policy(
    spec: WorkloadSpec, inst: Instance, node: Node | None, now: float
) -> LossDecision:
    """Step 1's decision for a live, bound instance. A node that left (drain, SIGTERM) never
    comes back with it, so only a LOST node is waited for. A DISCONNECTED instance is lost once
    max_disconnect has passed even if its node is READY again without reporting it (the node's
    re-registration normally settles it first), or when the policy changed to REPLACE. An
    instance whose node has no record is left alone, as before this policy existed."""
    if inst.phase is InstancePhase.DISCONNECTED:
        if spec.on_node_lost is not OnNodeLost.WAIT or (
            node is not None and node.state is NodeState.LEFT
        ):
            return LossDecision.LOSE
        since = inst.disconnected_at if inst.disconnected_at is not None else now
        if now - since >= spec.max_disconnect:
            return LossDecision.EXPIRED
        return LossDecision.WAITING
    if node is None:
        return LossDecision.KEEP  # no record of its node (yet): nothing says it is gone
    if node.state is NodeState.LOST and spec.on_node_lost is OnNodeLost.WAIT:
        return LossDecision.WAIT
    if node.state in _NODE_GONE:
        return LossDecision.LOSE
    return LossDecision.KEEP


def _unplaced_successor(
    inst: Instance, candidates: Iterable[Instance], claimed: dict[str, Instance]
) -> Instance | None:
    """The replacement of `inst` that was never placed, if any: a PENDING instance of its
    workload not yet asked to stop, preferably of the same replica (ordinal), else the
    newest. None when every replacement is placed: then `inst` was really replaced."""
    best: Instance | None = None
    for c in candidates:
        c = claimed.get(c.name, c)
        if c.phase is not InstancePhase.PENDING or c.desired_stop or c.name == inst.name:
            continue
        key = (c.ordinal == inst.ordinal, c.created_at)
        if best is None or key > (best.ordinal == inst.ordinal, best.created_at):
            best = c
    return best


def _outdated_left(step: WorkloadStep) -> bool:
    """Whether outdated instances remain after the rollout's step: the rollout, not scaling,
    sets the count then."""
    generation = step.workload.generation
    return any(i.generation != generation and active(i) for i in step.current().values())


def _release_replaced(step: WorkloadStep) -> None:
    """Step 2. An instance being replaced (drain, rolling update) stops once its successor
    runs, not before, so the workload never has fewer running than it had. A successor that
    failed or vanished frees its predecessor, which stays and may be replaced again."""
    current = step.current()
    for inst in current.values():
        if inst.replaced_by and not inst.desired_stop and not inst.terminal:
            succ = current.get(inst.replaced_by)
            if succ is None or succ.terminal or succ.desired_stop:
                step.put(inst.hand_over_failed())
            elif succ.phase is InstancePhase.RUNNING:
                step.put(_stop(inst, InstanceReason.REPLACED, successor=succ.name))


def _completed(w: Workload, current: Mapping[str, Instance]) -> list[Instance]:
    """The instances that finished their replica's work for good: succeeded, or failed under
    restart policy NEVER. They count toward the replicas, so none is started in their place."""
    return [
        i
        for i in current.values()
        if not i.desired_stop
        and (
            i.phase is InstancePhase.SUCCEEDED
            or (i.phase is InstancePhase.FAILED and w.spec.restart_policy is RestartPolicy.NEVER)
        )
    ]


# Which active instances a scale-down stops first: those that have done the least (a pending
# one costs nothing to drop; a running one serves), the newest first among equals.
_SCALE_DOWN_ORDER = {
    InstancePhase.PENDING: 0,
    InstancePhase.DISCONNECTED: 1,
    InstancePhase.SCHEDULED: 2,
    InstancePhase.STARTING: 3,
    InstancePhase.RUNNING: 4,
}


def _scale(step: WorkloadStep, done: list[Instance], crash: CrashBackoff | None) -> None:
    """Step 4. Add or stop instances until those serving the workload (active, not being
    replaced) and the completed ones make `replicas`. Additions wait out a crash backoff:
    that is what keeps a spec that fails at start from being placed over and over."""
    w = step.workload
    active = [
        i
        for i in step.current().values()
        if not i.terminal and not i.desired_stop and not i.replaced_by
    ]
    missing = w.spec.replicas - len(active) - len(done)
    if missing > 0 and crash is not None and step.now < crash.not_before:
        missing = 0
    ordinals = Ordinals([*active, *done], w.generation) if missing > 0 else None
    for _ in range(max(0, missing)):
        assert ordinals is not None
        fresh = step.fresh(w, ordinals.take())
        if crash is not None:
            crash.probes.add(fresh.name)
        step.put(fresh)
    if missing < 0:
        if w.spec.volume_template is not None:
            # Replicas with volumes of their own go from the highest ordinal down, so that
            # scaling up again gives each replica back its volume.
            extras = sorted(active, key=lambda i: (-i.ordinal, -i.created_at))[:-missing]
        else:
            extras = sorted(
                active, key=lambda i: (_SCALE_DOWN_ORDER.get(i.phase, 2), -i.created_at)
            )[:-missing]
        for inst in extras:
            step.put(_stop(inst, InstanceReason.SCALED_DOWN))


def _counts_only(stored: WorkloadStatus, status: WorkloadStatus) -> bool:
    """True when the two statuses differ in their counts (`_COUNT_FIELDS`) alone."""
    return stored.model_copy(update={f: getattr(status, f) for f in _COUNT_FIELDS}) == status


def _counts_settled(status: WorkloadStatus) -> bool:
    """True when every count has reached the replicas wanted: the end of a move, shown at once."""
    return all(getattr(status, f) == status.desired for f in _COUNT_FIELDS)


def _stop(inst: Instance, reason: InstanceReason, successor: str = "") -> Instance:
    """Stamped with the wall time the stop is decided (the pass's `now` may be a test clock)."""
    return inst.stop(reason, time.time(), successor)


def _unsettling(node: Node) -> bool:
    """Whether the node's instances keep their workloads from being settled: they are to move
    (draining, leaving) or be lost (the node is)."""
    return node.draining or node.leaving or node.state in _NODE_GONE


def _node_changed(old: Node, new: Node) -> bool:
    return (
        old.state is not new.state
        or old.schedulable != new.schedulable
        or old.draining != new.draining
        or old.leaving != new.leaving
        or old.labels != new.labels
        or old.drivers != new.drivers
        or old.capacity != new.capacity
        or old.allocatable != new.allocatable
        or old.pool != new.pool
        or old.volume_backends != new.volume_backends
        or old.volume_capacity_bytes != new.volume_capacity_bytes
    )
