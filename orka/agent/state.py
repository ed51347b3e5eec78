"""The agent's small local state file, so a restarted agent knows what it was running."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, Field, ValidationError

from orka.models import InstancePhase, WorkloadSpec

log = structlog.get_logger("orka.agent.state")


class InstanceRecord(BaseModel):
    name: str
    workload: str
    generation: int
    spec: WorkloadSpec
    phase: InstancePhase
    restarts: int = 0
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    reason: str = ""
    message: str = ""


class AgentState(BaseModel):
    node: str
    instances: dict[str, InstanceRecord] = Field(default_factory=dict)


class StateFile:
    """Written atomically (temp file + rename) and coalesced, never from the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dirty = asyncio.Event()
        self._pending: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        # A cancelled to_thread call keeps running; this keeps two writes from interleaving.
        self._write_lock = threading.Lock()

    def load(self, node: str) -> AgentState:
        try:
            data = json.loads(self.path.read_text())
            state = AgentState.model_validate(data)
        except FileNotFoundError:
            return AgentState(node=node)
        except (ValueError, ValidationError) as err:
            # A corrupt file must not keep the agent from starting: the driver's own records
            # still let it find running tasks, which it then treats as orphans.
            log.warning("ignoring unreadable state file", path=str(self.path), error=str(err))
            return AgentState(node=node)
        if state.node != node:
            log.warning("state file belongs to another node", path=str(self.path), node=state.node)
            return AgentState(node=node)
        return state

    def save(self, state: AgentState) -> None:
        self._pending = state.model_dump(mode="json")
        self._dirty.set()
        if self._task is None:
            self._task = asyncio.create_task(self._writer(), name="state-writer")

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            data, self._pending = self._pending, None
            if data is not None:
                await asyncio.to_thread(self._write, data)
            await asyncio.sleep(0.05)

    def _write(self, data: dict[str, Any]) -> None:
        with self._write_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    async def flush(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._pending is not None:
            data, self._pending = self._pending, None
            await asyncio.to_thread(self._write, data)
