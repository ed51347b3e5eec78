"""Health in the CLI's output: the HEALTH column of `get instances`, HEALTHY of `get
workloads`, the health lines of `describe`, and the same fields in json and yaml."""

from __future__ import annotations

import json

import pytest
import yaml

from orka.cli import output
from orka.models import HealthState, Instance, InstancePhase, Workload, WorkloadSpec

NOW = 1_795_000_000.0
FAILURE = "http GET /ok on 127.0.0.1:41002: status 404 (want 200-399)"


def instance(health: HealthState, message: str = "", since: float | None = None) -> Instance:
    return Instance(
        name="web-1",
        workload="web",
        node="node-1",
        phase=InstancePhase.RUNNING,
        restarts=2,
        health=health,
        health_message=message,
        health_changed_at=since,
        created_at=NOW - 60,
    )


def checked_workload() -> Workload:
    w = Workload(
        spec=WorkloadSpec.model_validate(
            {
                "name": "web",
                "kind": "PROCESS",
                "command": ["x"],
                "replicas": 3,
                "ports": [{"name": "http"}],
                "health_check": {
                    "http": {"port": "http", "path": "/ok"},
                    "interval": 5,
                    "timeout": 0.5,
                    "failure_threshold": 2,
                },
            }
        ),
        created_at=NOW - 30,
    )
    w.status.desired, w.status.running, w.status.healthy = 3, 3, 2
    return w


@pytest.mark.parametrize("health", list(HealthState))
def test_instances_table_has_a_health_column(health: HealthState) -> None:
    header, row = output.instances_table([instance(health)], NOW).splitlines()
    columns = header.split()
    assert columns[6:8] == ["HEALTH", "RESTARTS"]
    # ADDRESS and PORTS are <none> here: the row splits like the header.
    assert row.split()[6:8] == [health.value, "2"]


def test_workloads_table_counts_the_healthy() -> None:
    header, row = output.workloads_table([checked_workload()], NOW).splitlines()
    assert header.split() == ["NAME", "KIND", "DESIRED", "PLACED", "RUNNING", "HEALTHY", "AGE"]
    assert row.split() == ["web", "PROCESS", "3", "0", "3", "2", "30s"]


def test_describe_instance_shows_the_health_and_the_last_failure() -> None:
    lines = output.describe_instance(instance(HealthState.UNHEALTHY, FAILURE, NOW - 90), NOW)
    assert "Health:       UNHEALTHY for 90s" in lines.splitlines()
    assert f"Last failure: {FAILURE}" in lines.splitlines()
    healthy = output.describe_instance(instance(HealthState.HEALTHY), NOW).splitlines()
    assert "Health:       HEALTHY" in healthy
    assert "Last failure: <none>" in healthy


def test_describe_workload_shows_the_check_and_the_healthy_count() -> None:
    lines = output.describe_workload(checked_workload(), [], NOW).splitlines()
    assert (
        "Health check:   http GET /ok on http (status 200-399) every 5s (timeout 0.5s, first"
        " after 0s; unhealthy after 2 failures, healthy after 1 successes)"
    ) in lines
    assert "Status:         desired 3, placed 0, running 3, healthy 2" in lines
    plain = Workload(spec=WorkloadSpec(name="a", kind="PROCESS", command=["x"]))
    assert "Health check:   <none>" in output.describe_workload(plain, [], NOW).splitlines()


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_json_and_yaml_show_health_as_the_api_does(fmt: str) -> None:
    load = json.loads if fmt == "json" else yaml.safe_load
    shown = load(output.dump(instance(HealthState.UNHEALTHY, FAILURE, NOW), fmt))
    assert (shown["health"], shown["health_message"]) == ("UNHEALTHY", FAILURE)
    assert shown["health_time"] == "2026-11-18T11:06:40Z"
    assert "health_changed_at" not in shown
    (w,) = load(output.dump([checked_workload()], fmt))
    assert w["status"]["healthy"] == 2
    assert w["spec"]["health_check"] == {
        "http": {"port": "http", "path": "/ok", "status_min": 200, "status_max": 399},
        "interval": "5s",
        "timeout": "0.5s",
        "initial_delay": "0s",
        "failure_threshold": 2,
        "success_threshold": 1,
    }
