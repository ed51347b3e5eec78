"""Prometheus metrics of every service, and the endpoint that serves them (`--metrics-listen`).

Two kinds, by how they are kept (Prometheus' own advice for instrumenting a program):
- counters and histograms are updated where the event happens (an RPC ends, a store commit
  returns, an instance is bound): module-level objects here, one call at the event point;
- gauges of state the service already holds (nodes by state, instances by phase, the
  placement queue, watch subscribers) are computed when scraped, by a collector over that
  state, so nothing is updated on every change for a gauge nobody may read.

The endpoint is prometheus_client's own HTTP server, on its thread: a scrape never waits on
the event loop's turn to parse and answer. The state collectors read asyncio-owned state,
so they run their reading on the loop (`LoopCollector`) and the thread waits for it.
The endpoint has no TLS and no authentication: bind it to loopback or a private network.

Nothing is registered globally: each service builds its registry when it starts serving,
with the event metrics of its role and its own state collector, so an agent's endpoint
shows no controller counters stuck at zero, and tests can run several services in one
process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from orka import fit
from orka.errors import Invalid
from orka.models import HealthState, Instance, InstancePhase, Node, NodeState, Workload

if TYPE_CHECKING:
    from orka.agent.service import Agent
    from orka.controller.repo import Change
    from orka.controller.service import Controller
    from orka.scheduler.service import Scheduler

log = structlog.get_logger("orka.metrics")

# No `_created` series beside each counter and histogram: a scrape's size halves, and
# Prometheus' text format does not use them.
disable_created_metrics()

# Latencies of a control plane: from a millisecond (a local store commit) to minutes (an
# instance waiting for room). Prometheus' default buckets stop at 10 s.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
# How long ago each node was last heard from: the scheduler marks one NOT_READY after two
# heartbeat intervals (1 s by default) and LOST after node_lost_after (5 s).
HEARTBEAT_AGE_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0)

# ---- event metrics (registry=None: a service registers those of its role when it serves) ----

RPCS = Counter(
    "orka_rpc_requests",
    "gRPC calls served, by service, method and status code (streams count when they end)",
    ["service", "method", "code"],
    registry=None,
)
RPC_SECONDS = Histogram(
    "orka_rpc_duration_seconds",
    "Time from a gRPC call's start to its end, by service and method (a stream's whole life)",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
STORE_COMMIT_SECONDS = Histogram(
    "orka_store_commit_duration_seconds",
    "Time a store takes to apply one atomic commit (a batch of writes), by backend",
    ["backend"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
PLACEMENTS = Counter(
    "orka_placements",
    "Instances bound to a node (the binding committed to the store)",
    registry=None,
)
PLACEMENT_SECONDS = Histogram(
    "orka_placement_latency_seconds",
    "Time from an instance's creation (PENDING) to its binding to a node being committed",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
UNSCHEDULABLE = Counter(
    "orka_unschedulable_attempts",
    "Placement attempts that found no node for an instance, by reason code (an attempt whose "
    "nodes refused for several reasons counts once under each)",
    ["reason"],
    registry=None,
)
RESTARTS = Counter(
    "orka_instance_restarts",
    "Instance restarts on their node, as the agents' reports tell the controller",
    registry=None,
)

# One child per label value made once: the hot paths skip the label lookup.
_STORE_CHILDREN = {b: STORE_COMMIT_SECONDS.labels(b) for b in ("sqlite", "etcd", "memory")}
_UNSCHEDULABLE_CHILDREN = {c.value: UNSCHEDULABLE.labels(c.value) for c in fit.Code}
# A code this build does not know (a newer scheduler's): one bounded label for all of them.
OTHER_REASON = "OTHER"


def store_commit(backend: str) -> Any:
    """The timer of one store commit: `with store_commit("sqlite"): ...`."""
    return _STORE_CHILDREN[backend].time()


def store_committed(backend: str, start: float) -> None:
    """A commit that began at `start` (time.perf_counter()) has been applied."""
    _STORE_CHILDREN[backend].observe(time.perf_counter() - start)


def unschedulable(why: Mapping[str, Sequence[fit.ReasonCount]]) -> None:
    """Count each unplaced instance once under each reason code its nodes gave."""
    for counts in why.values():
        for code in {c.code for c in counts}:
            child = _UNSCHEDULABLE_CHILDREN.get(code)
            if child is None:
                child = UNSCHEDULABLE.labels(OTHER_REASON)
            child.inc()


def on_change(change: Change, old: Any) -> None:
    """A repo listener on the controller: bindings and restarts as they are committed."""
    new = change.value
    if not isinstance(new, Instance) or not isinstance(old, Instance):
        return
    if old.phase is InstancePhase.PENDING and new.phase is InstancePhase.SCHEDULED:
        PLACEMENTS.inc()
        PLACEMENT_SECONDS.observe(max(0.0, (new.scheduled_at or 0.0) - new.created_at))
    if new.restarts > old.restarts:
        RESTARTS.inc(new.restarts - old.restarts)


# ---- state collectors ----


# What a state collector renders: the families, computed from copies taken on the loop.
Render = Callable[[], Iterable[Metric]]
# What it runs on the loop: copies what it needs (references to the immutable models, a few
# numbers) and returns the Render that counts them. Copying the references of 100,000
# instances takes about a millisecond; counting them, tens: that part runs in the scraping
# thread, so a large cluster's scrape never holds the loop for it.
Read = Callable[[], Render]


class LoopCollector(Collector):
    """Runs `read` on the event loop that owns the state it reads, however it is called:
    prometheus_client's server thread calls collect(), and the loop mutates that state.
    The Render it returns runs in the calling thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        read: Read,
        timeout: float = 10.0,
    ) -> None:
        self.loop = loop
        self.read = read
        self.timeout = timeout
        self._thread = threading.get_ident()

    def collect(self) -> Iterable[Metric]:
        if threading.get_ident() == self._thread:
            return list(self.read()())  # already on the loop (a test, or a registry's check)
        future: concurrent.futures.Future[Render] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.read())
                except BaseException as exc:
                    future.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(run)
            render = future.result(self.timeout)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            # The loop is closing or stuck: answer with the event metrics alone.
            future.cancel()
            log.warning("metrics: state not collected", error=repr(exc))
            return []
        return list(render())


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def nodes_by_state(states: Iterable[NodeState], name: str, doc: str) -> GaugeMetricFamily:
    counts = dict.fromkeys(NodeState, 0)
    for state in states:
        counts[state] += 1
    family = gauge(name, doc, ["state"])
    for state, n in counts.items():
        family.add_metric([state.value], n)
    return family


def instances_by_phase(
    items: Iterable[tuple[InstancePhase, HealthState]], name: str, doc: str
) -> GaugeMetricFamily:
    """Every phase and health, zeros included: series that come and go read as gaps."""
    counts = {(p, h): 0 for p in InstancePhase for h in HealthState}
    for key in items:
        counts[key] += 1
    family = gauge(name, doc, ["phase", "health"])
    for (phase, health), n in counts.items():
        family.add_metric([phase.value, health.value], n)
    return family


def controller_view(controller: Controller) -> Render:
    """Read on the loop: the leader's cache as lists of its (immutable) models."""
    if not controller.is_leader:
        # A follower's cache is empty: its zeros would read as an empty cluster.
        return lambda: [_leader(False)]
    repo = controller.repo
    nodes = list(repo.nodes.values())
    instances = list(repo.instances.values())
    workloads = list(repo.workloads.values())
    queue = (len(controller.queue.pending), len(controller.queue.inflight))
    watchers = [(s.queue.qsize(), s.backlog_bytes) for s in controller.events.subscribers]
    return lambda: _controller_families(nodes, instances, workloads, queue, watchers)


def controller_metrics(controller: Controller) -> Iterable[Metric]:
    return controller_view(controller)()


def _leader(leader: bool) -> GaugeMetricFamily:
    family = gauge("orka_controller_leader", "1 while this controller leads, else 0")
    family.add_metric([], 1 if leader else 0)
    return family


def _controller_families(
    nodes: Sequence[Node],
    instances: Sequence[Instance],
    workloads: Sequence[Workload],
    queue: tuple[int, int],
    watchers: Sequence[tuple[int, int]],
) -> Iterable[Metric]:
    yield _leader(True)
    yield nodes_by_state(
        (n.state for n in nodes), "orka_nodes", "Nodes known to the cluster, by state"
    )
    yield instances_by_phase(
        ((i.phase, i.health) for i in instances),
        "orka_instances",
        "Instances in the store (finished ones kept as history included), by phase and health",
    )
    family = gauge(
        "orka_placement_queue_depth",
        "PENDING instances the placement queue holds: waiting for a batch (backoff included)"
        " or in a batch at the scheduler",
        ["stage"],
    )
    family.add_metric(["waiting"], queue[0])
    family.add_metric(["in_flight"], queue[1])
    yield family
    family = gauge(
        "orka_rollouts_in_progress",
        "Workloads with a live instance of an older generation than the workload's",
    )
    generations = {w.spec.name: w.generation for w in workloads}
    family.add_metric([], rollouts_in_progress(instances, generations))
    yield family
    family = gauge("orka_watch_subscribers", "Open WatchEvents streams")
    family.add_metric([], len(watchers))
    yield family
    family = gauge(
        "orka_watch_backlog_events", "Events queued for watchers and not yet sent, summed"
    )
    family.add_metric([], sum(events for events, _ in watchers))
    yield family
    family = gauge(
        "orka_watch_backlog_bytes", "Serialized size of the events queued for watchers, summed"
    )
    family.add_metric([], sum(size for _, size in watchers))
    yield family


def rollouts_in_progress(instances: Iterable[Instance], generations: Mapping[str, int]) -> int:
    """Workloads not yet fully on their current generation: some instance still alive (not
    finished, not being stopped) is of another. The rollout slice may compute this from its
    own rollout state instead; the gauge's name and meaning stay."""
    outdated: set[str] = set()
    for inst in instances:
        if inst.workload in outdated or inst.terminal or inst.desired_stop:
            continue
        generation = generations.get(inst.workload)
        if generation is not None and inst.generation != generation:
            outdated.add(inst.workload)
    return len(outdated)


def scheduler_view(scheduler: Scheduler) -> Render:
    """Read on the loop: each node's state and when it was last heard from."""
    now = scheduler.clock()
    seen = [(r.state, r.last_seen) for r in scheduler.registry]
    return lambda: _scheduler_families(seen, now)


def scheduler_metrics(scheduler: Scheduler) -> Iterable[Metric]:
    return scheduler_view(scheduler)()


def _scheduler_families(seen: Sequence[tuple[NodeState, float]], now: float) -> Iterable[Metric]:
    yield nodes_by_state(
        (state for state, _ in seen),
        "orka_scheduler_nodes",
        "Nodes in the scheduler's live registry, by state",
    )
    ages = [max(0.0, now - last) for state, last in seen if state is not NodeState.LEFT]
    yield heartbeat_histogram(ages)
    family = gauge(
        "orka_node_heartbeat_age_max_seconds",
        "Time since the least recently heard node (not LEFT) sent anything (0: none)",
    )
    family.add_metric([], max(ages, default=0.0))
    yield family


def heartbeat_histogram(ages: Sequence[float]) -> HistogramMetricFamily:
    """A histogram computed at scrape time: one series per bucket, however many nodes."""
    buckets: list[tuple[str, float]] = []
    for bound in HEARTBEAT_AGE_BUCKETS:
        buckets.append((repr(bound), sum(1 for a in ages if a <= bound)))
    buckets.append(("+Inf", len(ages)))
    return HistogramMetricFamily(
        "orka_node_heartbeat_age_seconds",
        "Time since each node (not LEFT) was last heard from, as of the scrape",
        buckets=buckets,
        sum_value=sum(ages),
    )


def agent_view(agent: Agent) -> Render:
    """Read on the loop: each supervised instance's phase, health and restarts."""
    states = [(s.phase, s.health, s.restarts) for s in agent.instances.values()]
    return lambda: _agent_families(states)


def agent_metrics(agent: Agent) -> Iterable[Metric]:
    return agent_view(agent)()


def _agent_families(
    states: Sequence[tuple[InstancePhase, HealthState, int]],
) -> Iterable[Metric]:
    yield instances_by_phase(
        ((phase, health) for phase, health, _ in states),
        "orka_agent_instances",
        "Instances this agent supervises, by phase and health",
    )
    family = gauge(
        "orka_agent_instance_restarts",
        "Restarts of the instances this agent supervises now, summed",
    )
    family.add_metric([], sum(restarts for _, _, restarts in states))
    yield family


# ---- the endpoint ----

_ROLE_METRICS: dict[str, tuple[Collector, ...]] = {
    "controller": (
        RPCS,
        RPC_SECONDS,
        STORE_COMMIT_SECONDS,
        PLACEMENTS,
        PLACEMENT_SECONDS,
        UNSCHEDULABLE,
        RESTARTS,
    ),
    "scheduler": (RPCS, RPC_SECONDS, STORE_COMMIT_SECONDS),
    "agent": (),
}


def registry_for(role: str, state: Collector | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    for collector in _ROLE_METRICS[role]:
        registry.register(collector)
    if state is not None:
        registry.register(state)
    return registry


def check_listen(value: str) -> tuple[str, int]:
    """HOST:PORT for --metrics-listen (port 0: any free one); Invalid naming the flag when it
    is not one. The host is required: the endpoint has no TLS, so where it listens is said,
    never defaulted to every interface."""
    host, sep, port = value.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise Invalid(
            f"--metrics-listen: {value[:100]!r} is not HOST:PORT (127.0.0.1:9100 keeps the "
            "endpoint, which has no TLS, on this machine)"
        )
    return host, int(port)


@dataclass
class Endpoint:
    """A running metrics endpoint; `close()` stops its server thread."""

    server: Any
    thread: threading.Thread
    port: int

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)


def serve(
    listen: str,
    role: str,
    read: Read | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Endpoint:
    """Serve `role`'s metrics at http://HOST:PORT/ (any path) on a thread of its own.

    `read` reads the service's state on `loop` (the running one by default)."""
    host, port = check_listen(listen)
    state = None
    if read is not None:
        state = LoopCollector(loop or asyncio.get_running_loop(), read)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry_for(role, state))
    except OSError as e:
        raise Invalid(f"--metrics-listen: cannot listen on {listen}: {e.strerror or e}") from None
    bound = server.server_port
    log.info("metrics endpoint listening", address=host, port=bound)
    return Endpoint(server, thread, bound)
