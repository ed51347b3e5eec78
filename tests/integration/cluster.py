"""An in-process cluster on real grpc.aio servers (port 0, mutual TLS) for integration tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from orka.agent.service import Agent, AgentConfig
from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller.service import Controller, ControllerConfig
from orka.rpc.client import secure_channel
from orka.rpc.pages import list_all
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T | None]], timeout: float = 20.0, interval: float = 0.05
) -> T:
    """Poll until `check` returns something truthy; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        try:
            last = await check()
        except grpc.aio.AioRpcError as err:
            # A service that is (re)starting answers UNAVAILABLE for a moment.
            last = err  # type: ignore[assignment]
        else:
            if last:
                return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last value: {last!r}")


class Cluster:
    def __init__(self, certs: Path, data: Path, **scheduler_opts: float) -> None:
        self.certs = certs
        self.data = data
        self.scheduler = Scheduler(
            SchedulerConfig(listen="127.0.0.1:0", **scheduler_opts),  # type: ignore[arg-type]
            TlsFiles.for_service(certs, "scheduler", "scheduler"),
        )
        self.controller: Controller | None = None
        self.agents: dict[str, Agent] = {}
        self._channel = None
        self.api: pb_grpc.ControllerStub | None = None

    async def start(self, agents: int = 0, store_url: str = "", **agent_opts: object) -> None:
        await self.scheduler.start()
        await self.start_controller(store_url)
        for i in range(1, agents + 1):
            await self.add_agent(f"node-{i}", **agent_opts)
        controller = self.controller
        assert controller is not None

        # An agent is registered at the scheduler before the controller's feed has written its
        # node record; tests that read nodes at once must find every one.
        async def nodes_known() -> bool:
            return all(name in controller.api.repo.nodes for name in self.agents)

        await eventually(nodes_known, timeout=10)

    async def start_controller(self, store_url: str = "", **config: object) -> Controller:
        self.controller = Controller(
            ControllerConfig(
                listen="127.0.0.1:0",
                schedulers=[f"127.0.0.1:{self.scheduler.port}"],
                store_url=store_url,
                data_dir=self.data / "controller",
                **config,  # type: ignore[arg-type]
            ),
            TlsFiles.for_service(self.certs, "controller", "controller"),
        )
        await self.controller.start()
        if self._channel is not None:
            await self._channel.close()
        self._channel = secure_channel(
            f"127.0.0.1:{self.controller.port}",
            TlsFiles.for_service(self.certs, "admin", "admin"),
            "controller",
        )
        self.api = pb_grpc.ControllerStub(self._channel)
        await asyncio.wait_for(self.controller.link.connected.wait(), 10)
        return self.controller

    async def add_agent(self, name: str, cls: type[Agent] = Agent, **opts: object) -> Agent:
        config = AgentConfig(
            name=name,
            schedulers=[f"127.0.0.1:{self.scheduler.port}"],
            data_dir=self.data / "agents" / name,
            **opts,  # type: ignore[arg-type]
        )
        agent = cls(config, TlsFiles.for_service(self.certs, "agent", name))
        await agent.start()
        await asyncio.wait_for(agent.connected.wait(), 10)
        self.agents[name] = agent
        return agent

    async def instances(self, workload: str = "") -> list[pb.Instance]:
        assert self.api is not None
        items, _ = await list_all(
            self.api.ListInstances, pb.ListInstancesRequest(workload=workload), "instances"
        )
        return items

    async def running(self, workload: str) -> list[pb.Instance]:
        return [i for i in await self.instances(workload) if i.phase == pb.Instance.RUNNING]

    async def stop(self) -> None:
        """Stop every part even when one of them fails, then report the first failure."""
        errors: list[BaseException] = []
        parts = [a.stop for a in self.agents.values()]
        if self.controller is not None:
            parts.append(self.controller.stop)
        parts.append(self.scheduler.stop)
        if self._channel is not None:
            parts.append(self._channel.close)
        for stop in parts:
            try:
                await stop()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]


def process_spec(name: str = "web", replicas: int = 0, **fields: object) -> pb.WorkloadSpec:
    """A PROCESS workload's spec for the API, with any field given."""
    data: dict[str, object] = {
        "name": name,
        "kind": pb.WorkloadSpec.PROCESS,
        "command": ["sleep", "100"],
        "replicas": replicas,
    }
    data.update(fields)
    return pb.WorkloadSpec(**data)  # type: ignore[arg-type]


async def crash(agent: Agent) -> None:
    """The agent vanishes as if SIGKILLed, in-process: its stream is cut without a leave, its
    instances' tasks are left running, the state file keeps what it last saved, and a later
    stop() does nothing (a killed process stops nothing either)."""
    agent._stopped = True
    await agent.parts.stop()
    for inst in agent.instances.values():
        await inst.close()
    await agent.state_file.flush()
