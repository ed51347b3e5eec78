"""Health checks (orka/agent/health.py and their wiring in orka/agent/supervisor.py).

The verdict's state machine and the checker's timing run on a scripted probe and a clock the
test drives; the probes themselves on real loopback sockets (port 0); the supervisor's
restart on unhealthy with the fake driver and a real listener the test closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from orka.agent import health
from orka.agent.health import Checker, CheckState, http_probe, target, tcp_probe
from orka.agent.supervisor import UNHEALTHY_REASON, Supervised
from orka.models import (
    HealthCheck,
    HealthState,
    InstancePhase,
    PortBinding,
    RestartPolicy,
    WorkloadKind,
    WorkloadSpec,
)
from orka.runtime.fake import FakeDriver
from tests.waits import until

U, H, X = HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY


def _check(**kw: object) -> HealthCheck:
    return HealthCheck.model_validate({"tcp": {"port": "1"}, **kw})


# ---- the verdict ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "successes", "results", "verdicts"),
    [
        # Defaults: 3 failures in a row, 1 success.
        (3, 1, "ffpfff", [U, U, H, H, H, X]),
        (3, 1, "pffpff", [H, H, H, H, H, H]),
        (1, 1, "fpf", [X, H, X]),
        # Two successes needed: a failure between resets the count.
        (1, 2, "fpfpp", [X, X, X, X, H]),
        (2, 3, "pppffpp", [U, U, H, H, X, X, X]),
    ],
)
def test_thresholds_count_results_in_a_row(
    failures: int, successes: int, results: str, verdicts: list[HealthState]
) -> None:
    state = CheckState(_check(failure_threshold=failures, success_threshold=successes))
    seen = []
    changes = []
    for i, r in enumerate(results):
        change = state.record(None if r == "p" else f"failure {i}")
        seen.append(state.health)
        if change is not None:
            changes.append(change)
    assert seen == verdicts
    # A verdict is returned once, when it changes.
    assert changes == [v for i, v in enumerate(verdicts) if v != ([U, *verdicts][i])]


def test_the_last_failure_is_kept_and_cut() -> None:
    state = CheckState(_check(failure_threshold=2))
    state.record("first")
    assert state.record("x" * 2000) is X
    assert state.last_failure == "x" * health.MAX_FAILURE_MESSAGE


# ---- the checker's timing ---------------------------------------------------------------


@dataclass
class Clock:
    now: float = 0.0
    slept: list[float] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def sleep(self, delay: float) -> None:
        self.slept.append(round(delay, 6))
        self.now += delay
        self.wake.set()
        await asyncio.sleep(0)


class ScriptedProbe:
    """Each call takes `took` seconds on the clock and returns the next scripted result."""

    def __init__(self, clock: Clock, results: list[str | None], took: float = 0.0) -> None:
        self.clock, self.results, self.took, self.calls = clock, list(results), took, 0
        self.done = asyncio.Event()

    async def __call__(self) -> str | None:
        self.calls += 1
        self.clock.now += self.took
        if not self.results:
            self.done.set()
            await asyncio.Event().wait()  # the script is used up: hang until cancelled
        return self.results.pop(0)


async def _run_script(
    check: HealthCheck, results: list[str | None], took: float = 0.0, jitter: float = 0.5
) -> tuple[Clock, list[tuple[HealthState, str]], ScriptedProbe]:
    clock = Clock()
    probe = ScriptedProbe(clock, results, took)
    verdicts: list[tuple[HealthState, str]] = []
    checker = Checker(
        "i",
        check,
        probe,
        lambda h, m: verdicts.append((h, m)),
        sleep=clock.sleep,
        clock=lambda: clock.now,
        jitter=lambda: jitter,
    )
    checker.start()
    await asyncio.wait_for(probe.done.wait(), 5)
    checker.stop()
    return clock, verdicts, probe


async def test_first_probe_waits_the_initial_delay_plus_jitter_then_each_interval() -> None:
    check = _check(interval=10, timeout=1, initial_delay=30, failure_threshold=2)
    # Each probe takes 1.5 s: the next starts `interval` after the last one started.
    clock, verdicts, _ = await _run_script(check, [None, "a", "b", None], took=1.5, jitter=0.25)
    # The jitter spreads the first probe over at most FIRST_PROBE_SPREAD (2 s) here.
    assert clock.slept == [30.5, 8.5, 8.5, 8.5, 8.5]
    assert verdicts == [(H, ""), (X, "b"), (H, "")]


async def test_a_probe_slower_than_the_interval_starts_the_next_at_once() -> None:
    check = _check(interval=1, timeout=1)
    clock, _, _ = await _run_script(check, [None, None], took=3.0, jitter=0.0)
    assert clock.slept == [0.0, 0.0, 0.0]


async def test_a_probe_over_its_timeout_fails_with_the_timeout_in_the_message() -> None:
    async def hangs() -> str | None:
        await asyncio.sleep(10)
        return None

    checker = Checker("i", _check(interval=1, timeout=0.05), hangs, lambda h, m: None)
    assert await checker.probe_once() == "tcp check timed out after 0.05s"


async def test_a_probe_error_fails_the_check_not_the_checker() -> None:
    async def breaks() -> str | None:
        raise ConnectionResetError(104, "Connection reset by peer")

    checker = Checker("i", _check(), breaks, lambda h, m: None)
    assert await checker.probe_once() == "tcp check: Connection reset by peer"


# ---- where probes go --------------------------------------------------------------------

_PORTS = [PortBinding(name="web", port=8080, host_port=31000)]


@pytest.mark.parametrize(
    ("port", "address", "host_ip", "expected"),
    [
        # An address of its own: its own port there.
        ("web", "10.88.0.5", "192.0.2.1", ("10.88.0.5", 8080)),
        ("9000", "10.88.0.5", "192.0.2.1", ("10.88.0.5", 9000)),
        # On the host's network: its host port at the node's address, loopback for a wildcard.
        ("web", "", "192.0.2.1", ("192.0.2.1", 31000)),
        ("web", "", "", ("127.0.0.1", 31000)),
        ("web", "", "0.0.0.0", ("127.0.0.1", 31000)),
        ("web", "", "::", ("::1", 31000)),
        ("9000", "", "", ("127.0.0.1", 9000)),
        ("db", "", "", "the instance has no port named 'db'"),
    ],
)
def test_target(port: str, address: str, host_ip: str, expected: object) -> None:
    assert target(port, address, host_ip, _PORTS) == expected


def test_a_host_network_port_without_a_number_yet_is_a_failure() -> None:
    assert target("web", "", "", [PortBinding(name="web")]) == "port 'web' has no number yet"


# ---- the probes on real sockets ---------------------------------------------------------


@contextlib.asynccontextmanager
async def http_server(
    respond: Callable[[bytes], bytes],
) -> AsyncIterator[tuple[int, list[bytes]]]:
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        requests.append(request)
        writer.write(respond(request))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], requests


async def test_http_probe_passes_on_a_status_in_range_and_sends_a_plain_get() -> None:
    async with http_server(lambda r: b"HTTP/1.1 204 No Content\r\n\r\n") as (port, requests):
        assert await http_probe("127.0.0.1", port, "/healthz?x=1", 200, 299) is None
    assert requests[0].startswith(b"GET /healthz?x=1 HTTP/1.0\r\nHost: 127.0.0.1:")


@pytest.mark.parametrize(
    ("response", "low", "high", "failure"),
    [
        (b"HTTP/1.1 404 Not Found\r\n\r\n", 200, 399, "status 404 (want 200-399)"),
        (b"HTTP/1.1 302 Found\r\n\r\n", 200, 299, "status 302 (want 200-299)"),
        (b"SSH-2.0-OpenSSH\r\n", 200, 399, "not an HTTP response ('SSH-2.0-OpenSSH')"),
        (b"", 200, 399, "no response"),
        (b"HTTP/1.1 200 " + b"x" * 5000 + b"\r\n", 200, 399, "status line longer than 4096"),
    ],
)
async def test_http_probe_failures_say_what_came_back(
    response: bytes, low: int, high: int, failure: str
) -> None:
    async with http_server(lambda r: response) as (port, _):
        got = await http_probe("127.0.0.1", port, "/", low, high)
    assert got is not None
    assert got.startswith(f"http GET / on 127.0.0.1:{port}: {failure}")


async def _closed_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port


async def test_tcp_probe_passes_on_a_listener_and_fails_when_refused() -> None:
    async with http_server(lambda r: b"") as (port, _):
        assert await tcp_probe("127.0.0.1", port) is None
    closed = await _closed_port()
    assert await tcp_probe("127.0.0.1", closed) == (
        f"tcp connect to 127.0.0.1:{closed}: Connection refused"
    )


# ---- the supervisor acting on verdicts --------------------------------------------------


def _spec(port: int, policy: RestartPolicy = RestartPolicy.ALWAYS) -> WorkloadSpec:
    return WorkloadSpec(
        name="w",
        kind=WorkloadKind.PROCESS,
        command=["serve"],
        restart_policy=policy,
        health_check={"tcp": {"port": port}, "interval": 0.1, "timeout": 0.1},
    )


async def _no_backoff(delay: float) -> None:
    await asyncio.sleep(0)


async def test_an_unhealthy_instance_is_restarted_with_the_reason_and_becomes_healthy_again() -> (
    None
):
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reports: list[tuple[InstancePhase, str, HealthState, str, str]] = []
    inst = Supervised(
        "w-1",
        1,
        _spec(port),
        FakeDriver(),
        lambda s: reports.append((s.phase, s.reason, s.health, s.health_message, s.message)),
        sleep=_no_backoff,
    )
    assert inst.checked
    inst.start()
    try:
        await until(lambda: inst.health is H, 5.0)
        assert inst.phase is InstancePhase.RUNNING and inst.restarts == 0
        server.close()
        await server.wait_closed()
        await until(lambda: inst.restarts == 1, 5.0)
        unhealthy = [r for r in reports if r[2] is X]
        assert unhealthy and unhealthy[0][0] is InstancePhase.RUNNING
        assert unhealthy[0][3] == f"tcp connect to 127.0.0.1:{port}: Connection refused"
        restart = next(r for r in reports if r[1] == UNHEALTHY_REASON)
        assert restart[0] is InstancePhase.STARTING and restart[2] is U
        assert restart[4] == (
            f"health check failed: tcp connect to 127.0.0.1:{port}: Connection refused;"
            " restarting in 1s"
        )
        # Listening again, the restarted instance turns healthy.
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        await until(lambda: inst.health is H and inst.phase is InstancePhase.RUNNING, 5.0)
        assert inst.restarts == 1 and inst.health_message == ""
    finally:
        await inst.stop(remove=True)
        server.close()


async def test_under_never_an_unhealthy_instance_keeps_running() -> None:
    port = await _closed_port()
    inst = Supervised(
        "w-1", 1, _spec(port, RestartPolicy.NEVER), FakeDriver(), lambda s: None, sleep=_no_backoff
    )
    inst.start()
    try:
        await until(lambda: inst.health is X, 5.0)
        await asyncio.sleep(0.3)
        assert inst.phase is InstancePhase.RUNNING and inst.restarts == 0
        assert inst.report().health is X
        assert inst.report().health_message == (
            f"tcp connect to 127.0.0.1:{port}: Connection refused"
        )
    finally:
        await inst.stop(remove=True)


async def test_a_stopped_instance_stops_its_checker() -> None:
    port = await _closed_port()
    inst = Supervised("w-1", 1, _spec(port), FakeDriver(), lambda s: None, sleep=_no_backoff)
    inst.start()
    await until(lambda: inst.phase is InstancePhase.RUNNING, 5.0)
    checker = inst._checker
    assert checker is not None and checker.running
    await inst.stop(remove=True)
    assert inst._checker is None and not checker.running
    assert inst.health is U


class ExecDriver(FakeDriver):
    """Answers exec checks from a script: (exit code, output) per call."""

    def __init__(self, answers: list[tuple[int, str]]) -> None:
        super().__init__()
        self.answers = answers
        self.commands: list[list[str]] = []

    async def check_exec(
        self, instance: str, spec: WorkloadSpec, command: list[str]
    ) -> tuple[int, str]:
        self.commands.append(command)
        return self.answers.pop(0) if self.answers else (0, "")


async def test_an_exec_check_fails_on_a_nonzero_exit_with_its_output() -> None:
    driver = ExecDriver([(0, ""), (1, "not\nready  yet\n")])
    spec = WorkloadSpec(
        name="w",
        kind=WorkloadKind.PROCESS,
        command=["serve"],
        restart_policy=RestartPolicy.NEVER,
        health_check={
            "exec": {"command": ["test", "-e", "ready"]},
            "interval": 0.1,
            "timeout": 0.1,
            "failure_threshold": 1,
        },
    )
    inst = Supervised("w-1", 1, spec, driver, lambda s: None, sleep=_no_backoff)
    inst.start()
    try:
        await until(lambda: inst.health is X, 5.0)
        assert inst.health_message == "exec test: exited with code 1: not ready yet"
        assert driver.commands[:2] == [["test", "-e", "ready"]] * 2
    finally:
        await inst.stop(remove=True)
