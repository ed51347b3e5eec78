"""One supervised instance: start it, watch it, restart it by policy, stop it on request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from orka.agent import health as checks
from orka.agent.secret_files import SecretFiles
from orka.errors import OrkaError, RuntimeFailure
from orka.models import (
    TERMINAL_PHASES,
    HealthState,
    InstancePhase,
    InstanceReport,
    PortBinding,
    Resources,
    RestartPolicy,
    VolumeAttachment,
    WorkloadSpec,
)
from orka.runtime.base import Driver, RunSpec, TaskInfo, TaskState
from orka.runtime.volumes import MountedVolume

if TYPE_CHECKING:
    from orka.agent.volumes import VolumeManager

log = structlog.get_logger("orka.agent")

BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
# The reason of a restart the agent made because the health check failed.
UNHEALTHY_REASON = "Unhealthy"
# While its volumes are being provisioned (STARTING), and when they cannot be (FAILED).
VOLUME_PENDING = "VolumePending"
VOLUME_FAILED = "VolumeFailed"
# A task that ran this long before exiting resets the restart backoff.
HEALTHY_RUN = 10.0


class Supervised:
    def __init__(
        self,
        name: str,
        generation: int,
        spec: WorkloadSpec,
        driver: Driver,
        on_change: Callable[[Supervised], None],
        secret_files: SecretFiles | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        host_ip: str = "",
        volumes: VolumeManager | None = None,
        attachments: tuple[VolumeAttachment, ...] = (),
    ) -> None:
        self.name = name
        # Its volumes (Assignment.volumes), provisioned by `volumes` before each start.
        self.volume_manager = volumes
        self.volumes = attachments
        self.generation = generation
        self.spec = spec
        self.driver = driver
        self.on_change = on_change
        self.secret_files = secret_files or SecretFiles()
        # How the restart backoff waits; a test passes a clock it controls.
        self._sleep = sleep
        self.phase = InstancePhase.SCHEDULED
        self.reason = ""
        self.message = ""
        self.exit_code: int | None = None
        self.restarts = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        # Where it is reached: its node's address, and what its driver gave it once running.
        self.host_ip = host_ip
        self.address = ""
        self.ports: list[PortBinding] = []
        self.health = HealthState.UNKNOWN
        self.health_message = ""
        self.health_changed_at: float | None = None
        self.stopping = False
        # Its health check while it runs, and the failure that made the agent kill it for a
        # restart (the restart's reason then says so).
        self._checker: checks.Checker | None = None
        self._unhealthy: str | None = None
        self._kill: asyncio.Task[object] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None

    @property
    def workload(self) -> str:
        return self.spec.name

    @property
    def resources(self) -> Resources:
        return self.spec.resources

    @property
    def holds_resources(self) -> bool:
        return self.phase not in TERMINAL_PHASES

    def report(self) -> InstanceReport:
        return InstanceReport(
            name=self.name,
            workload=self.workload,
            phase=self.phase,
            reason=self.reason,
            message=self.message,
            exit_code=self.exit_code,
            restarts=self.restarts,
            started_at=self.started_at,
            finished_at=self.finished_at,
            address=self.address,
            host_ip=self.host_ip,
            ports=self.ports,
            health=self.health,
            health_message=self.health_message,
            health_changed_at=self.health_changed_at,
        )

    @property
    def checked(self) -> bool:
        """Whether a health check decides its health; without one it is HEALTHY while it
        runs."""
        return self.spec.health_check is not None

    def _set(self, phase: InstancePhase, reason: str = "", message: str = "") -> None:
        self.phase = phase
        self.reason = reason
        self.message = message
        if phase in TERMINAL_PHASES and self.volume_manager is not None:
            # Done with its volumes: they may be deleted, or used by a VM elsewhere.
            self.volume_manager.release(self.name)
        if phase is not InstancePhase.RUNNING:
            self._health(HealthState.UNKNOWN, "")
            if self._checker is not None:
                self._checker.stop()
                self._checker = None
        elif not self.checked:
            self._health(HealthState.HEALTHY, "")
        elif self._checker is None and not self.stopping:
            self._start_checker()
        self.on_change(self)

    def _start_checker(self) -> None:
        check = self.spec.health_check
        assert check is not None
        self._checker = checks.Checker(self.name, check, self._probe, self._verdict)
        self._checker.start()

    async def _probe(self) -> str | None:
        """One probe of its check, against where it runs now."""
        check = self.spec.health_check
        assert check is not None
        if check.exec is not None:
            try:
                code, output = await self.driver.check_exec(
                    self.name, self.spec, list(check.exec.command)
                )
            except OrkaError as err:
                return f"exec {check.exec.command[0]}: {err.message}"
            if code == 0:
                return None
            said = " ".join(output.split())[:200]
            return f"exec {check.exec.command[0]}: {_exit_text(code)}" + (
                f": {said}" if said else ""
            )
        where = checks.target(check.port, self.address, self.host_ip, self.ports)
        if isinstance(where, str):
            return where
        if check.http is not None:
            h = check.http
            return await checks.http_probe(*where, h.path, h.status_min, h.status_max)
        return await checks.tcp_probe(*where)

    def _verdict(self, health: HealthState, message: str) -> None:
        """A change of its check's verdict: reported; UNHEALTHY also kills it so that it
        restarts by its policy (Nomad's check_restart). With restart_policy NEVER it keeps
        running, reported UNHEALTHY: killing it would end it for good."""
        if self.phase is not InstancePhase.RUNNING or self.stopping:
            return
        if self._health(health, message):
            self.on_change(self)
        if health is not HealthState.UNHEALTHY:
            return
        if self.spec.restart_policy is RestartPolicy.NEVER or self._kill is not None:
            return
        log.info("restarting unhealthy instance", instance=self.name, failure=message[:200])
        self._unhealthy = message
        self._kill = asyncio.create_task(self._kill_unhealthy(), name=f"unhealthy-{self.name}")

    async def _kill_unhealthy(self) -> None:
        try:
            await self.driver.stop(self.name, self.spec.stop_grace_seconds)
        except Exception as err:
            log.warning("stopping an unhealthy instance failed", instance=self.name, error=str(err))
        finally:
            self._kill = None

    def _health(self, health: HealthState, message: str) -> bool:
        """Record a health verdict; whether it changed (the caller reports the change)."""
        if health is self.health and message == self.health_message:
            return False
        if health is not self.health:
            self.health_changed_at = time.time()
        self.health, self.health_message = health, message
        return True

    def start(self, adopted: TaskInfo | None = None) -> None:
        self._task = asyncio.create_task(self._run(adopted), name=f"instance-{self.name}")

    async def _run(self, adopted: TaskInfo | None) -> None:
        backoff = BACKOFF_START
        info = adopted
        try:
            while not self.stopping:
                if info is None:
                    # STARTING (VolumePending while its volumes are being provisioned).
                    mounted = await self._volumes_ready()
                    if mounted is None:
                        return
                    try:
                        spec = self.spec
                        if spec.secret_env_files:
                            # Read at each start, never kept: a rotated file takes effect then.
                            spec = await asyncio.to_thread(self.secret_files.resolve, spec)
                        info = await self.driver.start(
                            RunSpec(
                                instance=self.name,
                                workload=self.workload,
                                spec=spec,
                                volumes=mounted,
                            )
                        )
                    except RuntimeFailure as err:
                        self.exit_code = None
                        self.finished_at = time.time()
                        if not self._should_restart(None):
                            self._set(InstancePhase.FAILED, "StartFailed", err.message)
                            return
                        self._set(
                            InstancePhase.STARTING,
                            "StartFailed",
                            f"{err.message}; retrying in {backoff:.0f}s",
                        )
                        await self._sleep(backoff)
                        backoff = min(backoff * 2, BACKOFF_MAX)
                        self.restarts += 1
                        continue
                if info.state is TaskState.RUNNING:
                    self.started_at = info.started_at
                    self.address, self.ports = info.address, info.ports
                    self.exit_code = None
                    self.finished_at = None
                    self._set(InstancePhase.RUNNING)
                    info = await self.driver.wait(self.name)
                if self.stopping:
                    return
                code = info.exit_code
                self.exit_code = code
                self.finished_at = info.finished_at or time.time()
                ran = self.finished_at - (self.started_at or self.finished_at)
                # A driver's own reason (OOMKilled) says more than the exit code.
                failed_reason = info.reason or "Error"
                text = f"{info.message} (exit code {code})" if info.reason else _exit_text(code)
                unhealthy, self._unhealthy = self._unhealthy, None
                if unhealthy is not None:
                    # The agent killed it for its health check: it restarts whatever the exit
                    # code (the check only kills when the policy restarts).
                    restart_reason, text = UNHEALTHY_REASON, f"health check failed: {unhealthy}"
                elif not self._should_restart(code):
                    phase = InstancePhase.SUCCEEDED if code == 0 else InstancePhase.FAILED
                    self._set(phase, "Completed" if code == 0 else failed_reason, text)
                    return
                else:
                    restart_reason = "BackOff"
                    text = f"{info.reason}: {text}" if info.reason else text
                if ran >= HEALTHY_RUN:
                    backoff = BACKOFF_START
                # It starts again here: its address and host ports stay its own meanwhile.
                await self.driver.remove(self.name, keep_network=True)
                self._set(
                    InstancePhase.STARTING,
                    restart_reason,
                    f"{text}; restarting in {backoff:.0f}s",
                )
                await self._sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                self.restarts += 1
                info = None
        except asyncio.CancelledError:
            raise
        except OrkaError as err:
            # An error the code expects (a spec the driver refuses): logged once, without a
            # traceback; the controller re-places the instance, with backoff.
            log.warning("instance failed", instance=self.name, error=err.message[:200])
            self._set(InstancePhase.FAILED, "AgentError", err.message)
        except Exception as err:
            log.exception("instance supervisor failed", instance=self.name)
            self._set(InstancePhase.FAILED, "AgentError", str(err))

    async def _volumes_ready(self) -> tuple[MountedVolume, ...] | None:
        """Its volumes, provisioned first (the start's prerequisite): STARTING with
        VolumePending while that takes; FAILED with VolumeFailed (never started) when a volume
        cannot be had."""
        if not self.volumes:
            self._set(InstancePhase.STARTING)
            return ()
        if self.volume_manager is None:
            self._set(InstancePhase.FAILED, VOLUME_FAILED, "this agent keeps no volumes")
            return None
        if self.volume_manager.ready(self.volumes):
            self._set(InstancePhase.STARTING)
        else:
            names = ", ".join(a.name for a in self.volumes)
            self._set(InstancePhase.STARTING, VOLUME_PENDING, f"provisioning volumes: {names}")
        try:
            mounted = await self.volume_manager.acquire(self.name, self.spec.kind, self.volumes)
        except OrkaError as err:
            self.finished_at = time.time()
            self._set(InstancePhase.FAILED, VOLUME_FAILED, err.message)
            return None
        if self.reason == VOLUME_PENDING:
            self._set(InstancePhase.STARTING)
        return mounted

    def _should_restart(self, code: int | None) -> bool:
        policy = self.spec.restart_policy
        if policy is RestartPolicy.ALWAYS:
            return True
        if policy is RestartPolicy.ON_FAILURE:
            return code != 0
        return False

    async def stop(self, remove: bool, reason: str = "") -> None:
        """Stop (SIGTERM, grace, SIGKILL) and, when asked, forget the task's files."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop(remove, reason))
        await asyncio.shield(self._stop_task)

    async def _stop(self, remove: bool, reason: str) -> None:
        self.stopping = True
        if self.phase not in (InstancePhase.SUCCEEDED, InstancePhase.FAILED):
            self._set(InstancePhase.STOPPING, "Stopping", reason)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            info = await self.driver.stop(self.name, self.spec.stop_grace_seconds)
            if self.phase is InstancePhase.STOPPING:
                self.exit_code = info.exit_code
        except Exception as err:
            log.warning("stop failed", instance=self.name, error=str(err))
        if remove:
            try:
                await self.driver.remove(self.name)
            except Exception as err:
                log.warning("remove failed", instance=self.name, error=str(err))
        self.finished_at = self.finished_at or time.time()
        if self.phase is InstancePhase.STOPPING:
            self._set(InstancePhase.STOPPED, "Stopped", reason)
        else:
            self.on_change(self)

    async def close(self) -> None:
        """Stop watching without touching the task, so a later agent can re-adopt it."""
        if self._checker is not None:
            self._checker.stop()
            self._checker = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited while the agent was away (exit code unknown)"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exited with code {code}"
