"""The metrics of orka/metrics.py: values from small builders, read back through Prometheus'
own text format and parser, as a scrape would see them."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from orka import fit, metrics
from orka.controller.events import EventHub
from orka.controller.repo import Change
from orka.errors import Invalid
from orka.models import (
    HealthState,
    Instance,
    InstancePhase,
    Node,
    NodeState,
    Workload,
    WorkloadSpec,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class _Gather(Collector):
    def __init__(self, gather: Callable[[], Iterable[Any]]) -> None:
        self.gather = gather

    def collect(self) -> Iterable[Any]:
        return list(self.gather())


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(*collectors: Collector) -> Samples:
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    return parse(generate_latest(registry).decode())


def v(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


# ---- builders ----


def workload(name: str, generation: int = 1, replicas: int = 1) -> Workload:
    spec = WorkloadSpec(name=name, kind="PROCESS", command=["x"], replicas=replicas)
    return Workload(spec=spec, generation=generation)


def instance(
    name: str,
    workload: str = "web",
    phase: InstancePhase = InstancePhase.RUNNING,
    health: HealthState = HealthState.HEALTHY,
    generation: int = 1,
    **kw: Any,
) -> Instance:
    return Instance(
        name=name, workload=workload, phase=phase, health=health, generation=generation, **kw
    )


def controller(
    nodes: list[Node],
    instances: list[Instance],
    workloads: list[Workload],
    leader: bool = True,
    pending: Iterable[str] = (),
    inflight: Iterable[str] = (),
    hub: EventHub | None = None,
) -> Any:
    repo = SimpleNamespace(
        nodes={n.name: n for n in nodes},
        instances={i.name: i for i in instances},
        workloads={w.spec.name: w for w in workloads},
    )
    queue = SimpleNamespace(pending=dict.fromkeys(pending), inflight=set(inflight))
    return SimpleNamespace(is_leader=leader, repo=repo, queue=queue, events=hub or EventHub())


# ---- controller ----


def test_controller_state_as_gauges() -> None:
    nodes = [
        Node(name="a"),
        Node(name="b"),
        Node(name="c", state=NodeState.LOST),
        Node(name="d", state=NodeState.LEFT),
    ]
    instances = [
        instance("web-1"),
        instance("web-2"),
        instance("web-3", health=HealthState.UNHEALTHY),
        instance("web-4", phase=InstancePhase.PENDING, health=HealthState.UNKNOWN),
        instance("old-1", "old", generation=1),  # old is on generation 2: rolling
        instance("old-2", "old", generation=2),
        instance("done-1", "old", phase=InstancePhase.STOPPED, health=HealthState.UNKNOWN),
    ]
    workloads = [workload("web"), workload("old", generation=2)]
    hub = EventHub()
    hub.subscribe("", 0)
    hub.subscribe("web", 0)
    for i in instances[:3]:
        hub.on_change(Change("instances", i.name, i), None)  # web events: both queue them
    hub.on_change(Change("instances", "old-1", instances[4]), None)  # only the first
    c = controller(nodes, instances, workloads, pending=["web-4"], inflight=["x", "y"], hub=hub)
    s = scrape(_Gather(lambda: metrics.controller_metrics(c)))

    assert v(s, "orka_controller_leader") == 1
    assert {st: v(s, "orka_nodes", state=st) for st in ("READY", "NOT_READY", "LOST", "LEFT")} == {
        "READY": 2,
        "NOT_READY": 0,
        "LOST": 1,
        "LEFT": 1,
    }
    assert v(s, "orka_instances", phase="RUNNING", health="HEALTHY") == 4
    assert v(s, "orka_instances", phase="RUNNING", health="UNHEALTHY") == 1
    assert v(s, "orka_instances", phase="PENDING", health="UNKNOWN") == 1
    assert v(s, "orka_instances", phase="STOPPED", health="UNKNOWN") == 1
    assert v(s, "orka_instances", phase="FAILED", health="UNKNOWN") == 0  # present, zero
    assert sum(val for (n, _), val in s.items() if n == "orka_instances") == len(instances)
    assert v(s, "orka_placement_queue_depth", stage="waiting") == 1
    assert v(s, "orka_placement_queue_depth", stage="in_flight") == 2
    assert v(s, "orka_rollouts_in_progress") == 1
    assert v(s, "orka_watch_subscribers") == 2
    assert v(s, "orka_watch_backlog_events") == 3 + 3 + 1
    backlog = sum(sub.backlog_bytes for sub in hub.subscribers)
    assert backlog > 0 and v(s, "orka_watch_backlog_bytes") == backlog


def test_rollout_done_when_old_generation_is_finished_or_stopping() -> None:
    instances = [
        instance("a", "w", generation=2),
        instance("b", "w", phase=InstancePhase.STOPPED, generation=1),
        instance("c", "w", generation=1, desired_stop=True),
        instance("d", "gone", generation=1),  # its workload is deleted meanwhile
    ]
    assert metrics.rollouts_in_progress(instances, {"w": 2}) == 0
    instances.append(instance("e", "w", generation=1))
    assert metrics.rollouts_in_progress(instances, {"w": 2}) == 1


def test_counting_works_on_copies_taken_when_read() -> None:
    """What the loop reads is what is rendered, even if the cache changes in between."""
    c = controller([Node(name="a")], [instance("web-1")], [workload("web")], pending=["x"])
    render = metrics.controller_view(c)
    c.repo.nodes["b"] = Node(name="b")
    c.repo.instances["web-2"] = instance("web-2")
    c.queue.pending["y"] = None
    s = scrape(_Gather(render))
    assert v(s, "orka_nodes", state="READY") == 1
    assert v(s, "orka_instances", phase="RUNNING", health="HEALTHY") == 1
    assert v(s, "orka_placement_queue_depth", stage="waiting") == 1


def test_follower_reports_only_that_it_follows() -> None:
    c = controller([Node(name="a")], [instance("web-1")], [workload("web")], leader=False)
    s = scrape(_Gather(lambda: metrics.controller_metrics(c)))
    assert v(s, "orka_controller_leader") == 0
    assert not [k for k in s if k[0] in ("orka_nodes", "orka_instances")]


def test_placements_and_restarts_counted_from_committed_changes() -> None:
    registry = metrics.registry_for("controller")
    before = parse(generate_latest(registry).decode())
    pending = instance("web-1", phase=InstancePhase.PENDING, created_at=100.0)
    bound = pending.scheduled("node-1", 100.2)
    metrics.on_change(Change("instances", "web-1", bound), pending)
    # Not a placement: a new PENDING instance, a report, a delete.
    metrics.on_change(Change("instances", "web-2", pending), None)
    again = bound.model_copy(update={"message": "start sent again"})
    metrics.on_change(Change("instances", "web-1", again), bound)  # bound already
    running = bound.model_copy(update={"phase": InstancePhase.RUNNING})
    metrics.on_change(Change("instances", "web-1", running), bound)
    metrics.on_change(Change("instances", "web-1", None), running)
    restarted = running.model_copy(update={"restarts": 3})
    metrics.on_change(Change("instances", "web-1", restarted), running)
    # A count that went down (a node that forgot) is no restart, and no error either.
    fewer = restarted.model_copy(update={"restarts": 1})
    metrics.on_change(Change("instances", "web-1", fewer), restarted)
    after = parse(generate_latest(registry).decode())

    def delta(name: str, **labels: str) -> float:
        return (v(after, name, **labels) or 0.0) - (v(before, name, **labels) or 0.0)

    assert delta("orka_placements_total") == 1
    assert delta("orka_placement_latency_seconds_count") == 1
    assert delta("orka_placement_latency_seconds_sum") == pytest.approx(0.2)
    # 0.2 s lands in the 0.25 s bucket and not in the 0.1 s one.
    assert delta("orka_placement_latency_seconds_bucket", le="0.25") == 1
    assert delta("orka_placement_latency_seconds_bucket", le="0.1") == 0
    assert delta("orka_instance_restarts_total") == 3


def test_unschedulable_counts_each_code_once_per_instance() -> None:
    registry = metrics.registry_for("controller")
    before = parse(generate_latest(registry).decode())

    def rc(code: str, nodes: int) -> fit.ReasonCount:
        return fit.ReasonCount(code, "why", nodes, True)

    metrics.unschedulable(
        {
            "a": [rc("INSUFFICIENT_CPU", 3), rc("NODE_CORDONED", 1)],
            "b": [rc("INSUFFICIENT_CPU", 2), rc("INSUFFICIENT_CPU", 1)],
            "c": [rc("FROM_THE_FUTURE", 1)],
        }
    )
    after = parse(generate_latest(registry).decode())
    name = "orka_unschedulable_attempts_total"

    def delta(reason: str) -> float:
        return (v(after, name, reason=reason) or 0) - (v(before, name, reason=reason) or 0)

    assert delta("INSUFFICIENT_CPU") == 2
    assert delta("NODE_CORDONED") == 1
    assert delta("OTHER") == 1
    assert delta("NO_DRIVER") == 0
    assert v(after, name, reason="FROM_THE_FUTURE") is None  # bounded label values


def test_store_commit_timed() -> None:
    registry = metrics.registry_for("scheduler")
    name = "orka_store_commit_duration_seconds_count"
    before = v(parse(generate_latest(registry).decode()), name, backend="memory") or 0
    metrics.store_committed("memory", time.perf_counter() - 0.01)
    s = parse(generate_latest(registry).decode())
    assert v(s, name, backend="memory") == before + 1


# ---- scheduler and agent ----


def test_scheduler_nodes_and_heartbeat_ages() -> None:
    now = 1000.0
    records = [
        SimpleNamespace(state=NodeState.READY, last_seen=now - 0.2),
        SimpleNamespace(state=NodeState.READY, last_seen=now - 0.9),
        SimpleNamespace(state=NodeState.NOT_READY, last_seen=now - 2.5),
        SimpleNamespace(state=NodeState.LEFT, last_seen=now - 500),  # not counted in ages
    ]
    sched = SimpleNamespace(registry=records, clock=lambda: now)
    s = scrape(_Gather(lambda: metrics.scheduler_metrics(sched)))
    assert v(s, "orka_scheduler_nodes", state="READY") == 2
    assert v(s, "orka_scheduler_nodes", state="NOT_READY") == 1
    assert v(s, "orka_scheduler_nodes", state="LEFT") == 1
    assert v(s, "orka_scheduler_nodes", state="LOST") == 0
    h = "orka_node_heartbeat_age_seconds"
    assert v(s, f"{h}_bucket", le="0.5") == 1
    assert v(s, f"{h}_bucket", le="1.0") == 2
    assert v(s, f"{h}_bucket", le="2.0") == 2
    assert v(s, f"{h}_bucket", le="3.0") == 3
    assert v(s, f"{h}_bucket", le="+Inf") == 3
    assert v(s, f"{h}_count") == 3
    assert v(s, f"{h}_sum") == pytest.approx(3.6)
    assert v(s, "orka_node_heartbeat_age_max_seconds") == pytest.approx(2.5)


def test_agent_instances() -> None:
    sup = [
        SimpleNamespace(phase=InstancePhase.RUNNING, health=HealthState.HEALTHY, restarts=2),
        SimpleNamespace(phase=InstancePhase.RUNNING, health=HealthState.UNHEALTHY, restarts=1),
        SimpleNamespace(phase=InstancePhase.STARTING, health=HealthState.UNKNOWN, restarts=0),
    ]
    agent = SimpleNamespace(instances={str(i): s for i, s in enumerate(sup)})
    s = scrape(_Gather(lambda: metrics.agent_metrics(agent)))
    assert v(s, "orka_agent_instances", phase="RUNNING", health="HEALTHY") == 1
    assert v(s, "orka_agent_instances", phase="RUNNING", health="UNHEALTHY") == 1
    assert v(s, "orka_agent_instances", phase="STARTING", health="UNKNOWN") == 1
    assert v(s, "orka_agent_instance_restarts") == 3


# ---- the loop hop and the endpoint ----


async def test_state_is_read_on_the_loop_and_counted_in_the_scraping_thread() -> None:
    loop_thread = threading.get_ident()
    read_in: list[int] = []
    rendered_in: list[int] = []

    def render() -> Iterable[Any]:
        rendered_in.append(threading.get_ident())
        return metrics.agent_metrics(SimpleNamespace(instances={}))

    def read() -> Callable[[], Iterable[Any]]:
        read_in.append(threading.get_ident())
        return render

    collector = metrics.LoopCollector(asyncio.get_running_loop(), read)
    families = await asyncio.to_thread(lambda: list(collector.collect()))
    assert read_in == [loop_thread]
    assert len(rendered_in) == 1 and rendered_in[0] != loop_thread
    assert [f.name for f in families] == ["orka_agent_instances", "orka_agent_instance_restarts"]


def test_a_stuck_loop_gives_no_state_rather_than_hanging() -> None:
    loop = asyncio.new_event_loop()  # never run: nothing it is given runs
    try:
        collector = metrics.LoopCollector(loop, lambda: lambda: [], timeout=0.2)
        collector._thread = -1  # as if called from the server's thread
        assert list(collector.collect()) == []
    finally:
        loop.close()


async def test_endpoint_serves_role_metrics_and_state() -> None:
    agent = SimpleNamespace(
        instances={
            "x": SimpleNamespace(
                phase=InstancePhase.RUNNING, health=HealthState.HEALTHY, restarts=4
            )
        }
    )
    endpoint = metrics.serve("127.0.0.1:0", "agent", lambda: metrics.agent_view(agent))
    try:

        def get() -> str:
            url = f"http://127.0.0.1:{endpoint.port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode()

        s = parse(await asyncio.to_thread(get))
    finally:
        endpoint.close()
    assert v(s, "orka_agent_instances", phase="RUNNING", health="HEALTHY") == 1
    assert v(s, "orka_agent_instance_restarts") == 4
    assert (v(s, "process_resident_memory_bytes") or 0) > 0
    # The agent serves no RPCs: no controller or RPC counters stuck at zero.
    assert not [k for k in s if k[0].startswith(("orka_rpc", "orka_placements"))]


@pytest.mark.parametrize("value", ["9100", ":9100", "127.0.0.1", "127.0.0.1:x", "h:70000", ""])
def test_listen_address_must_be_host_and_port(value: str) -> None:
    with pytest.raises(Invalid, match="--metrics-listen"):
        metrics.check_listen(value)


def test_listen_address_forms() -> None:
    assert metrics.check_listen("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert metrics.check_listen("[::1]:0") == ("::1", 0)


def test_address_in_use_is_a_flag_error() -> None:
    first = metrics.serve("127.0.0.1:0", "agent")
    try:
        with pytest.raises(Invalid, match=r"--metrics-listen: cannot listen on 127\.0\.0\.1:"):
            metrics.serve(f"127.0.0.1:{first.port}", "agent")
    finally:
        first.close()


@pytest.mark.parametrize("service", ["controller", "scheduler", "agent"])
def test_service_refuses_a_bad_flag(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    from orka.cli.main import main

    assert main([service, "--metrics-listen", "everywhere"]) == 2
    assert "--metrics-listen: 'everywhere' is not HOST:PORT" in capsys.readouterr().err
