"""The restart policy and its backoff (orka/agent/supervisor.py), on a clock the test drives.

A scripted driver plays each run: it exits with a given code after a given time on the test's
clock (or fails to start). The supervisor's backoff sleeps go to that clock, which records each
delay and moves time on, so a 30 s backoff costs nothing and the exact sequence is asserted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import structlog.testing

from orka.agent.supervisor import BACKOFF_MAX, HEALTHY_RUN, Supervised
from orka.errors import Invalid, RuntimeFailure
from orka.models import (
    HealthState,
    InstancePhase,
    InstanceReport,
    RestartPolicy,
    WorkloadKind,
    WorkloadSpec,
)
from orka.runtime.base import RunSpec, TaskInfo, TaskState
from orka.runtime.fake import FakeDriver


@dataclass
class Clock:
    now: float = 1000.0
    slept: list[float] = field(default_factory=list)

    async def sleep(self, delay: float) -> None:
        self.slept.append(delay)
        self.now += delay
        await asyncio.sleep(0)


@dataclass
class Run:
    """One start: it fails to start (start_error), or runs `ran` seconds and exits `code`."""

    code: int | None = 1
    ran: float = 1.0
    start_error: str = ""
    # The driver's own reason for the exit (OOMKilled) and its message.
    reason: str = ""
    message: str = ""


class ScriptedDriver(FakeDriver):
    """The fake driver's health, usage and logs; its runs come from the script."""

    name = "scripted"

    def __init__(self, clock: Clock, runs: list[Run]) -> None:
        super().__init__()
        self.clock = clock
        self.runs = list(runs)
        self.starts = 0
        self.removed: list[str] = []
        self.current: Run | None = None
        # Set when the script is used up and the last run goes on for ever.
        self.idle = asyncio.Event()

    def _info(self, run: RunSpec | None, state: TaskState, **kw: object) -> TaskInfo:
        return TaskInfo(instance="i", workload="w", driver=self.name, state=state, **kw)  # type: ignore[arg-type]

    async def start(self, run: RunSpec) -> TaskInfo:
        self.starts += 1
        self.current = self.runs.pop(0) if self.runs else None
        if self.current is not None and self.current.start_error:
            raise RuntimeFailure(self.current.start_error)
        return self._info(run, TaskState.RUNNING, started_at=self.clock.now)

    async def wait(self, instance: str) -> TaskInfo:
        if self.current is None:
            self.idle.set()
            await asyncio.Event().wait()
        assert self.current is not None
        started = self.clock.now
        self.clock.now += self.current.ran
        return self._info(
            None,
            TaskState.EXITED,
            exit_code=self.current.code,
            reason=self.current.reason,
            message=self.current.message,
            started_at=started,
            finished_at=self.clock.now,
        )

    async def stop(self, instance: str, grace: float) -> TaskInfo:
        return self._info(None, TaskState.EXITED, exit_code=0, started_at=self.clock.now)

    async def remove(self, instance: str, keep_network: bool = False) -> None:
        self.removed.append(instance)

    async def list(self) -> list[TaskInfo]:
        return []


@dataclass
class Played:
    sup: Supervised
    driver: ScriptedDriver
    clock: Clock
    messages: list[str]


async def play(policy: RestartPolicy, runs: list[Run]) -> Played:
    """Run the supervisor until it gives up (a final phase) or the script is used up."""
    clock = Clock()
    driver = ScriptedDriver(clock, runs)
    spec = WorkloadSpec(name="w", kind=WorkloadKind.PROCESS, command=["x"], restart_policy=policy)
    messages: list[str] = []
    sup = Supervised(
        "w-0",
        1,
        spec,
        driver,
        lambda s: messages.append(f"{s.phase}/{s.reason}: {s.message}"),
        sleep=clock.sleep,
    )
    sup.start()
    assert sup._task is not None
    idle = asyncio.create_task(driver.idle.wait())
    done, _ = await asyncio.wait({sup._task, idle}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert done, "the supervisor neither finished nor used up its script"
    await sup.close()
    idle.cancel()
    return Played(sup, driver, clock, messages)


RESTARTS = "restarts"


@pytest.mark.parametrize(
    ("policy", "code", "outcome"),
    [
        (RestartPolicy.ALWAYS, 0, RESTARTS),
        (RestartPolicy.ALWAYS, 1, RESTARTS),
        (RestartPolicy.ALWAYS, -9, RESTARTS),
        (RestartPolicy.ON_FAILURE, 0, (InstancePhase.SUCCEEDED, "Completed", "exited with code 0")),
        (RestartPolicy.ON_FAILURE, 1, RESTARTS),
        (RestartPolicy.ON_FAILURE, 137, RESTARTS),
        (RestartPolicy.ON_FAILURE, -9, RESTARTS),
        (RestartPolicy.ON_FAILURE, None, RESTARTS),  # exit unknown: not known to be clean
        (RestartPolicy.NEVER, 0, (InstancePhase.SUCCEEDED, "Completed", "exited with code 0")),
        (RestartPolicy.NEVER, 1, (InstancePhase.FAILED, "Error", "exited with code 1")),
        (RestartPolicy.NEVER, -9, (InstancePhase.FAILED, "Error", "killed by signal 9")),
        (
            RestartPolicy.NEVER,
            None,
            (InstancePhase.FAILED, "Error", "exited while the agent was away (exit code unknown)"),
        ),
    ],
)
async def test_policy_by_exit_code(
    policy: RestartPolicy, code: int | None, outcome: object
) -> None:
    p = await play(policy, [Run(code=code)])
    if outcome == RESTARTS:
        assert (p.driver.starts, p.sup.restarts, p.clock.slept) == (2, 1, [1.0])
        assert p.sup.phase is InstancePhase.RUNNING
        # The exited task's files go before the restart; the message says why and when.
        assert p.driver.removed == ["w-0"]
        text = (
            "exited while the agent was away (exit code unknown)"
            if code is None
            else f"killed by signal {-code}"
            if code < 0
            else f"exited with code {code}"
        )
        backoff = [m for m in p.messages if "/BackOff: " in m]
        assert len(backoff) == 1 and backoff[0].startswith(f"{InstancePhase.STARTING}/BackOff: ")
        assert backoff[0].endswith(f"BackOff: {text}; restarting in 1s")
        assert ": " not in backoff[0].removeprefix(f"{InstancePhase.STARTING}/BackOff: ")
    else:
        assert (p.driver.starts, p.sup.restarts, p.clock.slept) == (1, 0, [])
        assert (p.sup.phase, p.sup.reason, p.sup.message) == outcome
        assert p.sup.exit_code == code


# Each delay doubles from 1 s up to BACKOFF_MAX.
DOUBLING = [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


@pytest.mark.parametrize("policy", [RestartPolicy.ALWAYS, RestartPolicy.ON_FAILURE])
async def test_backoff_doubles_up_to_the_cap(policy: RestartPolicy) -> None:
    assert BACKOFF_MAX == 30.0
    p = await play(policy, [Run(code=1, ran=1.0)] * len(DOUBLING))
    assert p.clock.slept == DOUBLING
    assert p.sup.restarts == len(DOUBLING)
    said = [m.rsplit("restarting in ", 1)[1] for m in p.messages if "BackOff" in m]
    assert said == [f"{d:.0f}s" for d in DOUBLING]


async def test_start_failures_back_off_the_same_way_and_never_gives_up() -> None:
    runs = [Run(start_error="no such binary")] * 6 + [Run(code=1, ran=1.0)]
    p = await play(RestartPolicy.ON_FAILURE, runs)
    # The exit after the failed starts continues the same sequence.
    assert p.clock.slept == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert p.sup.restarts == 7
    retrying = [m for m in p.messages if "StartFailed: no such binary; retrying in" in m]
    assert len(retrying) == 6
    assert all(m.startswith(f"{InstancePhase.STARTING}/") for m in retrying)


async def test_a_start_failure_under_never_fails_the_instance() -> None:
    p = await play(RestartPolicy.NEVER, [Run(start_error="no such binary")])
    assert (p.sup.phase, p.sup.reason, p.sup.message) == (
        InstancePhase.FAILED,
        "StartFailed",
        "no such binary",
    )
    assert (p.driver.starts, p.clock.slept) == (1, [])
    assert p.sup.exit_code is None and p.sup.finished_at is not None


@pytest.mark.parametrize(
    ("healthy_ran", "after"),
    [
        (HEALTHY_RUN, [1.0, 2.0]),  # a healthy run starts the sequence over
        (HEALTHY_RUN - 0.5, [16.0, 30.0]),  # a shorter one does not
    ],
)
async def test_a_healthy_run_resets_the_backoff(healthy_ran: float, after: list[float]) -> None:
    runs = [Run(ran=1.0)] * 4 + [Run(ran=healthy_ran), Run(ran=1.0)]
    p = await play(RestartPolicy.ALWAYS, runs)
    assert p.clock.slept == [1.0, 2.0, 4.0, 8.0, *after]


class RecordingDriver(ScriptedDriver):
    """Records the RunSpec of each start."""

    def __init__(self, clock: Clock, runs: list[Run]) -> None:
        super().__init__(clock, runs)
        self.specs: list[RunSpec] = []

    async def start(self, run: RunSpec) -> TaskInfo:
        self.specs.append(run)
        return await super().start(run)


def _supervised(driver: ScriptedDriver, spec: WorkloadSpec, **kw: object) -> Supervised:
    return Supervised("w-0", 1, spec, driver, lambda s: None, sleep=driver.clock.sleep, **kw)  # type: ignore[arg-type]


async def test_an_adopted_task_is_watched_not_started_again() -> None:
    # After an agent restart the running task is adopted: no second copy is started, and the
    # instance is RUNNING since the adopted task's start.
    clock = Clock()
    driver = ScriptedDriver(clock, [])
    spec = WorkloadSpec(name="w", kind=WorkloadKind.PROCESS, command=["x"])
    sup = _supervised(driver, spec)
    adopted = TaskInfo(
        instance="w-0", workload="w", driver="scripted", state=TaskState.RUNNING, started_at=12.5
    )
    sup.start(adopted)
    await asyncio.wait_for(driver.idle.wait(), 10)
    assert (driver.starts, sup.phase, sup.started_at) == (0, InstancePhase.RUNNING, 12.5)
    assert sup._task is not None and sup._task.get_name() == "instance-w-0"
    await sup.close()
    # close stops watching (the task is done) without stopping or removing what runs.
    assert sup._task.done() and sup.phase is InstancePhase.RUNNING


async def test_secret_files_are_resolved_into_the_started_spec() -> None:
    class Files:
        def resolve(self, spec: WorkloadSpec) -> WorkloadSpec:
            # As SecretFiles does: the values join secret_env, the references go.
            update = {"secret_env": {"PW": "from-file"}, "secret_env_files": {}}
            return spec.model_copy(update=update)

    clock = Clock()
    driver = RecordingDriver(clock, [])
    spec = WorkloadSpec(
        name="w",
        kind=WorkloadKind.PROCESS,
        command=["x"],
        secret_env_files={"PW": "/run/secrets/pw"},
    )
    sup = _supervised(driver, spec, secret_files=Files())
    sup.start()
    await asyncio.wait_for(driver.idle.wait(), 10)
    await sup.close()
    assert [s.spec.secret_env for s in driver.specs] == [{"PW": "from-file"}]
    assert (driver.specs[0].instance, driver.specs[0].workload) == ("w-0", "w")
    # The file's content is read at each start, never kept on the supervisor.
    assert sup.spec.secret_env == {}


async def test_the_drivers_reason_and_message_name_the_exit() -> None:
    oom = Run(code=137, reason="OOMKilled", message="memory limit 64 MiB reached")
    p = await play(RestartPolicy.NEVER, [oom])
    assert (p.sup.phase, p.sup.reason, p.sup.message) == (
        InstancePhase.FAILED,
        "OOMKilled",
        "memory limit 64 MiB reached (exit code 137)",
    )
    p = await play(RestartPolicy.ON_FAILURE, [oom])
    assert any(
        m.endswith(
            "BackOff: OOMKilled: memory limit 64 MiB reached (exit code 137); restarting in 1s"
        )
        for m in p.messages
    )


async def test_report_carries_every_field() -> None:
    p = await play(RestartPolicy.NEVER, [Run(code=3, ran=2.0)])
    assert p.sup.report() == InstanceReport(
        name="w-0",
        workload="w",
        phase=InstancePhase.FAILED,
        reason="Error",
        message="exited with code 3",
        exit_code=3,
        restarts=0,
        started_at=1000.0,
        finished_at=1002.0,
        # It was HEALTHY while it ran (no check), UNKNOWN once it ended.
        health=HealthState.UNKNOWN,
        health_changed_at=p.sup.health_changed_at,
    )
    assert p.sup.health_changed_at is not None
    p = await play(RestartPolicy.ALWAYS, [Run(code=0)])
    report = p.sup.report()
    assert (report.restarts, report.phase, report.health) == (
        1,
        InstancePhase.RUNNING,
        HealthState.HEALTHY,
    )


async def test_an_error_the_agent_expects_fails_the_instance_logged_once() -> None:
    # A spec the driver refuses (an OrkaError, not a start failure): FAILED with the reason
    # AgentError and the whole message, one warning naming the instance, the error cut at 200.
    class Refusing(ScriptedDriver):
        async def start(self, run: RunSpec) -> TaskInfo:
            raise Invalid("spec.image: " + "x" * 300)

    driver = Refusing(Clock(), [])
    spec = WorkloadSpec(name="w", kind=WorkloadKind.PROCESS, command=["x"])
    sup = _supervised(driver, spec)
    with structlog.testing.capture_logs() as logs:
        sup.start()
        assert sup._task is not None
        await asyncio.wait_for(sup._task, 10)
    assert (sup.phase, sup.reason, sup.message) == (
        InstancePhase.FAILED,
        "AgentError",
        "spec.image: " + "x" * 300,
    )
    assert logs == [
        {
            "event": "instance failed",
            "instance": "w-0",
            "error": ("spec.image: " + "x" * 300)[:200],
            "log_level": "warning",
        }
    ]


async def test_an_unexpected_error_fails_the_instance_with_a_traceback_logged() -> None:
    class Broken(ScriptedDriver):
        async def start(self, run: RunSpec) -> TaskInfo:
            raise ValueError("driver bug")

    sup = _supervised(
        Broken(Clock(), []), WorkloadSpec(name="w", kind=WorkloadKind.PROCESS, command=["x"])
    )
    with structlog.testing.capture_logs() as logs:
        sup.start()
        assert sup._task is not None
        await asyncio.wait_for(sup._task, 10)
    assert (sup.phase, sup.reason, sup.message) == (
        InstancePhase.FAILED,
        "AgentError",
        "driver bug",
    )
    assert logs == [
        {
            "event": "instance supervisor failed",
            "instance": "w-0",
            "exc_info": True,
            "log_level": "error",
        }
    ]
