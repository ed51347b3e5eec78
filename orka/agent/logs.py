"""The agent's keeper of instance logs: the size bound (rotation) and the size index `since`
reads. One pass per interval over every instance's files, off the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

import structlog

from orka.agent.supervisor import Supervised
from orka.runtime.logs import SizeIndex, rotate

log = structlog.get_logger("orka.agent")

CHECK_INTERVAL = 1.0


class LogKeeper:
    def __init__(
        self,
        instances: Mapping[str, Supervised],
        max_bytes: int,
        interval: float = CHECK_INTERVAL,
    ) -> None:
        self.instances = instances
        self.max_bytes = max_bytes
        self.interval = interval
        self.indexes: dict[Path, SizeIndex] = {}

    def paths(self) -> list[Path]:
        out: set[Path] = set()
        for inst in list(self.instances.values()):
            if inst.driver.log_backup is not None or not inst.driver.keeps_logs:
                continue  # its writer bounds them, or there are none
            try:
                out.update(inst.driver.log_paths(inst.name))
            except Exception:  # a driver that cannot say: nothing to keep
                continue
        return sorted(out)

    def check(self, paths: list[Path]) -> None:
        """One pass (blocking): rotate what passed the bound, note every file's size."""
        now = time.time()
        for path in paths:
            index = self.indexes.get(path)
            if index is None:
                index = self.indexes[path] = SizeIndex()
            try:
                if rotate(path, self.max_bytes):
                    index.rotations += 1
                size = path.stat().st_size
            except OSError as err:
                if not isinstance(err, FileNotFoundError):
                    log.warning("log rotation failed", path=str(path), error=str(err))
                continue
            index.note(now, size)
        for gone in set(self.indexes) - set(paths):
            del self.indexes[gone]

    async def run(self) -> None:
        while True:
            paths = self.paths()
            if paths or self.indexes:  # nothing to look at: no trip to a thread
                await asyncio.to_thread(self.check, paths)
            await asyncio.sleep(self.interval)
